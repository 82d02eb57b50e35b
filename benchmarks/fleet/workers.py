"""The fleet's host processes: each hosts many simulated prefill workers or decode workers.

A prefill worker is the product's prefill side as ``connector.wiring.build_prefill_side`` wires
it: a ``SendTracker`` served by a ``PrefillSender`` on its own ``SideChannelServer`` port, real ZMQ
on loopback. A decode worker is the product's decode side as ``build_decode_side`` wires it: a
``Receiver`` with its claims exchange, peer lookup, peer directory, read lanes and read-done
notifier, a ``SideChannelClient`` and rank 0's ``PairingProbes``. The wiring is repeated here step
for step rather than called, because ``connector.wiring`` imports vLLM (through the connector's
configuration): without it a host starts in seconds and its RSS is the data path's, not vLLM's.
Both sides register and read through :class:`~.transport.LatencyTransport` (no bytes move). Every
worker is its own TP-1 instance with its own engine id and incarnation.

The only instrumentation is timestamps taken around the product's calls: when the simulation asks
a tracker to hold a transfer, when the tracker releases it (its ``_release``, wrapped on the
instance), and the decode receiver's own :class:`~vllm_ascend_mooncake.timeline.PullTimeline`
(``submitted``, ``granted``, ``landed``), all ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for
every process of the host, so stamps of different processes compare).

A host process is driven over a pipe by the coordinator (:mod:`.run`): each command is a
synchronous call.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
import time
import traceback
import uuid
from dataclasses import dataclass

HOST = "127.0.0.1"


@dataclass(frozen=True)
class Geometry:
    """The simulated model: tiny caches (no bytes move), shaped like vLLM's token-major ones."""

    heads: int = 1
    head_size: int = 2  # identity's head size; the cache's elements per head and token are twice
    layers: int = 2
    block_size: int = 128
    prefill_blocks: int = 64
    decode_blocks: int = 256


@dataclass(frozen=True)
class Timing:
    """Transport latency and the decode side's timeouts (short, so faults resolve in seconds)."""

    read_base_s: float = 0.0002
    read_per_descriptor_s: float = 0.000005
    side_channel_timeout_s: float = 3.0
    claim_wait_s: float = 5.0
    prefill_wait_s: float = 10.0
    claim_park_s: float = 0.5
    release_timeout_s: float = 30.0


def _topology(geometry: Geometry):
    from vllm_ascend_mooncake.core.topology import TransferTopology

    return TransferTopology(geometry.heads, 1, 1)


class _Cache:
    """A worker's KV cache as vLLM's one allocation of ``[blocks, H, N, C]`` layer views (K and V
    fused in C): one numpy buffer, and the regions ``registration.regions_from_vllm_views``
    describes for such views (built here directly, so that prefill processes need no torch)."""

    def __init__(self, geometry: Geometry, blocks: int) -> None:
        import numpy as np

        from vllm_ascend_mooncake.core.layout import BlockOrder, Region, RegionLayout
        from vllm_ascend_mooncake.datapath.transport import MemoryRange

        head_token_bytes = 2 * geometry.head_size * 2  # K and V, float16
        stride = geometry.heads * geometry.block_size * head_token_bytes
        self.buffer = np.zeros(geometry.layers * blocks * stride, dtype=np.uint8)
        base = self.buffer.ctypes.data
        layout = RegionLayout(
            BlockOrder.HEAD_MAJOR,
            blocks,
            stride,
            geometry.heads,
            geometry.block_size,
            head_token_bytes,
        )
        self.regions = [
            Region(f"layer.{layer}", base + layer * blocks * stride, layout)
            for layer in range(geometry.layers)
        ]
        self.ranges = [MemoryRange(base, self.buffer.nbytes)]


def _metadata(geometry: Geometry, engine_id: str, session: str, regions):
    """What ``connector.wiring._metadata`` advertises for a TP-1 worker of this model."""
    from vllm_ascend_mooncake.datapath.wire import ModelIdentity, RegionInfo, WorkerMetadata

    return WorkerMetadata(
        engine_id=engine_id,
        incarnation=uuid.uuid4().hex,
        tp_rank=0,
        tp_size=1,
        dp_rank=0,
        dp_size=1,
        pp_size=1,
        transport_session=session,
        identity=ModelIdentity(
            "fleet",
            "float16",
            "auto",
            geometry.block_size,
            geometry.head_size,
            geometry.heads,
            geometry.layers,
            False,
        ),
        regions=[RegionInfo.of(r) for r in regions],
        state_groups=[],
    )


