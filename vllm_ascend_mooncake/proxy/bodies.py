"""The request bodies of every route's two legs, and the check on what prefill returns.

The connector reads ``kv_transfer_params`` from the request (the keys are :mod:`..handoff`'s):
on the prefill instance ``do_remote_decode`` makes it keep the prompt's KV cache for a decode
instance to pull, and the prefill's response carries the parameters (engine id, block ids,
address) that the decode instance needs to pull it.

- serial legs: :func:`serial_prefill_body` (one token, not streamed), then :func:`decode_body`
  with what prefill answered;
- overlapped legs: once the proxy knows a prefill instance's address (from an earlier response),
  it sends both at once: :func:`overlapped_prefill_body` holds the KV under a transfer id and
  decode gets the prefill's address and that id instead of block ids
  (``handoff.awaited_prefill_params``), learning the block ids from prefill when it is done;
- continued legs (the first token from prefill): :func:`continued_prefill_body` keeps the
  client's sampling and asks for token ids, :func:`continued_decode_body` continues from the
  prompt and prefill's token.
"""

from __future__ import annotations

from typing import Any

from ..handoff import HOLD_IF_STOPPED_KEY, PREFILL_KV_TRANSFER_PARAMS, TRANSFER_ID_KEY
from .flags import token_limit
from .formats.prefill_answer import FirstToken

#: Keys that only make sense for the decode leg: the prefill leg is one non-streamed token, and
#: vLLM rejects ``min_tokens`` greater than ``max_tokens``.
_DECODE_ONLY_KEYS = ("stream_options", "min_tokens", "best_of")


def serial_prefill_body(client_body: dict[str, Any]) -> dict[str, Any]:
    """Return the client's request rewritten for the prefill leg: one token of one sequence,
    not streamed. With ``n`` > 1 prefill would hold the prompt's KV once per sequence, and
    decode reads only the copy its answer names: the others would wait for their timeout."""
    body = {key: value for key, value in client_body.items() if key not in _DECODE_ONLY_KEYS}
    body["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    if "n" in body:
        body["n"] = 1
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    return body


def overlapped_prefill_body(client_body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    """The prefill leg of overlapped legs: :func:`serial_prefill_body`, holding the KV under an
    id."""
    body = serial_prefill_body(client_body)
    body["kv_transfer_params"][TRANSFER_ID_KEY] = transfer_id
    return body


def decode_body(
    client_body: dict[str, Any], kv_transfer_params: dict[str, Any] | None
) -> dict[str, Any]:
    """Return the client's request with the prefill's ``kv_transfer_params``.

    Without them (the prefill did not hold the KV cache) the decode instance recomputes the
    prompt, which yields what a colocated instance would.
    """
    body = {key: value for key, value in client_body.items() if key != "kv_transfer_params"}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    return body


def continued_prefill_body(
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


def continued_decode_body(client_body: dict[str, Any], first: FirstToken) -> dict[str, Any]:
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
