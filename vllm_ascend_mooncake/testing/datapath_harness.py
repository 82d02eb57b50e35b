"""Real prefill and decode worker processes moving KV over Mooncake, for tests and benchmarks.

Each :class:`WorkerProcess` is a separate OS process with its own Mooncake transfer engine, reused
across cases: per case it allocates a KV cache shaped like the engine's (vLLM per-layer views,
vllm-ascend separate K/V tensors, or vllm-ascend's MLA nope and rope tensors), registers it, and
runs the real :class:`PrefillSender` or :class:`Receiver`. Prefill caches are filled from a
:class:`ReferenceKV`; decode workers check every pulled block against it byte for byte, and that
no byte outside the requested blocks changed.

When prefill and decode use different block sizes (``CaseSpec.prefill_block_size``), prefill
caches are filled token by token from a :class:`ReferencePrompt` instead (the "pool": prefill
block ``b`` holds its tokens ``b * Bp ..``), a request's prompt is the pool's tokens of its
prefill blocks, in order, and decode expects every token the transfer moves in its slot
(:meth:`ReferencePrompt.place`) and every other byte of its cache unchanged.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
import uuid
from dataclasses import dataclass, field

import numpy as np

from ..core.layout import ChunkPacking
from ..core.packing import chunk_packing
from ..core.topology import TransferTopology
from .kv_reference import ReferenceKV, ReferencePrompt, owned_heads

LAYOUTS = ("vllm_head_major", "vllm_token_major", "split_kv", "mla", "ascend_mla")

#: vLLM CPU's ISA kernels whose head-major chunk packing is described (:mod:`..core.packing`).
CPU_PACKINGS = ("vec", "vec16", "amx")


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
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r} (one of {LAYOUTS})")
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


# ---------------------------------------------------------------------------------------------
# Inside the worker process


class _WorkerState:
    def __init__(self, read_wait: str | None = None) -> None:
        from ..datapath.mooncake import MooncakeTransport

        self.transport = MooncakeTransport("127.0.0.1", "tcp", read_wait=read_wait)
        self.case: CaseSpec | None = None
        self.rank = -1
        self.tensors: list = []
        self.regions: list = []
        self.memory_arrays: list[np.ndarray] = []
        self.sender = None
        self.receiver = None
        self.client = None
        self.finished_counts: dict[str, int] = {}

    # -- cache construction --------------------------------------------------------------

    def _allocate(
        self, case: CaseSpec, heads: int, num_blocks: int, fill_value: int | None, block_size: int
    ):
        import torch

        from ..datapath.registration import regions_from_split_caches, regions_from_vllm_views

        dtype = {2: torch.float16, 4: torch.float32, 1: torch.int8}[case.element_size]
        n, c = block_size, case.head_token_bytes // case.element_size
        if case.layout == "split_kv":
            caches = {
                f"layer.{i}": tuple(
                    torch.empty(num_blocks, n, heads, c, dtype=dtype) for _ in range(2)
                )
                for i in range(case.num_layers)
            }
            tensors = [t for pair in caches.values() for t in pair]
            regions = regions_from_split_caches(
                caches, num_kv_heads=heads, block_size=n, head_size=c, is_mla=False
            )
        elif case.layout == "ascend_mla":
            # vllm-ascend: per layer (nope, rope), [blocks, block_size, 1, width], each its own
            # allocation (see datapath/registration.py for where this was read).
            caches = {
                f"layer.{i}": tuple(
                    torch.empty(num_blocks, n, 1, width, dtype=dtype) for width in case.mla_widths
                )
                for i in range(case.num_layers)
            }
            tensors = [t for pair in caches.values() for t in pair]
            regions = regions_from_split_caches(
                caches,
                num_kv_heads=1,
                block_size=n,
                head_size=case.identity_head_size,
                is_mla=True,
            )
        else:
            h = 1 if case.is_mla else heads
            page = h * n * c
            raw = torch.empty(case.num_layers * num_blocks * page, dtype=dtype)
            if case.layout == "vllm_token_major":
                strides = (page, c, h * c, 1)
            else:
                strides = (page, n * c, c, 1)
            caches = {
                f"layer.{i}": raw.as_strided((num_blocks, h, n, c), strides, i * num_blocks * page)
                for i in range(case.num_layers)
            }
            tensors = [raw]
            regions = regions_from_vllm_views(
                caches, num_kv_heads=h, block_size=n, is_mla=case.is_mla, packing=case.packing
            )
        arrays = []
        rng = np.random.default_rng(case.seed + 1000 + self.rank)
        for tensor in tensors:
            flat = tensor.view(-1).view(torch.uint8).numpy()
            flat[:] = (
                rng.integers(0, 256, flat.size, dtype=np.uint8)
                if fill_value is None
                else fill_value
            )
            arrays.append(flat)
        return tensors, regions, arrays

    def _region_array(self, index: int) -> tuple[np.ndarray, int]:
        """The numpy array holding region ``index`` and the region's offset in it."""
        base = self.regions[index].base
        for tensor, array in zip(self.tensors, self.memory_arrays, strict=True):
            start = tensor.data_ptr()
            if start <= base < start + array.size:
                return array, base - start
        raise AssertionError(f"region {index} not in any buffer")

    def _region_arrays(self) -> list[tuple[np.ndarray, int, int]]:
        """Per region: its buffer, its offset in it and the buffer's index."""
        out = []
        for index in range(len(self.regions)):
            array, offset = self._region_array(index)
            buffer_index = next(i for i, a in enumerate(self.memory_arrays) if a is array)
            out.append((array, offset, buffer_index))
        return out

    def _place(
        self,
        prompt: ReferencePrompt,
        memory: np.ndarray,
        index: int,
        offset: int,
        heads: list[int],
        block_ids,
        first_block: int = 0,
    ) -> None:
        """Write ``prompt``'s tokens of region ``index`` (its own width) into ``memory``."""
        layout = self.regions[index].layout
        width = layout.head_token_bytes
        region_prompt = ReferencePrompt(prompt.data[index : index + 1, :, :, :width])
        region_prompt.place(memory, [layout], [offset], heads, list(block_ids), first_block)

    def _identity(self, case: CaseSpec, role: str, tp_rank: int, tp_size: int, block_size: int):
        from ..connector.wiring import WorkerIdentity
        from ..datapath.wire import ModelIdentity

        return WorkerIdentity(
            engine_id=f"{case.name}-{role}",
            incarnation=uuid.uuid4().hex,
            tp_rank=tp_rank,
            tp_size=tp_size,
            dp_rank=0,
            dp_size=1,
            model=ModelIdentity(
                model="reference",
                dtype=f"e{case.element_size}",
                kv_cache_dtype="auto",
                block_size=block_size,
                head_size=case.identity_head_size,
                num_kv_heads=case.heads,
                num_layers=case.num_layers,
                is_mla=case.is_mla,
                attention_backend=case.attention_backend,
            ),
        )

    # -- commands -------------------------------------------------------------------------

    def setup_prefill(self, case: CaseSpec, rank: int) -> str:
        from ..connector.wiring import KVCacheMemory, PrefillSettings, build_prefill_side

        self.case, self.rank = case, rank
        topo = case.topology()
        heads = owned_heads(case.ref_heads, case.prefill_tp, rank, case.is_mla)
        self.tensors, self.regions, self.memory_arrays = self._allocate(
            case, len(heads), case.prefill_blocks, None, case.prefill_tokens_per_block
        )
        if case.verify and case.mixed_block_sizes:
            pool = case.prompt_pool()
            for index, (array, offset, _) in enumerate(self._region_arrays()):
                self._place(pool, array, index, offset, heads, range(case.prefill_blocks))
        ref = case.reference() if case.verify and not case.mixed_block_sizes else None
        for index, region in enumerate(self.regions if ref is not None else ()):
            array, offset = self._region_array(index)
            ref.fill(
                array[offset:],
                [region.layout],
                [0],
                heads,
                ((b, b) for b in range(case.prefill_blocks)),
                first_region=index,
            )
        side = build_prefill_side(
            self._identity(case, "prefill", rank, case.prefill_tp, case.prefill_tokens_per_block),
            topo,
            self.transport,
            KVCacheMemory(self.tensors, self.regions),
            PrefillSettings("127.0.0.1", case.base_port + rank, case.release_timeout_s),
        )
        self.sender = side.sender
        self.finished_counts = {}
        return self.transport.session

    def hold(self, requests: list[RequestSpec]) -> None:
        """Prefill is done with these requests: hold their blocks for decode's reads."""
        for spec in requests:
            self.sender.tracker.hold(
                spec.transfer_id,
                block_ids=spec.remote_block_ids,
                num_prompt_tokens=spec.num_prompt_tokens,
            )

    def drop(self, transfer_ids: list[str]) -> None:
        """Prefill ended these requests without a hand-off (aborted)."""
        for transfer_id in transfer_ids:
            self.sender.tracker.drop(transfer_id)

    def collect_finished(self, expected: list[str], timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            for request_id in self.sender.tracker.take_finished():
                self.finished_counts[request_id] = self.finished_counts.get(request_id, 0) + 1
            if all(r in self.finished_counts for r in expected) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        time.sleep(0.05)  # a duplicate report would show up now
        for request_id in self.sender.tracker.take_finished():
            self.finished_counts[request_id] = self.finished_counts.get(request_id, 0) + 1
        return {"counts": dict(self.finished_counts), "expired": self.sender.tracker.num_expired}

    def setup_decode(self, case: CaseSpec, rank: int) -> str:
        import torch

        from ..connector.wiring import (
            DecodeSettings,
            KVCacheMemory,
            build_decode_side,
        )
        from ..datapath.receiver import ReceiverOptions
        from ..datapath.registration import storage_ranges

        self.case, self.rank = case, rank
        topo = case.topology()
        heads = owned_heads(case.ref_heads, case.decode_tp, rank, case.is_mla)
        self.tensors, self.regions, self.memory_arrays = self._allocate(
            case, len(heads), case.decode_blocks, None, case.block_size
        )
        self.ceiling_tensor = torch.zeros(max(case.ceiling_bytes, 1), dtype=torch.uint8)
        self.transport.register(storage_ranges([self.ceiling_tensor]))
        self.snapshot = [a.copy() for a in self.memory_arrays] if case.verify else []
        # The production wiring, with sizes in bytes (the keys' KiB and MiB cannot express the
        # few-hundred-byte descriptors and staging buffers some cases use).
        side = build_decode_side(
            self._identity(case, "decode", rank, case.decode_tp, case.block_size),
            topo,
            self.transport,
            KVCacheMemory(self.tensors, self.regions),
            DecodeSettings(
                receiver=ReceiverOptions(
                    max_descriptors_per_batch=case.max_descriptors_per_batch,
                    coalesce_runs=case.coalesce_runs,
                    block_reads_from_bytes=case.block_reads_from_bytes,
                    max_descriptor_bytes=case.max_descriptor_bytes,
                    verify_reads=case.verify_reads,
                ),
                staging_bytes=case.staging_bytes,
            ),
        )
        self.decode_side = side
        self.client, self.receiver = side.client, side.receiver
        self.peers = side.peers
        return self.transport.session

    def pull(
        self,
        requests: list[RequestSpec],
        timeout_s: float,
        cancel_after_s: dict[str, float] | None = None,
    ) -> PullOutcome:
        """Pull ``requests`` and wait for every report; ``cancel_after_s`` (request id -> delay)
        cancels requests as vLLM does for one aborted while its KV loads."""
        from ..datapath.orders import PullOrder

        case = self.case
        outcome = PullOutcome()
        started = time.perf_counter()
        for spec in requests:
            self.receiver.submit(
                PullOrder(
                    request_id=spec.request_id,
                    transfer_id=spec.transfer_id,
                    local_block_ids=spec.local_block_ids,
                    remote_block_ids=None if spec.early else spec.remote_block_ids,
                    remote_host="127.0.0.1",
                    remote_port=case.base_port,
                    num_prompt_tokens=spec.num_prompt_tokens,
                )
            )
        # A pull without local blocks only releases prefill's hold: like vLLM, wait for no report.
        pending = {spec.request_id for spec in requests if spec.local_block_ids}
        deadline = time.monotonic() + timeout_s
        cancels = sorted((started + delay, rid) for rid, delay in (cancel_after_s or {}).items())
        while pending and time.monotonic() < deadline:
            while cancels and time.perf_counter() >= cancels[0][0]:
                self.receiver.cancel(cancels.pop(0)[1])
            done, failed = self.receiver.take_finished()
            outcome.done.extend(done)
            outcome.failed.update({r: f.reason for r, f in failed.items()})
            outcome.failure_kinds.update({r: f.kind.value for r, f in failed.items()})
            outcome.cancelled.extend(r for r, f in failed.items() if f.cancelled)
            pending -= done | set(failed)
            time.sleep(0.002)
        outcome.seconds = time.perf_counter() - started
        for stat in self.receiver.take_stats():
            if stat.timeline is not None:
                stat.timeline.reported = time.monotonic()
                outcome.phases[stat.request_id] = stat.timeline.phases()
            outcome.bytes_moved += stat.num_bytes
            outcome.descriptors += stat.num_descriptors
            outcome.ready_seconds = max(outcome.ready_seconds, stat.seconds)
            outcome.fixup_seconds = max(outcome.fixup_seconds, stat.fixup_seconds)
        for request_id in pending:
            outcome.failed[request_id] = f"not finished within {timeout_s} s"
        if case.verify and case.mixed_block_sizes:
            self._verify_tokens(requests, outcome)
        elif case.verify:
            self._verify(requests, outcome)
        return outcome

    def resnapshot(self) -> None:
        """Accept the decode cache's current bytes as the baseline for later stray-byte checks."""
        self.snapshot = [a.copy() for a in self.memory_arrays]

    def bytes_changed(self) -> int:
        """Bytes of the decode cache that differ from the last snapshot (late writes)."""
        return sum(
            int((a != b).sum()) for a, b in zip(self.memory_arrays, self.snapshot, strict=True)
        )

    def ceiling_read(self, bytes_per_rank: dict[int, int], chunk: int = 1 << 20) -> float:
        """The transport's ceiling: the same bytes from the same prefill ranks, read as plain
        ``chunk``-sized descriptors (in parallel across ranks), into a scratch buffer."""
        from concurrent.futures import ThreadPoolExecutor

        case = self.case
        jobs = []
        local = self.ceiling_tensor.data_ptr()
        for rank, total in sorted(bytes_per_rank.items()):
            peer = self.peers.get("127.0.0.1", case.base_port + rank)
            local_addrs, remote_addrs, lengths = [], [], []
            left = total
            for region in peer.regions:
                offset = 0
                while left and offset < region.layout.span_bytes:
                    size = min(chunk, left, region.layout.span_bytes - offset)
                    local_addrs.append(local)
                    remote_addrs.append(region.base + offset)
                    lengths.append(size)
                    local, offset, left = local + size, offset + size, left - size
            if left:
                raise ValueError(f"prefill rank {rank} registers fewer than {total} bytes")
            jobs.append((peer.transport_session, local_addrs, remote_addrs, lengths))
        if local - self.ceiling_tensor.data_ptr() > self.ceiling_tensor.numel():
            raise ValueError("ceiling buffer too small")
        cap = case.max_descriptors_per_batch

        def read(job) -> None:
            session, la, ra, ln = job
            for i in range(0, len(ln), cap):
                self.transport.read(session, la[i : i + cap], ra[i : i + cap], ln[i : i + cap])

        started = time.perf_counter()
        with ThreadPoolExecutor(len(jobs)) as pool:
            list(pool.map(read, jobs))
        return time.perf_counter() - started

    def _verify(self, requests: list[RequestSpec], outcome: PullOutcome) -> None:
        case = self.case
        ref = case.reference()
        heads = owned_heads(case.ref_heads, case.decode_tp, self.rank, case.is_mla)
        expected = [a.copy() for a in self.snapshot]
        done = set(outcome.done)
        for spec in requests:
            remote = spec.remote_block_ids[len(spec.remote_block_ids) - len(spec.local_block_ids) :]
            for index, region in enumerate(self.regions):
                array, offset = self._region_array(index)
                buffer_index = next(i for i, a in enumerate(self.memory_arrays) if a is array)
                layout = region.layout
                for local, ref_block in zip(spec.local_block_ids, remote, strict=True):
                    start = offset + local * layout.block_stride
                    want = ref.expected_block(
                        index, ref_block, heads, layout.block_order, layout.packing
                    )
                    got = array[start : start + layout.block_len]
                    if spec.request_id in done and not np.array_equal(got, want):
                        outcome.wrong_requests[spec.request_id] = (
                            f"region {region.name} block {local}: "
                            f"{int((got != want).sum())} wrong bytes"
                        )
                    # Whatever happened, these bytes may change; nothing else may.
                    expected[buffer_index][start : start + layout.block_len] = got
        for array, want in zip(self.memory_arrays, expected, strict=True):
            outcome.stray_bytes += int((array != want).sum())

    def _verify_tokens(self, requests: list[RequestSpec], outcome: PullOutcome) -> None:
        """Mixed block sizes: a loaded request's decode blocks hold every token the pull moves,
        in its slot, and their other slots keep their bytes; a request that did not load may
        have changed its decode blocks; no other byte of the cache may change."""
        case = self.case
        pool = case.prompt_pool()
        heads = owned_heads(case.ref_heads, case.decode_tp, self.rank, case.is_mla)
        expected = [a.copy() for a in self.snapshot]
        done = set(outcome.done)
        regions = self._region_arrays()

        def spans(spec: RequestSpec):
            for index, (array, offset, buffer_index) in enumerate(regions):
                layout = self.regions[index].layout
                for local in spec.local_block_ids:
                    start = offset + local * layout.block_stride
                    yield index, buffer_index, array, start, start + layout.block_len

        for spec in requests:
            misfit = case.fits(spec)
            if spec.request_id in done and misfit is not None:
                outcome.wrong_requests[spec.request_id] = f"loaded, but {misfit}"
            if spec.request_id not in done or misfit is not None:
                # Whatever happened, these bytes may change; nothing else may.
                for _, buffer_index, array, start, stop in spans(spec):
                    expected[buffer_index][start:stop] = array[start:stop]
                continue
            prompt = case.request_prompt(pool, spec)
            _, decode_blocks = case.prompt_blocks(spec.num_prompt_tokens)
            cached = decode_blocks - len(spec.local_block_ids)
            for index, (_, offset, buffer_index) in enumerate(regions):
                self._place(
                    prompt,
                    expected[buffer_index],
                    index,
                    offset,
                    heads,
                    spec.local_block_ids,
                    first_block=cached,
                )
            for index, buffer_index, array, start, stop in spans(spec):
                got, want = array[start:stop], expected[buffer_index][start:stop]
                if not np.array_equal(got, want):
                    block = (start - regions[index][1]) // self.regions[index].layout.block_stride
                    outcome.wrong_requests.setdefault(
                        spec.request_id,
                        f"region {self.regions[index].name} block {block}: "
                        f"{int((got != want).sum())} wrong bytes",
                    )
                    want[:] = got  # counted as wrong, not as stray
        for array, want in zip(self.memory_arrays, expected, strict=True):
            outcome.stray_bytes += int((array != want).sum())

    def teardown(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.shutdown()
        if self.client is not None:
            self.client.close()
        self.transport.close()
        self.sender = self.receiver = self.client = None
        self.tensors, self.memory_arrays = [], []


def _worker_main(conn, read_wait: str | None) -> None:
    state = None
    while True:
        command, args = conn.recv()
        if command == "exit":
            conn.send(("ok", None))
            return
        try:
            if state is None:
                state = _WorkerState(read_wait)
            result = getattr(state, command)(*args)
            conn.send(("ok", result))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class WorkerProcess:
    """A handle on one worker process; calls are synchronous RPCs over a pipe."""

    def __init__(self, read_wait: str | None = None) -> None:
        """``read_wait``: how this worker's reads wait (the connector's default when None)."""
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, read_wait), daemon=True)
        self.process.start()

    def send(self, command: str, *args) -> None:
        self._conn.send((command, args))

    def receive(self, timeout_s: float = 300):
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"worker process {self.process.pid} did not answer")
        status, result = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"worker process {self.process.pid} failed:\n{result}")
        return result

    def call(self, command: str, *args, timeout_s: float = 300):
        self.send(command, *args)
        return self.receive(timeout_s)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.call("exit", timeout_s=10)
            except Exception:
                self.process.kill()
        self.process.join(timeout=10)
