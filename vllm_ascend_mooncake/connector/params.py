"""The ``kv_transfer_params`` contract between prefill, proxy and decode, validated on arrival.

Prefill returns :class:`RemotePrefill` in its response; the proxy copies it into the decode
request. The decode side never trusts it: wrong types, out-of-range values, oversized block lists
or a mismatch with the decode's own prompt are rejected with a reason, and the request is then
served by a local prefill instead of reading garbage.

Overlapped legs: a proxy that already knows a prefill instance's address may send both legs at
once. It gives prefill ``{"do_remote_decode": true, "transfer_id": T}`` and decode the prefill's
address with ``remote_request_id`` T and no block ids (the keys, transfer ids and hold messages a
router shares with the connector are :mod:`..handoff`'s). Decode then
admits the request at once and learns the block ids from prefill's read lease, when prefill is
done; prefill checks the prompt length there. A prefill instance that fronts several data-parallel
engines says which one answered (``remote_dp_rank`` of ``remote_dp_size``), so that the proxy can
send the next request's prefill leg to the engine it names to decode.

A decode request may continue from the token prefill sampled (the proxy streams that token to
the client): its prompt is prefill's prompt followed by ``remote_output_token_ids``. Decode then
reads all of prefill's prompt tokens and computes only the continued token's KV. A prefill leg
with ``hold_if_stopped`` false (``handoff.HOLD_IF_STOPPED_KEY``) keeps no KV when its token ended
the request (EOS, a stop string): nobody continues a finished answer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from ..core.groups import GroupKind, GroupSpec, describe_groups, split_groups
from ..core.topology import Topologies, TopologyError
from ..datapath.side_channel import address_problem
from ..handoff import HOLD_IF_STOPPED_KEY as HOLD_IF_STOPPED_KEY
from ..handoff import MAX_REMOTE_BLOCKS as MAX_REMOTE_BLOCKS
from ..handoff import MAX_TRANSFER_ID_CHARS as MAX_TRANSFER_ID_CHARS
from ..handoff import TRANSFER_ID_KEY as TRANSFER_ID_KEY

#: The most tokens a prefill hands out as generated, and a decode prompt may continue with.
MAX_OUTPUT_TOKENS = 64

_Name = Annotated[str, msgspec.Meta(max_length=MAX_TRANSFER_ID_CHARS)]


class InvalidTransferParams(ValueError):
    """kv_transfer_params that cannot be acted upon."""


class RemotePrefill(msgspec.Struct, frozen=True):
    """What a decode instance needs to pull a request's KV from a prefill instance."""

    remote_engine_id: _Name
    remote_request_id: _Name
    remote_host: _Name
    remote_port: int
    remote_tp_size: int
    #: None: prefill is still computing; its read lease will carry the block ids.
    remote_block_ids: list[int] | None = None
    remote_num_tokens: int | None = None
    #: Tokens per block on prefill (None: the decode's own), which ``remote_block_ids`` count in.
    remote_block_size: int | None = None
    #: The prefill engine among its API server's data-parallel engines, numbered as vLLM's
    #: ``X-data-parallel-rank`` header takes it, and how many engines that server fronts: what
    #: lets a proxy pin a request to the engine whose address it sends decode.
    remote_dp_rank: int = 0
    remote_dp_size: int = 1
    #: The tokens prefill sampled after the prompt: a decode request whose prompt is prefill's
    #: prompt followed by these continues from them (it reads every prompt token's KV).
    remote_output_token_ids: (
        Annotated[list[int], msgspec.Meta(max_length=MAX_OUTPUT_TOKENS)] | None
    ) = None
    #: Whether prefill's vLLM (and so, in a deployment of one release, decode's) takes a chat
    #: request's prompt as token ids in ``kv_transfer_params["prompt_token_ids"]`` (vLLM
    #: 0.30+), which a chat request continued from prefill's token needs.
    remote_chat_prompt_ids: bool = False
    #: A model with several KV cache groups (vLLM's hybrid manager): each group's block count
    #: in ``remote_block_ids``, group after group, and the groups described
    #: (:mod:`..core.groups`), which must be decode's. None: one group.
    remote_group_sizes: list[int] | None = None
    remote_kv_groups: list[_Name] | None = None
    do_remote_prefill: bool = True
    do_remote_decode: bool = False

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    def prefill_tokens(self, num_prompt_tokens: int) -> int:
        """How many leading tokens of a decode prompt of ``num_prompt_tokens`` prefill computed
        (what decode reads): all of them, unless the prompt continues from prefill's output."""
        if self.remote_num_tokens is None:
            return num_prompt_tokens
        return min(self.remote_num_tokens, num_prompt_tokens)


