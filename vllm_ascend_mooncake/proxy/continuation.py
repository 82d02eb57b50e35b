"""Decode continues from prefill's token: which requests can, and the bodies of their two legs.

The prefill leg samples the answer's first token anyway (it runs with ``max_tokens`` 1). In a
continued request the proxy gives the client that token as soon as prefill answers, and sends
decode the prompt *followed by that token* (prefill's prompt token ids and the token: completions
as a token-id prompt, chat completions through vLLM's ``kv_transfer_params["prompt_token_ids"]``,
vLLM 0.30 and later). Decode reads the KV of every prompt token and computes only the new token's,
so its answer continues exactly what the client saw, for any sampling. The answer is joined by
:mod:`.splice`.

A request continues only when every parameter it sets means the same for decode's shorter
answer (:func:`blocker`): an answer's length, stop strings, penalties over the generated tokens,
structured output, several sequences and per-request seeds would otherwise differ from what one
colocated instance answers. Such a request, and any request with a parameter this module does not
know, keeps today's legs (:mod:`.payloads`: decode samples the first token again), as does every
request when the proxy runs with ``--first-token decode`` or the client sends
``X-First-Token-From: decode``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..connector.params import HOLD_IF_STOPPED_KEY, TRANSFER_ID_KEY
from .flags import is_false, is_flag
from .payloads import PREFILL_KV_TRANSFER_PARAMS, kv_transfer_params_from_prefill

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

#: The request header with which a client picks where its answer's first token comes from.
FIRST_TOKEN_HEADER = "X-First-Token-From"
#: Its values, and those of the proxy's ``--first-token``: prefill's own sampled token, or a
#: token decode samples again (today's legs).
FROM_PREFILL = "prefill"
FROM_DECODE = "decode"
FIRST_TOKEN_SOURCES = (FROM_PREFILL, FROM_DECODE)


def _absent_or(allowed: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or allowed(value)


def _is_zero(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


def _single_characters(stop: Any) -> bool:
    """Stop strings no longer than one character: none can begin in prefill's token and end in
    decode's, which decode (that sees the token as prompt) would miss."""
    strings = [stop] if isinstance(stop, str) else stop
    return isinstance(strings, list) and all(isinstance(s, str) and len(s) <= 1 for s in strings)


def _text_messages(messages: Any) -> bool:
    """Chat messages without media: vLLM renders messages with media itself and then ignores
    the forwarded prompt token ids."""
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            not isinstance(part, dict) or part.get("type") != "text" for part in content
        ):
            return False
    return True


def _prompt_of_one_sequence(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    )


def _any(_: Any) -> bool:
    return True


#: Every parameter a continued request may carry, and the values that keep decode's continuation
#: equal to a colocated answer. Parameters of one step (temperature, top-k, bias, ...) or of the
#: prompt's rendering apply alike to both legs; ``max_tokens`` and ``min_tokens`` are shortened
#: by the continued token for decode.
_COMMON: dict[str, Callable[[Any], bool]] = {
    "model": _any,
    "max_tokens": _any,
    "min_tokens": _any,
    "temperature": _any,
    "top_p": _any,
    "top_k": _any,
    "min_p": _any,
    "logit_bias": _any,
    "allowed_token_ids": _any,
    "repetition_penalty": _any,  # over prompt and output alike
    "stop_token_ids": _any,
    "ignore_eos": _any,
    "include_stop_str_in_output": _any,
    "skip_special_tokens": _any,
    "spaces_between_special_tokens": _any,
    "logprobs": _any,
    "stream": _absent_or(is_flag),  # one vLLM refuses gets its 400 from decode's leg
    "stream_options": _any,
    "user": _any,
    "cache_salt": _any,
    "priority": _any,
    "request_id": _any,
    "return_token_ids": _absent_or(is_flag),
    "return_tokens_as_token_ids": _any,
    "truncate_prompt_tokens": _any,  # prefill truncates; decode gets the ids it kept
    "add_special_tokens": _any,
    "kv_transfer_params": _any,  # the proxy's to set
    "stop": _absent_or(_single_characters),
    "n": _absent_or(lambda n: n == 1),
    "best_of": _absent_or(lambda n: n == 1),
    "use_beam_search": _absent_or(is_false),
    "echo": _absent_or(is_false),
    "prompt_logprobs": lambda value: value is None,
    # counted over generated tokens only: decode would count the continued token as prompt
    "frequency_penalty": _absent_or(_is_zero),
    "presence_penalty": _absent_or(_is_zero),
    "bad_words": _absent_or(lambda words: not words),
    # one stream of draws per request in vLLM's V1 sampler: decode's would start afresh
    "seed": lambda value: value is None,
    "response_format": _absent_or(lambda fmt: isinstance(fmt, dict) and fmt.get("type") == "text"),
}
_ALLOWED: dict[str, dict[str, Callable[[Any], bool]]] = {
    COMPLETIONS: {**_COMMON, "prompt": _prompt_of_one_sequence},
    CHAT: {
        **_COMMON,
        "messages": _text_messages,
        "max_completion_tokens": _any,
        "top_logprobs": _any,
        "tools": _absent_or(lambda tools: not tools),
        "tool_choice": _absent_or(lambda choice: choice == "none"),
        "parallel_tool_calls": _any,
        "chat_template": _any,
        "chat_template_kwargs": _any,
        "add_generation_prompt": _any,
        "continue_final_message": _any,
    },
}


