"""Prefill's OpenAI answer, read: the ``kv_transfer_params`` a decode leg gets (checked), the
first token (:class:`FirstToken`, from a whole answer or a stream's chunks) and a stream's event
lines. No I/O: the routes read the bytes, this reads what they say.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..flags import token_limit

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def _json_type_name(value: Any) -> str:
    """Name a parsed JSON value's type as JSON does, for error messages."""
    names = {bool: "boolean", int: "number", float: "number", str: "string", list: "array"}
    return names.get(type(value), type(value).__name__)


class InvalidPrefillResponse(ValueError):
    """A prefill instance answered 2xx with a body the proxy cannot hand to a decode instance."""


def kv_transfer_params_from_prefill(response_body: bytes) -> dict[str, Any] | None:
    """Return the ``kv_transfer_params`` object of a prefill response (``None`` if absent/null).

    Raises :class:`InvalidPrefillResponse` if the body is not a JSON object or the parameters
    are not an object: forwarding them would only make the decode instance fail less clearly.
    """
    try:
        response = json.loads(response_body)
    except ValueError as error:
        raise InvalidPrefillResponse(f"the response is not JSON ({error})") from error
    if not isinstance(response, dict):
        raise InvalidPrefillResponse(
            f"the response is a JSON {_json_type_name(response)}, not an object"
        )
    params = response.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise InvalidPrefillResponse(
            "kv_transfer_params must be a JSON object, "
            f"got a {_json_type_name(params)}: {json.dumps(params)[:200]}"
        )
    return params


@dataclass(frozen=True)
class FirstToken:
    """Prefill's answer to a continued request's prefill leg."""

    path: str
    answer: dict[str, Any]
    prompt_token_ids: list[int]
    token_ids: list[int]

    @property
    def chat(self) -> bool:
        return self.path == CHAT

    @property
    def choice(self) -> dict[str, Any]:
        return self.answer["choices"][0]

    @property
    def text(self) -> str:
        """The token's text: a completion's ``text`` or a chat message's ``content``."""
        if self.chat:
            return self.choice.get("message", {}).get("content") or ""
        return self.choice.get("text") or ""

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        params = self.answer.get("kv_transfer_params")
        return params if isinstance(params, dict) else None

    def ends_answer(self, client_body: Mapping[str, Any]) -> bool:
        """Whether the answer is complete with this token: it reached the client's limit, or
        ended the answer (EOS, a stop string or token), or prefill did not hold its KV."""
        return (
            self.choice.get("finish_reason") != "length"
            or token_limit(client_body) == 1
            or self.kv_transfer_params is None
        )


def _token_ids(value: Any) -> list[int] | None:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        return None
    return value


def first_token(path: str, response_body: bytes) -> FirstToken | None:
    """Read prefill's answer to a continued request's prefill leg; None if it lacks what decode
    continues from (one choice with its token ids and the prompt's: an instance that ignores
    ``return_token_ids``), and decode then samples the first token again.

    Raises :class:`InvalidPrefillResponse` if the answer is no JSON object or its
    ``kv_transfer_params`` no object."""
    kv_transfer_params_from_prefill(response_body)  # raises for what no leg can use
    answer = json.loads(response_body)
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    token_ids = _token_ids(choices[0].get("token_ids"))
    where = answer if path == CHAT else choices[0]
    prompt_token_ids = _token_ids(where.get("prompt_token_ids"))
    if not token_ids or not prompt_token_ids:
        return None
    return FirstToken(path, answer, prompt_token_ids, token_ids)


