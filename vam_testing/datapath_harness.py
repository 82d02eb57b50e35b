"""Real prefill and decode worker processes moving KV over Mooncake, for tests and benchmarks.

Each :class:`WorkerProcess` is a separate OS process with its own Mooncake transfer engine, reused
across cases (:mod:`.datapath_cases`): per case it allocates a KV cache shaped like the engine's
(:mod:`.kv_caches`), registers it, and runs the real
:class:`~vllm_ascend_mooncake.datapath.prefill_service.PrefillSender` or
:class:`~vllm_ascend_mooncake.datapath.receiver.Receiver` through the production wiring. Prefill
caches are filled from the case's reference; decode workers check every pulled byte against it, and
that no byte outside the requested blocks changed.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
import uuid

import numpy as np

from .datapath_cases import CaseSpec, PullOutcome, RequestSpec
from .kv_reference import ReferencePrompt, owned_heads

# ---------------------------------------------------------------------------------------------
# Inside the worker process


class _WorkerState:
    def __init__(self, read_wait: str | None = None) -> None:
        from vllm_ascend_mooncake.datapath.mooncake import MooncakeTransport

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

    def _allocate(self, case: CaseSpec, heads: int, num_blocks: int, block_size: int) -> None:
        import torch

        from .kv_caches import KVCache

        self.cache = KVCache(
            case.layout,
            num_layers=case.num_layers,
            heads=heads,
            num_blocks=num_blocks,
            block_size=block_size,
            head_size=case.head_token_bytes // case.element_size,
            dtype={2: torch.float16, 4: torch.float32, 1: torch.int8}[case.element_size],
            seed=case.seed + 1000 + self.rank,
            mla_widths=case.mla_widths,
            packing=case.packing,
        )
        self.tensors, self.regions = self.cache.tensors, self.cache.regions
        self.memory_arrays = self.cache.arrays

    def _region_arrays(self) -> list[tuple[np.ndarray, int, int]]:
        """Per region: its buffer, its offset in it and the buffer's index."""
        return [self.cache.region_array(index) for index in range(len(self.regions))]

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
        from vllm_ascend_mooncake.connector.wiring import WorkerIdentity
        from vllm_ascend_mooncake.datapath.wire import ModelIdentity

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
        from vllm_ascend_mooncake.connector.wiring import (
            KVCacheMemory,
            PrefillSettings,
            build_prefill_side,
        )

        self.case, self.rank = case, rank
        topo = case.topology()
        heads = owned_heads(case.ref_heads, case.prefill_tp, rank, case.is_mla)
        self._allocate(case, len(heads), case.prefill_blocks, case.prefill_tokens_per_block)
        if case.verify and case.mixed_block_sizes:
            pool = case.prompt_pool()
            for index, (array, offset, _) in enumerate(self._region_arrays()):
                self._place(pool, array, index, offset, heads, range(case.prefill_blocks))
        ref = case.reference() if case.verify and not case.mixed_block_sizes else None
        for index, region in enumerate(self.regions if ref is not None else ()):
            array, offset, _ = self.cache.region_array(index)
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

        from vllm_ascend_mooncake.connector.wiring import (
            DecodeSettings,
            KVCacheMemory,
            build_decode_side,
        )
        from vllm_ascend_mooncake.datapath.receiver import ReceiverOptions
        from vllm_ascend_mooncake.datapath.registration import kv_memory_ranges

        self.case, self.rank = case, rank
        topo = case.topology()
        heads = owned_heads(case.ref_heads, case.decode_tp, rank, case.is_mla)
        self._allocate(case, len(heads), case.decode_blocks, case.block_size)
        self.ceiling_tensor = torch.zeros(max(case.ceiling_bytes, 1), dtype=torch.uint8)
        self.transport.register(kv_memory_ranges([self.ceiling_tensor]))
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
        from vllm_ascend_mooncake.datapath.orders import PullOrder

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
                array, offset, buffer_index = self.cache.region_array(index)
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
        # The spawned child imports _worker_main by name, from this package outside the installed
        # one: multiprocessing hands the child this process's sys.path, which found it.
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