def transfer_id_of(params: dict[str, Any], request_id: str) -> str:
    """The id a prefill request's KV is claimed under: the proxy's ``transfer_id``, if valid,
    else the request id (:func:`bounded_id`)."""
    transfer_id = params.get(TRANSFER_ID_KEY)
    if isinstance(transfer_id, str) and 0 < len(transfer_id) <= MAX_TRANSFER_ID_CHARS:
        return transfer_id
    return bounded_id(request_id)


def bounded_id(request_id: str) -> str:
    """``request_id``, or when it is longer than the wire carries (vLLM builds it from the
    client's ``X-Request-Id``, of any length) its head and a digest of the whole: as unique as the
    id itself, so the hand-off never fails for the length of an id."""
    if len(request_id) <= MAX_TRANSFER_ID_CHARS:
        return request_id
    digest = hashlib.sha256(request_id.encode()).hexdigest()[:32]
    return f"{request_id[: MAX_TRANSFER_ID_CHARS - len(digest) - 1]}~{digest}"


def parse_remote_prefill(
    params: dict[str, Any],
    *,
    topologies: Topologies,
    block_size: int,
    prompt_token_ids: Sequence[int],
    groups: Sequence[GroupSpec] = (),
) -> RemotePrefill:
    """Validate decode-side params against this deployment and the request's own prompt.

    The prefill instance may run any TP size this decode instance can pair with
    (``topologies``): a decode instance can be fed by prefill instances of several sizes. The
    prompt is prefill's (same length), or prefill's followed by exactly the tokens prefill
    sampled (``remote_output_token_ids``). ``groups``: decode's KV cache groups (none: one
    full-attention group), which prefill's must be, each holding the blocks its kind keeps."""
    groups = tuple(groups) or (GroupSpec(GroupKind.FULL, block_size),)
    num_prompt_tokens = len(prompt_token_ids)
    try:
        parsed = msgspec.convert(params, RemotePrefill, strict=True)
    except msgspec.ValidationError as exc:
        raise InvalidTransferParams(f"malformed kv_transfer_params: {exc}") from exc
    if not 0 < parsed.remote_port < 65536:
        raise InvalidTransferParams(f"remote_port {parsed.remote_port} is not a TCP port")
    if not parsed.remote_host or not parsed.remote_engine_id or not parsed.remote_request_id:
        raise InvalidTransferParams(
            "remote_host, remote_engine_id and remote_request_id are required"
        )
    # Before any socket exists: ZMQ refuses such a host only in connect(), on every attempt.
    problem = address_problem(parsed.remote_host, parsed.remote_port)
    if problem is not None:
        raise InvalidTransferParams(f"remote_host/remote_port name no side channel: {problem}")
    try:
        topologies.with_remote_tp(parsed.remote_tp_size)
    except TopologyError as exc:
        raise InvalidTransferParams(
            f"this decode instance cannot read a prefill instance of TP "
            f"{parsed.remote_tp_size}: {exc}"
        ) from exc
    if parsed.remote_num_tokens is not None:
        if not 0 < parsed.remote_num_tokens <= num_prompt_tokens:
            raise InvalidTransferParams(
                f"the prefill instance computed {parsed.remote_num_tokens} prompt tokens, this "
                f"request has {num_prompt_tokens}: the prompts differ"
            )
        if parsed.remote_num_tokens < num_prompt_tokens:
            _check_continuation(parsed, prompt_token_ids)
        num_prompt_tokens = parsed.remote_num_tokens
    described = describe_groups(groups) if len(groups) > 1 else []
    if (parsed.remote_kv_groups or []) != described:
        raise InvalidTransferParams(
            f"the prefill instance's KV cache groups are {parsed.remote_kv_groups or ['one']}, "
            f"this decode instance's {described or ['one']}: they do not serve the same model "
            f"with the same hybrid KV cache manager setting"
        )
    if parsed.remote_block_ids is None:
        return parsed  # before prefill answered: prefill checks the prompt when decode claims
    if parsed.remote_num_tokens is None:
        raise InvalidTransferParams("remote_block_ids without remote_num_tokens")
    prefill_block_size = (
        block_size if parsed.remote_block_size is None else parsed.remote_block_size
    )
    if prefill_block_size < 1 or (
        prefill_block_size % block_size and block_size % prefill_block_size
    ):
        raise InvalidTransferParams(
            f"prefill block size {parsed.remote_block_size} and decode block size {block_size}: "
            f"neither divides the other"
        )
    blocks = parsed.remote_block_ids
    if len(blocks) > MAX_REMOTE_BLOCKS:
        raise InvalidTransferParams(f"{len(blocks)} remote blocks (at most {MAX_REMOTE_BLOCKS})")
    try:
        per_group = split_groups(blocks, parsed.remote_group_sizes or ())
    except ValueError as exc:
        raise InvalidTransferParams(str(exc)) from exc
    if len(per_group) != len(groups):
        raise InvalidTransferParams(
            f"remote blocks in {len(per_group)} KV cache groups, this decode has {len(groups)}"
        )
    for group, ids in zip(groups, per_group, strict=True):
        held = GroupSpec(group.kind, prefill_block_size, group.window)
        expected_blocks = held.held_count(num_prompt_tokens)
        if len(ids) != expected_blocks:
            raise InvalidTransferParams(
                f"{len(ids)} remote blocks for {num_prompt_tokens} tokens of block size "
                f"{prefill_block_size} (expected {expected_blocks}"
                + (f" in a {held.describe()} group)" if len(groups) > 1 else ")")
            )
    if any(b < 0 for b in blocks):
        raise InvalidTransferParams("negative remote block id")
    return parsed