def first_token_from_stream(
    path: str, chunks: list[dict[str, Any]], held_at: dict[str, Any] | None
) -> FirstToken | None:
    """Prefill's streamed answer to a continued request's prefill leg, read up to and with the
    chunk of its token (and any after it), as the whole answer it stands for; None if it lacks
    the token ids. Streams carry no ``kv_transfer_params``: ``held_at`` are the ones decode
    needs when prefill held the KV (the engine's address and the proxy's transfer id), the
    prompt's length and prefill's token added here."""
    chunks = [chunk for chunk in chunks if isinstance(chunk, dict)]
    token_chunks = [c for c in chunks if c.get("choices") and isinstance(c["choices"][0], dict)]
    if not token_chunks:
        return None
    first = token_chunks[0]
    choice: dict[str, Any] = {"index": 0}
    texts, token_ids, logprobs, prompt_token_ids = [], [], [], None
    for chunk in token_chunks:
        part = chunk["choices"][0]
        prompt_token_ids = (
            chunk.get("prompt_token_ids") or part.get("prompt_token_ids") or (prompt_token_ids)
        )
        token_ids += _token_ids(part.get("token_ids")) or []
        if path == CHAT:
            texts.append((part.get("delta") or {}).get("content") or "")
            logprobs += (part.get("logprobs") or {}).get("content") or []
        else:
            texts.append(part.get("text") or "")
            logprobs.append(part.get("logprobs"))
        for key in ("finish_reason", "stop_reason"):
            if part.get(key) is not None:
                choice[key] = part[key]
    prompt_token_ids = _token_ids(prompt_token_ids)
    if not token_ids or not prompt_token_ids:
        return None
    choice.setdefault("finish_reason", None)
    choice.setdefault("stop_reason", None)
    choice["token_ids"] = token_ids
    if path == CHAT:
        choice["message"] = {"role": "assistant", "content": "".join(texts)}
        choice["logprobs"] = {"content": logprobs} if logprobs else None
    else:
        choice["text"] = "".join(texts)
        choice["logprobs"] = _joined_completion_logprobs(logprobs)
        choice["prompt_token_ids"] = prompt_token_ids
    answer: dict[str, Any] = {
        key: first.get(key) for key in ("id", "created", "model") if key in first
    }
    answer["object"] = "chat.completion" if path == CHAT else "text_completion"
    answer["choices"] = [choice]
    usage = next((c["usage"] for c in chunks if isinstance(c.get("usage"), dict)), None)
    if usage is not None:
        answer["usage"] = usage
    if path == CHAT:
        answer["prompt_token_ids"] = prompt_token_ids
    ended = choice["finish_reason"] not in (None, "length")
    if held_at is not None and not ended:
        answer["kv_transfer_params"] = {
            **held_at,
            "remote_num_tokens": len(prompt_token_ids),
            "remote_output_token_ids": token_ids,
        }
    return FirstToken(path, answer, prompt_token_ids, token_ids)


def _joined_completion_logprobs(parts: list[Any]) -> dict[str, Any] | None:
    """The completion logprobs of several stream chunks as one answer's."""
    parts = [part for part in parts if isinstance(part, dict)]
    if not parts:
        return None
    keys = ("text_offset", "token_logprobs", "tokens", "top_logprobs")
    return {key: [value for part in parts for value in part.get(key) or []] for key in keys}


def event_data(line: str) -> dict[str, Any] | None:
    """An event line's JSON object; None for other lines and ``[DONE]``."""
    if not line.startswith("data:"):
        return None
    payload = line[len("data:") :].strip()
    if not payload or payload == "[DONE]":
        return None
    chunk = json.loads(payload)
    return chunk if isinstance(chunk, dict) else None


def finish_reason(chunks: list[dict[str, Any]]) -> Any:
    """The last finish reason a stream's chunks gave (None: none did)."""
    reasons = [
        choice.get("finish_reason")
        for chunk in chunks
        for choice in (chunk.get("choices") or [])[:1]
        if isinstance(choice, dict) and choice.get("finish_reason") is not None
    ]
    return reasons[-1] if reasons else None


def _carries_token(chunk: dict[str, Any]) -> bool:
    """Whether a prefill stream's chunk is the one its token arrives in (or an error)."""
    choices = chunk.get("choices") or []
    return "error" in chunk or bool(choices and (choices[0] or {}).get("token_ids"))


async def chunks_until_token(lines: AsyncIterator[str]) -> list[dict[str, Any]]:
    """A prefill stream's chunks up to the first that carries token ids (or an error); the
    lines after it are left to read."""
    chunks = []
    async for line in lines:
        chunk = event_data(line)
        if chunk is None:
            continue
        chunks.append(chunk)
        if _carries_token(chunk):
            break
    return chunks


async def append_chunks(lines: AsyncIterator[str], chunks: list[dict[str, Any]]) -> None:
    """Every chunk left in a stream's ``lines`` appended to ``chunks`` as it arrives (those read
    stay there if the stream breaks off)."""
    async for line in lines:
        chunk = event_data(line)
        if chunk is not None:
            chunks.append(chunk)
