"""Side-channel messages between decode and prefill workers (msgspec, versioned).

Every message is a tagged msgspec struct inside an :class:`Envelope` that carries the protocol
version, so a peer running an incompatible version is refused with a clear error instead of
misreading fields. Decoding never trusts the peer: malformed bytes raise :class:`WireError`.

Flow (decode pulls):
1. decode -> prefill ``GetMetadata``; reply ``WorkerMetadata`` (cached by decode per peer).
2. decode -> prefill ``ClaimRead``; reply ``ClaimReply``: a lease during which prefill will not
   release the request's blocks (renewed by claiming again), with the prompt's block ids. A
   request prefill has not finished yet is "pending" (decode asks again); one already released
   is refused, so a late read can never see reused blocks.
3. decode reads prefill memory with the transfer engine, and discards the bytes if the read
   ended after its lease.
4. decode -> prefill ``ReadDone`` (success or failure); reply ``Ack``.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from ..core.layout import BlockOrder, LayoutError, Region, RegionLayout, RowGroup
from ..handoff import MAX_REMOTE_BLOCKS as MAX_REMOTE_BLOCKS
from ..handoff import MAX_TEXT_CHARS as MAX_TEXT_CHARS
from ..handoff import MAX_TRANSFER_ID_CHARS as MAX_TRANSFER_ID_CHARS
from ..handoff import ClaimReply, DropHold, Id, KeepHold, Text

PROTOCOL_VERSION = 3  # 3: WorkerMetadata.te_session became transport_session
#: The largest frame a side-channel socket accepts (ZMQ drops the peer that sends more).
MAX_MESSAGE_BYTES = 16 << 20
#: Every variable-length field is bounded, so that no peer can make a worker keep more than a
#: few KiB per message it remembers (early read-done notices are remembered for minutes). The
#: bounds the hand-off shares with routers (ids, block lists, texts: ``Id``, ``BlockIds``,
#: ``Text``) and the hold messages (``ClaimReply``, ``KeepHold``, ``DropHold``) are defined in
#: :mod:`..handoff`.
MAX_ID_CHARS = MAX_TRANSFER_ID_CHARS  # request, transfer and engine ids, incarnations, sessions
MAX_REGIONS = 1 << 16
MAX_PACKING_GROUPS = 64  # row groups of a head-major chunk (vLLM CPU: 2)
MAX_RANK = 1 << 16

Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANK)]
Size = Annotated[int, msgspec.Meta(ge=0)]


def bounded_text(text: str) -> str:
    """``text`` cut to what the wire carries (an over-long field would void the whole message)."""
    return text if len(text) <= MAX_TEXT_CHARS else text[: MAX_TEXT_CHARS - 3] + "..."


class WireError(ValueError):
    """A side-channel message could not be decoded or has the wrong version."""


class RegionInfo(msgspec.Struct, frozen=True):
    name: Text
    base: Size
    block_order: Id
    num_blocks: Size
    block_stride: Size
    num_heads: Size
    tokens_per_block: Size
    head_token_bytes: Size
    #: the chunk packing, ``(rows, token_bytes, token_unit)`` per row group; empty: unknown.
    #: Added without a protocol bump: a peer that does not send it reads as unknown, which only
    #: rules out different block sizes with head-major blocks.
    packing: Annotated[
        list[tuple[Size, Size, Size]], msgspec.Meta(max_length=MAX_PACKING_GROUPS)
    ] = msgspec.field(default_factory=list)
    #: the tensor's (kernel) blocks per engine block; added without a protocol bump: a peer
    #: that does not send it has one kernel block per engine block, as every release before.
    kernel_blocks: Size = 1
    #: the region's head group, its layer's total KV heads (0: the model's); added without a
    #: protocol bump: a peer that does not send it has every layer in the model's group.
    kv_heads: Size = 0

    @classmethod
    def of(cls, region: Region) -> RegionInfo:
        layout = region.layout
        return cls(
            name=region.name,
            base=region.base,
            block_order=layout.block_order.value,
            num_blocks=layout.num_blocks,
            block_stride=layout.block_stride,
            num_heads=layout.num_heads,
            tokens_per_block=layout.tokens_per_block,
            head_token_bytes=layout.head_token_bytes,
            packing=[(g.rows, g.token_bytes, g.token_unit) for g in layout.packing],
            kernel_blocks=layout.kernel_blocks,
            kv_heads=layout.kv_heads,
        )

    def to_region(self) -> Region:
        try:
            order = BlockOrder(self.block_order)
        except ValueError as exc:
            raise WireError(
                f"unknown block order {self.block_order!r} for region {self.name}"
            ) from exc
        try:
            layout = RegionLayout(
                block_order=order,
                num_blocks=self.num_blocks,
                block_stride=self.block_stride,
                num_heads=self.num_heads,
                tokens_per_block=self.tokens_per_block,
                head_token_bytes=self.head_token_bytes,
                packing=tuple(RowGroup(*group) for group in self.packing),
                kernel_blocks=self.kernel_blocks,
                kv_heads=self.kv_heads,
            )
        except LayoutError as exc:
            raise WireError(f"peer region {self.name} is not a valid layout: {exc}") from exc
        return Region(self.name, self.base, layout)


class ModelIdentity(msgspec.Struct, frozen=True):
    """What must match for two instances' KV bytes to be interchangeable.

    ``model`` (the served name or path) only names the model in messages: two instances may
    serve one model under different names and paths. ``model_config`` is a digest of the model's
    configuration, ``attention_backend`` the backend and, where it packs blocks its own way (vLLM
    CPU: the ISA kernel, AMX or not), that packing."""

    model: Text
    dtype: Id
    kv_cache_dtype: Id
    block_size: Size
    head_size: Size
    num_kv_heads: Size
    num_layers: Size
    is_mla: bool
    attention_backend: Id = ""
    model_config: Id = ""
    vllm_version: Id = ""
    #: the KV cache groups of vLLM's hybrid manager, described (``core.groups``), when there
    #: are several; empty for one group (and from workers that predate groups)
    kv_cache_groups: Annotated[list[Id], msgspec.Meta(max_length=64)] = msgspec.field(
        default_factory=list
    )


class WorkerMetadata(msgspec.Struct, tag="metadata", frozen=True):
    """A worker's registration, served by prefill workers to the decode workers that read them."""

    engine_id: Id
    incarnation: Id
    tp_rank: Rank
    tp_size: Rank
    dp_rank: Rank
    dp_size: Rank
    pp_size: Rank
    transport_session: Id
    identity: ModelIdentity
    regions: Annotated[list[RegionInfo], msgspec.Meta(max_length=MAX_REGIONS)]

    def to_regions(self) -> list[Region]:
        return [info.to_region() for info in self.regions]


