"""Which requests decode can continue from prefill's token, and why others cannot.

The prefill leg samples the answer's first token anyway (it runs with ``max_tokens`` 1). In a
continued request the proxy gives the client that token as soon as prefill answers, and sends
decode the prompt *followed by that token* (prefill's prompt token ids and the token: completions
as a token-id prompt, chat completions through vLLM's ``kv_transfer_params["prompt_token_ids"]``,
vLLM 0.30 and later). Decode reads the KV of every prompt token and computes only the new token's,
so its answer continues exactly what the client saw, for any sampling. The answer is joined by
:mod:`.formats.splice`; the legs' bodies are :mod:`.bodies`'s, the route
:mod:`.continued_route`.

A request continues only when every parameter it sets means the same for decode's shorter
answer (:func:`blocker`): an answer's length, stop strings, penalties over the generated tokens,
structured output, several sequences and per-request seeds would otherwise differ from what one
colocated instance answers. Such a request, and any request with a parameter this module does not
know, keeps the legs where decode samples the first token again (:mod:`.serial_route`,
:mod:`.overlapped_route`), as does every
request when the proxy runs with ``--first-token decode`` or the client sends
``X-First-Token-From: decode``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from .flags import is_false, is_flag, token_limit
from .formats.prefill_answer import CHAT, COMPLETIONS
from .metrics import ProxyMetrics

logger = logging.getLogger(__name__)

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
    "prompt prefix",  # a hybrid model's prefill computes the prompt but its last token
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


def count_decode_first_token(metrics: ProxyMetrics, reason: str, request_id: str) -> None:
    """Count a request whose first token decode samples again, under a label of a fixed set
    (:func:`reason_label`); the reason itself, which may name what the client sent, goes to the
    log only."""
    label = reason_label(reason)
    metrics.decode_first_tokens.labels(label).inc()
    if label != reason:
        logger.debug("request %s: decode samples the first token again: %.200s", request_id, reason)