class _PrefillWorker:
    """``connector.wiring.build_prefill_side``, step for step (no integrity-check memory: reads
    are not verified here)."""

    def __init__(self, name: str, port: int, geometry: Geometry, timing: Timing) -> None:
        from vllm_ascend_mooncake.datapath.prefill_service import PrefillSender
        from vllm_ascend_mooncake.datapath.sender import SendTracker

        from .transport import LatencyTransport

        self.name, self.port = name, port
        self.cache = _Cache(geometry, geometry.prefill_blocks)
        self.transport = LatencyTransport(f"fleet-{name}-{port}")
        self.transport.register(self.cache.ranges)
        metadata = _metadata(
            geometry, f"prefill-{name}", self.transport.session, self.cache.regions
        )
        self.tracker = SendTracker(_topology(geometry), 0, timing.release_timeout_s)
        self.sender = PrefillSender(metadata, self.tracker, HOST, port)
        self.held_at: dict[str, float] = {}
        self.released_at: dict[str, float] = {}
        release = self.tracker._release

        def stamped(transfer_id: str, request_id: str, why: str) -> None:
            self.released_at.setdefault(transfer_id, time.monotonic())
            release(transfer_id, request_id, why)

        self.tracker._release = stamped  # instrumentation only: the product's method still runs

    def close(self) -> None:
        self.sender.close()
        self.transport.close()


class PrefillHost:
    """Many prefill workers in one process, and an engine-step thread that collects every
    tracker's finished requests (what the connector's scheduler side does each step)."""

    def __init__(self, geometry: Geometry, timing: Timing) -> None:
        self.geometry, self.timing = geometry, timing
        self.workers: dict[str, _PrefillWorker] = {}
        self.retired: list[_PrefillWorker] = []
        self.finished = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._step = threading.Thread(target=self._steps, name="fleet-prefill-step", daemon=True)
        self._step.start()

    def _steps(self) -> None:
        while not self._stop.wait(0.05):
            with self._lock:
                trackers = [w.tracker for w in self.workers.values()]
            for tracker in trackers:
                self.finished += len(tracker.take_finished())

    def start(self, workers: list[tuple[str, int]]) -> list[str]:
        built = [_PrefillWorker(name, port, self.geometry, self.timing) for name, port in workers]
        with self._lock:
            self.workers.update((w.name, w) for w in built)
        return [w.transport.session for w in built]

    def hold(self, holds: list[tuple[str, str, tuple[int, ...], int]]) -> None:
        for name, transfer_id, block_ids, tokens in holds:
            worker = self.workers[name]
            worker.held_at[transfer_id] = time.monotonic()
            worker.tracker.hold(transfer_id, block_ids=block_ids, num_prompt_tokens=tokens)

    def drop(self, drops: list[tuple[str, str]]) -> None:
        for name, transfer_id in drops:
            self.workers[name].tracker.drop(transfer_id)

    def replace(self, name: str, port: int) -> str:
        """The pod ``name`` goes away and comes back on ``port`` (a new incarnation)."""
        with self._lock:
            old = self.workers.pop(name)
        old.close()
        self.retired.append(old)
        return self.start([(name, port)])[0]

    def collect(self) -> dict:
        stamps: dict[str, tuple[float, float | None]] = {}
        expired = 0
        for worker in [*self.retired, *self.workers.values()]:
            for transfer_id, held in worker.held_at.items():
                stamps[transfer_id] = (held, worker.released_at.get(transfer_id))
            expired += worker.tracker.num_expired
        held_now = sum(w.tracker.num_held for w in self.workers.values())
        return {"stamps": stamps, "expired": expired, "held_now": held_now}

    def close(self) -> None:
        self._stop.set()
        self._step.join(timeout=5)
        for worker in self.workers.values():
            worker.close()


class _DecodeWorker:
    """``connector.wiring.build_decode_side``, step for step (no staging buffer: a TP 1 -> 1
    pull never stages)."""

    def __init__(self, name: str, geometry: Geometry, timing: Timing) -> None:
        import torch

        from vllm_ascend_mooncake.core.relayout import LocalMemory
        from vllm_ascend_mooncake.datapath.pairing import PairingProbes
        from vllm_ascend_mooncake.datapath.peers import PeerDirectory
        from vllm_ascend_mooncake.datapath.receiver import Receiver, ReceiverOptions
        from vllm_ascend_mooncake.datapath.side_channel import SideChannelClient
        from vllm_ascend_mooncake.datapath.staging_pool import StagingPool

        from .transport import LatencyTransport

        self.name = name
        self.cache = _Cache(geometry, geometry.decode_blocks)
        self.transport = LatencyTransport(
            f"fleet-decode-{name}", timing.read_base_s, timing.read_per_descriptor_s
        )
        self.transport.register(self.cache.ranges)
        topology = _topology(geometry)
        metadata = _metadata(geometry, f"decode-{name}", self.transport.session, self.cache.regions)
        options = ReceiverOptions(
            claim_wait_s=timing.claim_wait_s,
            prefill_wait_s=timing.prefill_wait_s,
            claim_park_s=timing.claim_park_s,
            retry_backoff_s=0.05,
            notify_backoff_s=0.1,
        )
        self.client = SideChannelClient(timing.side_channel_timeout_s)
        self.peers = PeerDirectory(self.client, metadata, topology)
        memory = LocalMemory.from_tensors([torch.from_numpy(self.cache.buffer)])
        self.receiver = Receiver(
            self.transport,
            topology,
            0,
            self.cache.regions,
            memory,
            self.peers,
            self.client,
            options,
            StagingPool([]),
        )
        self.pairings = PairingProbes(self.peers)

    def close(self) -> None:
        self.pairings.close()
        self.receiver.shutdown()
        self.client.close()
        self.transport.close()


