"""One answer out of a continued request's two legs (:mod:`..continuable`).

The client gets what one colocated vLLM instance would have sent: prefill's token first (as
vLLM's opening stream chunks, or prefill's whole answer when that token ends it), then decode's
answer with what decode cannot know fixed up. Decode saw the prompt *and* that token as its
prompt, so its usage counts one prompt token too many and one generated token too few, its
completion logprob offsets start after the token's text, and its chat stream opens with a role
chunk the client already had. A non-streamed answer is prefill's token joined to decode's answer.

A chat decode leg must have taken the forwarded prompt token ids (vLLM 0.30 and later do): its
answer echoes the prompt ids it ran, and an answer that ran other ids raises
:class:`ContinuationMismatch` instead of reaching the client.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..flags import is_true
from .prefill_answer import FirstToken

_REASONING_KEYS = ("reasoning", "reasoning_content")


class ContinuationMismatch(RuntimeError):
    """Decode's answer does not continue the prompt and token the proxy sent it."""


def sse(payload: Any) -> bytes:
    """One server-sent event with ``payload`` as JSON, the way vLLM writes them."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


DONE = b"data: [DONE]\n\n"


def error_event(message: str, error_type: str = "BadGatewayError", code: int = 502) -> bytes:
    """An error inside a stream that already began, in vLLM's shape."""
    return sse({"error": {"message": message, "type": error_type, "code": code}})


class Splice:
    """Joins prefill's first token and decode's continuation for one client request."""

    def __init__(self, first: FirstToken, client_body: Mapping[str, Any]) -> None:
        self.first = first
        self.asked_token_ids = is_true(client_body.get("return_token_ids"))
        options = client_body.get("stream_options")
        options = options if isinstance(options, dict) else {}
        self.include_usage = is_true(options.get("include_usage"))
        self.continuous_usage = self.include_usage and is_true(
            options.get("continuous_usage_stats")
        )
        #: what decode ran as its prompt: prefill's prompt followed by prefill's tokens
        self.continued_ids = [*first.prompt_token_ids, *first.token_ids]

    # -- prefill's token, before decode answers ------------------------------------------------

    def _chunk(self, choice: dict[str, Any], **top: Any) -> dict[str, Any]:
        answer = self.first.answer
        return {
            "id": answer.get("id"),
            "object": "chat.completion.chunk" if self.first.chat else "text_completion",
            "created": answer.get("created"),
            "model": answer.get("model"),
            "choices": [choice],
            **top,
        }

    def opening_events(self, ends_answer: bool) -> list[bytes]:
        """vLLM's stream chunks for prefill's token; with ``ends_answer`` also the last ones
        (finish reason, usage, ``[DONE]``)."""
        choice = self.first.choice
        ids = self.first.token_ids if self.asked_token_ids else None
        prompt_ids = self.first.prompt_token_ids if self.asked_token_ids else None
        finish = {
            "finish_reason": choice.get("finish_reason") if ends_answer else None,
            "stop_reason": choice.get("stop_reason") if ends_answer else None,
        }
        usage = self.first.answer.get("usage")
        per_chunk = {"usage": usage} if self.continuous_usage and usage else {}
        if self.first.chat:
            message = choice.get("message") or {}
            delta = {"content": message.get("content") or ""}
            delta.update({k: message[k] for k in _REASONING_KEYS if message.get(k) is not None})
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
            events = [
                self._chunk(
                    {**role, "logprobs": None, "finish_reason": None},
                    prompt_token_ids=prompt_ids,
                    **per_chunk,
                ),
                self._chunk(
                    {
                        "index": 0,
                        "delta": delta,
                        "logprobs": choice.get("logprobs"),
                        **finish,
                        "token_ids": ids,
                    },
                    **per_chunk,
                ),
            ]
        else:
            events = [
                self._chunk(
                    {
                        "index": 0,
                        "text": choice.get("text") or "",
                        "logprobs": choice.get("logprobs"),
                        **finish,
                        "prompt_token_ids": prompt_ids,
                        "token_ids": ids,
                    },
                    **per_chunk,
                )
            ]
        encoded = [sse(event) for event in events]
        if ends_answer:
            if self.include_usage and usage:
                encoded.append(sse({**self._chunk({}), "choices": [], "usage": usage}))
            encoded.append(DONE)
        return encoded

    def prefill_answer(self) -> dict[str, Any]:
        """Prefill's answer as the client's whole (non-streamed) answer, when its token ended it."""
        answer = {**self.first.answer, "kv_transfer_params": None}
        choice = {**self.first.choice}
        if not self.asked_token_ids:
            choice["token_ids"] = None
            if self.first.chat:
                answer["prompt_token_ids"] = None
            else:
                choice["prompt_token_ids"] = None
        answer["choices"] = [choice]
        return answer

    # -- decode's answer -----------------------------------------------------------------------

    def _fix_usage(self, usage: Any) -> None:
        """Decode counted prefill's tokens as prompt; colocated counts them as generated."""
        if not isinstance(usage, dict):
            return
        moved = len(self.first.token_ids)
        if isinstance(usage.get("prompt_tokens"), int):
            usage["prompt_tokens"] -= moved
        if isinstance(usage.get("completion_tokens"), int):
            usage["completion_tokens"] += moved

    def _check_prompt(self, prompt_token_ids: Any) -> None:
        if prompt_token_ids != self.continued_ids:
            ran = prompt_token_ids if isinstance(prompt_token_ids, list) else None
            raise ContinuationMismatch(
                "the decode instance did not run the prompt ids the proxy forwarded in "
                "kv_transfer_params.prompt_token_ids (it ran "
                f"{'no reported prompt' if ran is None else f'{len(ran)} tokens'}, not "
                f"{len(self.continued_ids)}): its vLLM is older than 0.30, which does not take "
                "them; run the proxy with --first-token decode for it"
            )

    def _token_ids(self, decoded: Any) -> list[int] | None:
        if not self.asked_token_ids:
            return None
        return [*self.first.token_ids, *(decoded or [])]

    def merge(self, decode_answer: dict[str, Any]) -> dict[str, Any]:
        """The client's whole answer: prefill's token, then decode's (non-streamed) answer."""
        answer = dict(decode_answer)
        choices = answer.get("choices")
        if not isinstance(choices, list) or len(choices) != 1:
            raise ContinuationMismatch("decode's answer does not hold exactly one choice")
        mine, first = dict(choices[0]), self.first.choice
        if self.first.chat:
            self._check_prompt(answer.get("prompt_token_ids"))
            answer["prompt_token_ids"] = (
                self.first.prompt_token_ids if self.asked_token_ids else None
            )
            message, first_message = dict(mine.get("message") or {}), first.get("message") or {}
            message["content"] = self.first.text + (message.get("content") or "")
            for key in _REASONING_KEYS:
                if first_message.get(key) is not None:
                    message[key] = first_message[key] + (message.get(key) or "")
            mine["message"] = message
            if isinstance(mine.get("logprobs"), dict) and isinstance(first.get("logprobs"), dict):
                content = first["logprobs"].get("content") or []
                mine["logprobs"] = {
                    **mine["logprobs"],
                    "content": content + (mine["logprobs"].get("content") or []),
                }
        else:
            mine["text"] = self.first.text + (mine.get("text") or "")
            mine["prompt_token_ids"] = self.first.prompt_token_ids if self.asked_token_ids else None
            if isinstance(mine.get("logprobs"), dict) and isinstance(first.get("logprobs"), dict):
                mine["logprobs"] = self._joined_logprobs(first["logprobs"], mine["logprobs"])
        mine["token_ids"] = self._token_ids(mine.get("token_ids"))
        answer["choices"] = [mine]
        if isinstance(answer.get("usage"), dict):
            answer["usage"] = dict(answer["usage"])
            self._fix_usage(answer["usage"])
        return answer

    def _joined_logprobs(self, first: dict[str, Any], decoded: dict[str, Any]) -> dict[str, Any]:
        """Completion logprobs: prefill's token's entries, then decode's with their text offsets
        moved past the token's text."""
        joined = {
            key: (first.get(key) or []) + (decoded.get(key) or [])
            for key in ("tokens", "token_logprobs", "top_logprobs")
        }
        shift = len(self.first.text)
        joined["text_offset"] = (first.get("text_offset") or []) + [
            offset + shift for offset in decoded.get("text_offset") or []
        ]
        return {**decoded, **joined}

    def decode_stream(self) -> DecodeStream:
        return DecodeStream(self)


