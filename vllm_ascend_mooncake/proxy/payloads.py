"""The request bodies of a disaggregated request's two legs, and the check on what prefill returns.

The connector reads ``kv_transfer_params`` from the request: on the prefill instance
``do_remote_decode`` makes it keep the prompt's KV cache for a decode instance to pull, and the
prefill's response carries the parameters (engine id, block ids, address) that the decode
instance needs to pull it.

Overlapped legs: once the proxy knows a prefill instance's address (from an earlier response), it
can send both legs at once. Prefill gets a ``transfer_id``; decode gets the prefill's address
and that id instead of block ids, and learns the block ids from prefill when it is done.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from ..connector.params import MAX_TRANSFER_ID_CHARS

#: What tells the prefill instance to compute the prompt and hold its KV cache for a decode.
PREFILL_KV_TRANSFER_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}

#: Keys that only make sense for the decode leg: the prefill leg is one non-streamed token, and
#: vLLM rejects ``min_tokens`` greater than ``max_tokens``.
_DECODE_ONLY_KEYS = ("stream_options", "min_tokens", "best_of")


def _json_type_name(value: Any) -> str:
    """Name a parsed JSON value's type as JSON does, for error messages."""
    names = {bool: "boolean", int: "number", float: "number", str: "string", list: "array"}
    return names.get(type(value), type(value).__name__)


class InvalidPrefillResponse(ValueError):
    """A prefill instance answered 2xx with a body the proxy cannot hand to a decode instance."""


def prefill_body(client_body: dict[str, Any]) -> dict[str, Any]:
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


#: The keys of a prefill's ``kv_transfer_params`` that say where its KV can be read (and types).
PREFILL_ADDRESS_KEYS = {
    "remote_engine_id": str,
    "remote_host": str,
    "remote_port": int,
    "remote_tp_size": int,
}


def prefill_address(kv_transfer_params: dict[str, Any] | None) -> dict[str, Any] | None:
    """Where a prefill instance's KV can be read, from its response; None if it does not say."""
    if not kv_transfer_params:
        return None
    address = {}
    for key, kind in PREFILL_ADDRESS_KEYS.items():
        value = kv_transfer_params.get(key)
        if type(value) is not kind:  # bool is an int, but never a port or a TP size
            return None
        address[key] = value
    return address


def same_endpoint(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Whether two prefill addresses name the same workers (host, port, TP), whatever engine id
    each carries. An overlapped decode leg's early pull is bound by its unique transfer id, not
    the engine id, and follows a prefill that restarted behind the same address under a new
    engine id by itself; so a new engine id alone is no reason to send the decode leg again (and
    sending it again would make two decode requests race for one hold: whichever reads first
    releases it, and the other's pull fails)."""
    if a is None or b is None:
        return a is b
    return all(a[key] == b[key] for key in PREFILL_ADDRESS_KEYS if key != "remote_engine_id")


def new_transfer_id(request_id: str) -> str:
    """A transfer id unique per request, and short enough for prefill to accept whatever id the
    client sent (the request id, cut short where needed, and a random suffix)."""
    suffix = f"-{uuid.uuid4().hex}"
    return request_id[: MAX_TRANSFER_ID_CHARS - len(suffix)] + suffix


def overlapped_prefill_body(client_body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    """The prefill leg of overlapped legs: :func:`prefill_body`, holding the KV under an id."""
    body = prefill_body(client_body)
    body["kv_transfer_params"]["transfer_id"] = transfer_id
    return body


def overlapped_decode_params(address: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    """The decode leg's ``kv_transfer_params`` when prefill has not answered yet."""
    return {"do_remote_prefill": True, "remote_request_id": transfer_id, **address}


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