class DecodeHost:
    """Many decode workers in one process, and a thread that takes their reports (what vLLM's
    ``get_finished`` does each step)."""

    def __init__(self, geometry: Geometry, timing: Timing) -> None:
        self.geometry, self.timing = geometry, timing
        self.workers: dict[str, _DecodeWorker] = {}
        self.outcomes: dict[str, tuple[str, str]] = {}  # request id -> (done/failed, reason)
        self.timelines: dict[str, tuple[float, float | None, float | None]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reports = threading.Thread(target=self._collect, name="fleet-reports", daemon=True)
        self._reports.start()

    def _collect(self) -> None:
        while not self._stop.wait(0.02):
            with self._lock:
                receivers = [w.receiver for w in self.workers.values()]
            for receiver in receivers:
                done, failed = receiver.take_finished()
                stats = receiver.take_stats()
                with self._lock:
                    self._record(done, failed, stats)

    def _record(self, done, failed, stats) -> None:
        for request_id in done:
            self.outcomes[request_id] = ("done", "")
        for request_id, failure in failed.items():
            kind = "cancelled" if failure.cancelled else failure.kind.value
            self.outcomes[request_id] = ("failed", f"{kind}: {failure.reason}"[:300])
        for stat in stats:
            t = stat.timeline
            if t is not None:
                self.timelines[stat.request_id] = (t.submitted, t.granted, t.landed)

    def start(self, names: list[str]) -> None:
        built = [_DecodeWorker(name, self.geometry, self.timing) for name in names]
        with self._lock:
            self.workers.update((w.name, w) for w in built)

    def pull(self, pulls: list[tuple]) -> None:
        from vllm_ascend_mooncake.datapath.orders import PullOrder

        for name, request_id, transfer_id, local, remote, port, tokens in pulls:
            self.workers[name].receiver.submit(
                PullOrder(
                    request_id=request_id,
                    transfer_id=transfer_id,
                    local_block_ids=local,
                    remote_block_ids=remote,
                    remote_host=HOST,
                    remote_port=port,
                    num_prompt_tokens=tokens,
                )
            )

    def cancel(self, cancels: list[tuple[str, str]]) -> None:
        for name, request_id in cancels:
            self.workers[name].receiver.cancel(request_id)

    def dead(self, session: str) -> None:
        from .transport import mark_dead

        mark_dead(session)

    def collect(self) -> dict:
        with self._lock:
            return {"outcomes": dict(self.outcomes), "timelines": dict(self.timelines)}

    def close(self) -> None:
        self._stop.set()
        self._reports.join(timeout=5)
        for worker in self.workers.values():
            worker.close()


def thread_names() -> dict[str, int]:
    """This process's Python threads by name, digits folded (``vam-notify-23456`` counts as
    ``vam-notify-#``): which parts of the product own the threads."""
    import re

    counts: dict[str, int] = {}
    for thread in threading.enumerate():
        name = re.sub(r"\d+", "#", thread.name)
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def _host_main(conn, role: str, geometry: Geometry, timing: Timing, log_level: str) -> None:
    import logging
    import sys

    # No vLLM in the hosts: the product's loggers fall back to the standard library's (as they do
    # wherever vLLM is not installed), and a host starts in seconds with a small RSS.
    sys.modules["vllm"] = None
    logging.basicConfig(format="%(processName)s %(name)s %(levelname)s %(message)s")
    for name in ("vllm", "vllm_ascend_mooncake"):
        logging.getLogger(name).setLevel(log_level)
    host = None
    while True:
        command, args = conn.recv()
        if command == "exit":
            if host is not None:
                with contextlib.suppress(Exception):
                    host.close()
            conn.send(("ok", None))
            return
        if command == "threads":
            conn.send(("ok", thread_names()))
            continue
        try:
            if host is None:
                host = (PrefillHost if role == "prefill" else DecodeHost)(geometry, timing)
            conn.send(("ok", getattr(host, command)(*args)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class HostProcess:
    """A handle on one host process; calls are synchronous over a pipe (``send`` then
    ``receive`` lets the coordinator drive several hosts at once)."""

    def __init__(
        self, role: str, label: str, geometry: Geometry, timing: Timing, log_level: str = "ERROR"
    ) -> None:
        ctx = mp.get_context("spawn")
        self.role, self.label = role, label
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_host_main,
            args=(child, role, geometry, timing, log_level),
            daemon=True,
            name=label,
        )
        self.process.start()
        self.pid = self.process.pid
        self.alive = True

    def send(self, command: str, *args) -> None:
        self._conn.send((command, args))

    def receive(self, timeout_s: float = 120):
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"host {self.label} (pid {self.pid}) did not answer")
        status, result = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"host {self.label} failed:\n{result}")
        return result

    def call(self, command: str, *args, timeout_s: float = 120):
        self.send(command, *args)
        return self.receive(timeout_s)

    def close(self) -> None:
        if self.alive and self.process.is_alive():
            try:
                self.call("exit", timeout_s=20)
            except Exception:
                self.process.kill()
        self.alive = False
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
