"""What the data-path harness runs (:mod:`.datapath_harness`): a case (the geometry, layouts and
block sizes of prefill and decode workers), its requests, and what a pull came to.

A case also answers what the bytes must be: prefill caches are filled from a :class:`ReferenceKV`
(equal block sizes: decode checks every pulled block byte for byte) or, when prefill and decode
use different block sizes (``CaseSpec.prefill_block_size``), token by token from a
:class:`ReferencePrompt` (the "pool": prefill block ``b`` holds its tokens ``b * Bp ..``; a
request's prompt is the pool's tokens of its prefill blocks, in order, and decode expects every
token the transfer moves in its slot, :meth:`ReferencePrompt.place`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from vllm_ascend_mooncake.core.layout import ChunkPacking, Region
from vllm_ascend_mooncake.core.packing import chunk_packing
from vllm_ascend_mooncake.core.topology import TransferTopology
from vllm_ascend_mooncake.datapath.wire import ModelIdentity, RegionInfo, WorkerMetadata

from .kv_caches import CACHE_LAYOUTS
from .kv_reference import ReferenceKV, ReferencePrompt

#: vLLM CPU's ISA kernels whose head-major chunk packing is described
#: (:mod:`vllm_ascend_mooncake.core.packing`).
CPU_PACKINGS = ("vec", "vec16", "amx")


#: A tiny model's identity, for workers whose KV geometry nobody checks.
TINY_IDENTITY = ModelIdentity("tiny", "float32", "auto", 32, 64, 4, 2, False)


def worker_metadata(
    regions: Iterable[Region] = (),
    *,
    identity: ModelIdentity = TINY_IDENTITY,
    engine_id: str = "e",
    incarnation: str = "i",
    tp_rank: int = 0,
    tp_size: int = 1,
    transport_session: str = "127.0.0.1:1",
) -> WorkerMetadata:
    """What a worker of one data-parallel rank and one pipeline stage advertises, for a prefill
    served on loopback or a peer's metadata to check."""
    return WorkerMetadata(
        engine_id=engine_id,
        incarnation=incarnation,
        tp_rank=tp_rank,
        tp_size=tp_size,
        dp_rank=0,
        dp_size=1,
        pp_size=1,
        transport_session=transport_session,
        identity=identity,
        regions=[RegionInfo.of(region) for region in regions],
    )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class CaseSpec:
    """One geometry: model, TP pair, layout and pool sizes.

    ``block_size`` is decode's block size, ``prefill_block_size`` prefill's (None: the same; else
    one must divide the other, and requests must carry their prompt length). ``cpu_packing``
    gives ``vllm_head_major`` caches vLLM CPU's chunk packing for that ISA kernel (both sides
    advertise ``CPU_ATTN/<isa>``); head-major blocks of different sizes need it."""

    name: str
    heads: int
    prefill_tp: int
    decode_tp: int
    layout: str
    num_layers: int = 2
    block_size: int = 16
    head_size: int = 16
    element_size: int = 2
    prefill_blocks: int = 48
    decode_blocks: int = 64
    seed: int = 0
    base_port: int = 0
    release_timeout_s: float = 60.0
    max_descriptors_per_batch: int = 1024
    coalesce_runs: bool = True
    block_reads_from_bytes: int = 0
    staging_bytes: int = 1 << 20
    max_descriptor_bytes: int = 0
    # Benchmarks: skip the reference fill and byte checks; reserve a buffer for ceiling reads.
    verify: bool = True
    ceiling_bytes: int = 0
    #: "ascend_mla": the widths (elements) of a layer's MLA tensors, vllm-ascend's
    #: (kv_lora_rank, qk_rope_head_dim); each tensor is ``[blocks, block_size, 1, width]``.
    mla_widths: tuple[int, ...] = (512, 64)
    #: prefill's tokens per block (None: ``block_size``); ``prefill_blocks`` counts these.
    prefill_block_size: int | None = None
    #: "vec", "vec16" or "amx": vLLM CPU's packing of head-major chunks (``vllm_head_major`` only)
    cpu_packing: str | None = None
    #: decode checks every read batch against prefill's checksum (the ``verify_reads`` key)
    verify_reads: bool = False

    def __post_init__(self) -> None:
        if self.layout not in CACHE_LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r} (one of {CACHE_LAYOUTS})")
        bp, bd = self.prefill_tokens_per_block, self.block_size
        if min(bp, bd) < 1 or (bp % bd and bd % bp):
            raise ValueError(f"prefill block size {bp} and decode block size {bd}: neither divides")
        if self.cpu_packing is not None:
            if self.cpu_packing not in CPU_PACKINGS:
                raise ValueError(f"cpu_packing {self.cpu_packing!r} is not one of {CPU_PACKINGS}")
            if self.layout != "vllm_head_major":
                raise ValueError("cpu_packing applies to the vllm_head_major layout only")
            if not self.packing:
                raise ValueError(
                    f"vLLM CPU's {self.cpu_packing} packing does not describe head size "
                    f"{self.head_size} with {self.element_size}-byte elements"
                )

    @property
    def prefill_tokens_per_block(self) -> int:
        return self.block_size if self.prefill_block_size is None else self.prefill_block_size

    @property
    def mixed_block_sizes(self) -> bool:
        """Prefill and decode blocks differ in size: filled and checked token by token."""
        return self.prefill_tokens_per_block != self.block_size

    @property
    def attention_backend(self) -> str:
        """The backend label both sides advertise (empty: unknown, as before packings)."""
        return f"CPU_ATTN/{self.cpu_packing}" if self.cpu_packing else ""

    @property
    def packing(self) -> ChunkPacking:
        """The head-major chunk packing the regions carry (empty: none)."""
        if not self.cpu_packing:
            return ()
        return chunk_packing(self.attention_backend, "auto", self.head_size, self.element_size)

    @property
    def is_mla(self) -> bool:
        return self.layout in ("mla", "ascend_mla")

    @property
    def ref_heads(self) -> int:
        return 1 if self.is_mla else self.heads

    @property
    def regions_per_layer(self) -> int:
        if self.layout == "ascend_mla":
            return len(self.mla_widths)
        return 2 if self.layout == "split_kv" else 1

    @property
    def identity_head_size(self) -> int:
        """The head size the workers advertise (vLLM's: the whole latent for MLA)."""
        return sum(self.mla_widths) if self.layout == "ascend_mla" else self.head_size

    @property
    def head_token_bytes(self) -> int:
        # vLLM fuses K and V in the content axis; split caches hold one of them per tensor.
        if self.layout == "ascend_mla":
            return max(self.region_widths)
        content = self.head_size if self.layout == "split_kv" else 2 * self.head_size
        return content * self.element_size

    @property
    def region_widths(self) -> tuple[int, ...]:
        """Bytes per head and token of every region, layer by layer."""
        if self.layout == "ascend_mla":
            return tuple(w * self.element_size for w in self.mla_widths) * self.num_layers
        return (self.head_token_bytes,) * (self.num_layers * self.regions_per_layer)

    def topology(self) -> TransferTopology:
        return TransferTopology(self.heads, self.prefill_tp, self.decode_tp, is_mla=self.is_mla)

    def reference(self) -> ReferenceKV:
        return ReferenceKV.random(
            self.num_layers * self.regions_per_layer,
            self.prefill_blocks,
            self.ref_heads,
            self.block_size,
            self.region_widths if self.layout == "ascend_mla" else self.head_token_bytes,
            seed=self.seed,
        )

    def prompt_pool(self) -> ReferencePrompt:
        """Mixed block sizes: the tokens of every prefill block, block ``b`` holding tokens
        ``b * Bp .. (b + 1) * Bp - 1`` (as wide as the widest region; a region takes the first
        ``region_widths[i]`` bytes)."""
        return ReferencePrompt.random(
            self.num_layers * self.regions_per_layer,
            self.prefill_blocks * self.prefill_tokens_per_block,
            self.ref_heads,
            max(self.region_widths),
            seed=self.seed,
        )

    def prompt_blocks(self, num_tokens: int) -> tuple[int, int]:
        """(prefill blocks, decode blocks) a ``num_tokens``-token prompt fills."""
        return (
            _cdiv(num_tokens, self.prefill_tokens_per_block),
            _cdiv(num_tokens, self.block_size),
        )

    def request_prompt(self, pool: ReferencePrompt, spec: RequestSpec) -> ReferencePrompt:
        """The tokens a pull of ``spec`` moves, from the start of its prompt: the pool's tokens of
        its prefill blocks, in order, up to the end of the last decode block or of the last
        prefill block, whichever comes first (a moved piece past the prompt's end moves whole,
        as whole blocks do with equal sizes)."""
        bp, bd = self.prefill_tokens_per_block, self.block_size
        _, decode_blocks = self.prompt_blocks(spec.num_prompt_tokens)
        end = min(len(spec.remote_block_ids) * bp, decode_blocks * bd)
        tokens = np.concatenate(
            [np.arange(b * bp, (b + 1) * bp) for b in spec.remote_block_ids] or [np.arange(0)]
        )[:end]
        return ReferencePrompt(pool.data[:, tokens])

    def fits(self, spec: RequestSpec) -> str | None:
        """Why ``spec``'s block lists do not fit its prompt length (None: they do)."""
        prefill_blocks, decode_blocks = self.prompt_blocks(spec.num_prompt_tokens)
        if len(spec.remote_block_ids) != prefill_blocks:
            return (
                f"{len(spec.remote_block_ids)} prefill blocks for {spec.num_prompt_tokens} "
                f"tokens (expected {prefill_blocks})"
            )
        if len(spec.local_block_ids) > decode_blocks:
            return (
                f"{len(spec.local_block_ids)} decode blocks for {spec.num_prompt_tokens} "
                f"tokens (at most {decode_blocks})"
            )
        return None


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    transfer_id: str
    local_block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]
    #: decode was admitted before prefill finished: it learns the block ids from the read lease
    early: bool = False
    #: the prompt length; required with mixed block sizes (``remote_block_ids`` must then be
    #: its prefill blocks, ``local_block_ids`` its last decode blocks, after any cached prefix)
    prompt_tokens: int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        """The prompt length both sides agree on: ``prompt_tokens``, or a made-up length when
        not given (equal block sizes move whole blocks and do not use it)."""
        if self.prompt_tokens is not None:
            return self.prompt_tokens
        return 1000 + len(self.remote_block_ids)


@dataclass
class PullOutcome:
    done: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    failure_kinds: dict[str, str] = field(default_factory=dict)  # of the failed: FailureKind
    cancelled: list[str] = field(default_factory=list)  # of the failed: gave up, read nothing
    wrong_requests: dict[str, str] = field(default_factory=dict)
    stray_bytes: int = 0
    seconds: float = 0.0
    bytes_moved: int = 0
    descriptors: int = 0
    ready_seconds: float = 0.0  # slowest request: first read to KV ready (fix-up included)
    fixup_seconds: float = 0.0
    phases: dict[str, dict[str, float]] = field(default_factory=dict)  # request id -> timeline