class GetMetadata(msgspec.Struct, tag="get_metadata", frozen=True):
    pass


class ClaimRead(msgspec.Struct, tag="claim_read", frozen=True):
    """Before reading (and to renew): may this decode rank read the request's blocks now?

    ``num_prompt_tokens`` (-1: unchecked) is the decode request's prompt length, which prefill
    compares with its own; ``decode_tp`` (-1: unchecked) likewise. While the request is pending,
    prefill may hold the reply back for up to ``wait_s`` seconds and answer as soon as it
    registers the request."""

    request_id: Id
    decode_rank: Rank
    incarnation: Id
    num_prompt_tokens: int = -1
    wait_s: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    decode_tp: int = -1  # the reader's TP size, which prefill checks against its own view
    reader: Id = ""  # the claiming decode worker's incarnation: the lease is bound to it


class ReadDone(msgspec.Struct, tag="read_done", frozen=True):
    """A decode rank finished reading a request from this prefill rank (or gave up).

    Once prefill granted that rank's lease to a reader (the decode worker's incarnation, which
    only that worker knows: decode workers serve no side channel), only that reader's notice
    counts: anyone can learn prefill's incarnation, nobody else a decode worker's."""

    request_id: Id
    decode_rank: Rank
    incarnation: Id
    success: bool
    reason: Text = ""
    reader: Id = ""  # must be the reader the lease was granted to, once one was
    decode_tp: int = -1  # the reader's TP size (-1: the prefill's configured decode TP)


#: The most ranges one :class:`VerifyRead` names (decode sends one per read batch, whose
#: descriptors ``max_descriptors_per_batch`` caps).
MAX_VERIFIED_RANGES = 1 << 16
#: ``addrs`` and ``lengths`` of a :class:`VerifyRead`: little-endian int64 arrays.
RangeArray = Annotated[bytes, msgspec.Meta(max_length=8 * MAX_VERIFIED_RANGES)]


class VerifyRead(msgspec.Struct, tag="verify_read", frozen=True):
    """What do these byte ranges of a transfer's blocks hold? (``verify_reads``): decode sends
    the ranges one read batch took, prefill answers their :mod:`~..core.digest` checksum in a
    :class:`ReadDigest`, and decode compares it with the bytes that landed. Only the reader
    holding ``decode_rank``'s lease may ask, and only about the blocks the transfer holds."""

    request_id: Id
    decode_rank: Rank
    reader: Id
    addrs: RangeArray
    lengths: RangeArray


class ReadDigest(msgspec.Struct, tag="read_digest", frozen=True):
    #: the checksum's 64 bits, little-endian (msgspec bounds ints to int64)
    checksum: Annotated[bytes, msgspec.Meta(min_length=8, max_length=8)]


class Ack(msgspec.Struct, tag="ack", frozen=True):
    pass


class ErrorReply(msgspec.Struct, tag="error", frozen=True):
    message: Text


Message = (
    GetMetadata
    | WorkerMetadata
    | ClaimRead
    | ClaimReply
    | ReadDone
    | KeepHold
    | DropHold
    | VerifyRead
    | ReadDigest
    | Ack
    | ErrorReply
)


class Envelope(msgspec.Struct, frozen=True):
    version: int
    body: Message


class _VersionOnly(msgspec.Struct):
    version: int


_encoder = msgspec.msgpack.Encoder()
_version_decoder = msgspec.msgpack.Decoder(_VersionOnly)
_decoder = msgspec.msgpack.Decoder(Envelope)


def encode(message: Message) -> bytes:
    return _encoder.encode(Envelope(PROTOCOL_VERSION, message))


def decode(data: bytes) -> Message:
    """Decode one message; raises :class:`WireError` on anything malformed or foreign.

    The version is read first, so a peer of another version gets a version error rather than a
    confusing field error.
    """
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"side-channel message of {len(data)} B exceeds {MAX_MESSAGE_BYTES} B")
    try:
        version = _version_decoder.decode(data).version
        if version != PROTOCOL_VERSION:
            raise WireError(
                f"peer speaks side-channel protocol v{version}, this worker "
                f"v{PROTOCOL_VERSION}: run the same vllm-ascend-mooncake version on both sides"
            )
        return _decoder.decode(data).body
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"malformed side-channel message: {exc}") from exc
    except RecursionError as exc:  # msgspec recurses into nested values, even skipped ones
        raise WireError("malformed side-channel message: nested too deeply") from exc