def _check_continuation(parsed: RemotePrefill, prompt_token_ids: Sequence[int]) -> None:
    """A prompt longer than prefill's must end with exactly the tokens prefill sampled."""
    assert parsed.remote_num_tokens is not None
    tail = list(prompt_token_ids[parsed.remote_num_tokens :])
    if parsed.remote_output_token_ids is None or tail != parsed.remote_output_token_ids:
        raise InvalidTransferParams(
            f"the prefill instance computed {parsed.remote_num_tokens} prompt tokens, this "
            f"request has {len(prompt_token_ids)} and continues with {tail[:8]}, not with the "
            f"tokens prefill sampled ({parsed.remote_output_token_ids}): the prompts differ"
        )


class ReleaseTarget(msgspec.Struct, frozen=True):
    """Where a prefill holds a transfer, from params too broken to pull with: enough to tell
    that prefill nobody will read it, so it frees the blocks now instead of at its timeout."""

    remote_engine_id: _Name
    remote_request_id: _Name
    remote_host: _Name
    remote_port: int


def release_target(params: dict[str, Any]) -> ReleaseTarget | None:
    """The prefill a rejected hand-off names, if it names one well enough to be told."""
    fields = {key: params.get(key) for key in ReleaseTarget.__struct_fields__}
    try:
        target = msgspec.convert(fields, ReleaseTarget, strict=True)
    except msgspec.ValidationError:
        return None
    if not target.remote_request_id or address_problem(target.remote_host, target.remote_port):
        return None
    return target
