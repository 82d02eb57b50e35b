"""The prefill -> decode hand-off contract: what a router and the connector both speak.

A router (``vam-proxy``) asks prefill to hold a prompt's KV with ``kv_transfer_params`` (the keys
below), learns from prefill's answer where the KV can be read (:func:`prefill_address`), names
transfers itself when it sends both legs at once (:func:`new_transfer_id`,
:func:`awaited_prefill_params`), and renews or frees prefill's hold over the side channel with
:class:`KeepHold` and :class:`DropHold`, which prefill answers with a :class:`ClaimReply`. The
connector (``connector.params``, ``connector.scheduler``) and the side channel's other messages
(``datapath.wire``) read the same names from here, so neither side imports the other's layer for
them. Defined once, at the bottom of the package: this module imports msgspec only, and does no
I/O.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

import msgspec

#: The longest id (transfer, engine) or host name accepted; kv_transfer_params carry no longer.
MAX_TRANSFER_ID_CHARS = 256
#: The most prompt blocks one transfer may name.
MAX_REMOTE_BLOCKS = 1 << 20
#: The longest reason or message a side-channel reply carries.
MAX_TEXT_CHARS = 4096

Id = Annotated[str, msgspec.Meta(max_length=MAX_TRANSFER_ID_CHARS)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)]
BlockIds = Annotated[
    list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_REMOTE_BLOCKS)
]

#: On a prefill request: the id the decode side will claim the prompt's KV under.
TRANSFER_ID_KEY = "transfer_id"
#: On a prefill request: false when the KV is wanted only if the request hit its token limit,
#: i.e. not when its token ended it (the proxy answers the client from prefill then).
HOLD_IF_STOPPED_KEY = "hold_if_stopped"
#: Where the side-channel secret is read from when kv_connector_extra_config does not set it
#: (an environment variable keeps it out of command lines and process listings); a router that
#: renews holds signs its messages with it too.
SECRET_ENV = "VAM_SIDE_CHANNEL_SECRET"

#: What tells the prefill instance to compute the prompt and hold its KV cache for a decode.
PREFILL_KV_TRANSFER_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}

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


def awaited_prefill_params(address: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    """A decode leg's ``kv_transfer_params`` before prefill answered: the engine's address and
    the transfer id prefill holds the KV under, without block ids (decode learns them from its
    read lease)."""
    return {"do_remote_prefill": True, "remote_request_id": transfer_id, **address}


class ClaimReply(msgspec.Struct, tag="claim_reply", frozen=True):
    """``granted``: read within ``lease_s`` seconds of sending the claim; ``pending``: the
    request is not registered yet, ask again shortly; ``refused``: never read it (released,
    restarted, not a reader, or another prompt); ``dropped``: never read it, a router freed it
    because its client left (:class:`DropHold`), so the claiming request is being aborted (a
    reader that does not know this status takes it for ``refused``). A grant carries the
    prompt's block ids: with several KV cache groups, group after group, with the groups'
    sizes in ``group_sizes`` (empty: one group)."""

    status: Id
    lease_s: float = 0.0
    reason: Text = ""
    block_ids: BlockIds = msgspec.field(default_factory=list)
    num_prompt_tokens: int = -1
    group_sizes: list[int] = msgspec.field(default_factory=list)


class KeepHold(msgspec.Struct, tag="keep_hold", frozen=True):
    """Keep a transfer's blocks held another release timeout (within the hold's overall bound):
    sent by a router while the decode request it handed the transfer to may still be waiting in
    decode's queue, where vLLM gives the connector no hook. Prefill answers with a
    :class:`ClaimReply`: ``held`` (``lease_s`` left), ``pending`` (not held yet: prefill learns
    of it one engine step after answering) or ``refused`` (read, released or never held: stop
    asking)."""

    request_id: Id


class DropHold(msgspec.Struct, tag="drop_hold", frozen=True):
    """Free a transfer's blocks now if no decode rank holds a lease on them: sent by a router
    whose client left after prefill answered, so the decode request it handed the transfer to
    was aborted and nobody will read it (without it the hold waits out ``release_timeout_s``).
    A transfer a reader leased is left to that reader's read-done notice. Prefill answers with
    a :class:`ClaimReply`: ``refused`` (freed now, or not held) or ``held`` (a reader's lease
    runs)."""

    request_id: Id