class DecodeStream:
    """Rewrites decode's event stream, chunk by chunk as it arrives, into the rest of the
    client's stream."""

    def __init__(self, splice: Splice) -> None:
        self._splice = splice
        self._pending = b""
        self._prompt_checked = not splice.first.chat

    def feed(self, data: bytes) -> bytes:
        """The client's bytes for the ``data`` decode sent (events complete so far)."""
        self._pending += data
        *events, self._pending = self._pending.split(b"\n\n")
        out = [self._rewrite(event) for event in events if event.strip()]
        return b"".join(event for event in out if event)

    def _rewrite(self, event: bytes) -> bytes | None:
        payload = b"".join(
            line[len(b"data:") :].strip()
            for line in event.split(b"\n")
            if line.startswith(b"data:")
        )
        if not payload or payload == b"[DONE]":
            return event + b"\n\n"
        try:
            chunk = json.loads(payload)
        except ValueError:
            return event + b"\n\n"
        if not isinstance(chunk, dict) or "error" in chunk:
            return event + b"\n\n"
        splice = self._splice
        if not self._prompt_checked:
            splice._check_prompt(chunk.get("prompt_token_ids"))
            self._prompt_checked = True
        if splice.first.chat:
            if _opens_with_role(chunk):
                return None  # the client had the role chunk with prefill's token
            if "prompt_token_ids" in chunk:
                chunk["prompt_token_ids"] = None
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            if "prompt_token_ids" in choice:
                choice["prompt_token_ids"] = None
            if not splice.asked_token_ids and "token_ids" in choice:
                choice["token_ids"] = None
            logprobs = choice.get("logprobs")
            if not splice.first.chat and isinstance(logprobs, dict):
                shift = len(splice.first.text)
                logprobs["text_offset"] = [o + shift for o in logprobs.get("text_offset") or []]
        splice._fix_usage(chunk.get("usage"))
        return sse(chunk)


def _opens_with_role(chunk: dict[str, Any]) -> bool:
    """vLLM's first chat chunk: the assistant role, no content, no logprobs."""
    choices = chunk.get("choices") or []
    return bool(choices) and all(
        isinstance(choice, dict)
        and (choice.get("delta") or {}).get("role") is not None
        and not (choice.get("delta") or {}).get("content")
        and not choice.get("logprobs")
        for choice in choices
    )