#: Why decode samples a request's first token again, beyond the names of the parameters above:
#: the labels ``vam_proxy_decode_first_tokens_total{reason}`` may carry.
_OTHER_REASONS = (
    "asked",  # --first-token decode, or X-First-Token-From: decode
    "path",
    "no prompt",
    "no max_tokens",
    "no token ids from prefill",
    "chat on vLLM before 0.30",
    "partial character",
    "max_model_len",  # min_tokens beyond the one token a prompt filling the context leaves
)
REASON_LABELS = frozenset(
    {*_OTHER_REASONS, *(key for allowed in _ALLOWED.values() for key in allowed)}
)
#: The label of every other reason: an unknown parameter or header value, which the client
#: names (a label per name would grow the proxy's series, and its memory, without bound).
OTHER_REASON = "other"


def reason_label(reason: str) -> str:
    """The metric label of a reason :func:`blocker` (or the routing) gave: the reason itself
    when it is one of :data:`REASON_LABELS`, else :data:`OTHER_REASON`."""
    return reason if reason in REASON_LABELS else OTHER_REASON


def token_limit(body: Mapping[str, Any]) -> int | None:
    """The answer's token limit the client set (chat's ``max_completion_tokens`` first, as vLLM
    reads it), or None."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def blocker(path: str, body: Mapping[str, Any]) -> str | None:
    """Why decode cannot continue this request from prefill's token (a short reason for logs
    and metrics), or None when it can."""
    allowed = _ALLOWED.get(path)
    if allowed is None:
        return "path"
    for key, value in body.items():
        check = allowed.get(key)
        if check is None:
            return f"parameter {key}"
        if not check(value):
            return key
    if "prompt" not in body and "messages" not in body:
        return "no prompt"
    limit = token_limit(body)
    if limit is None:
        # vLLM's default limit may come from the model's generation config, unknown here.
        return "no max_tokens"
    if limit < 1:
        return "max_tokens"
    return None


def prefill_body(
    client_body: dict[str, Any], transfer_id: str | None = None, *, stream: bool = False
) -> dict[str, Any]:
    """The prefill leg of a continued request: its first token, with the prompt and token ids
    to continue from. Its KV is held for decode (under ``transfer_id`` when the proxy names it)
    unless the client wants that one token only, and not when the token ends the answer. A
    streamed leg (``stream``) reaches the proxy as soon as the token is sampled; with its usage,
    which a client's stream ending at that token carries."""
    body = {key: value for key, value in client_body.items() if key != "stream_options"}
    limit = token_limit(client_body)
    for key in ("max_tokens", "max_completion_tokens"):
        if key in body or key == "max_tokens":
            body[key] = 1
    if isinstance(body.get("min_tokens"), int):
        body["min_tokens"] = min(body["min_tokens"], 1)  # vLLM wants min_tokens <= max_tokens
    body["stream"] = stream
    if stream:
        body["stream_options"] = {"include_usage": True}
    body["return_token_ids"] = True
    body.pop("kv_transfer_params", None)
    if limit != 1:
        params = {**PREFILL_KV_TRANSFER_PARAMS, HOLD_IF_STOPPED_KEY: False}
        if transfer_id is not None:
            params[TRANSFER_ID_KEY] = transfer_id
        body["kv_transfer_params"] = params
    return body


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

    Raises :class:`~.payloads.InvalidPrefillResponse` if the answer is no JSON object or its
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


def decode_body(client_body: dict[str, Any], first: FirstToken) -> dict[str, Any]:
    """The decode leg of a continued request: the client's request, shortened by the tokens
    prefill answered, with the prompt followed by them."""
    continued = [*first.prompt_token_ids, *first.token_ids]
    body = {key: value for key, value in client_body.items() if key != "truncate_prompt_tokens"}
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int):
            body[key] -= len(first.token_ids)
    if isinstance(body.get("min_tokens"), int):
        body["min_tokens"] = max(0, body["min_tokens"] - len(first.token_ids))
    params = dict(first.kv_transfer_params or {})
    if first.chat:
        params["prompt_token_ids"] = continued
        body["return_token_ids"] = True  # to see that decode took the ids (vLLM >= 0.30)
    else:
        body["prompt"] = continued
    body["kv_transfer_params"] = params
    return body
