"""The fleet simulation's byte transport: it moves no bytes, it only takes time.

:class:`~vllm_ascend_mooncake.datapath.fake.InProcessTransport` copies bytes between transports of
one process; the fleet's prefill and decode workers live in different processes, and what the
simulation measures is the control plane (side channels, claims, leases, lookups, lanes, notices),
not the byte path (measured by ``benchmarks/micro/bench_transfer.py`` and the e2e benchmarks over
real Mooncake). So :class:`LatencyTransport` implements the :class:`~vllm_ascend_mooncake.datapath.
transport.Transport` protocol by checking the read's shape and sleeping ``base_s +
per_descriptor_s * descriptors``: the receiver's lanes are held for as long as a read would hold
them, and nothing lands in decode's memory. A read from a session that was marked dead
(:func:`mark_dead`, a simulated pod that is gone) fails settled, as Mooncake's does once the peer's
engine is unreachable.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence

from vllm_ascend_mooncake.datapath.transport import MemoryRange, TransferError, merge_ranges

_dead: set[str] = set()
_lock = threading.Lock()


def mark_dead(session: str) -> None:
    """Reads from ``session`` fail from now on (in this process)."""
    with _lock:
        _dead.add(session)


class LatencyTransport:
    """A :class:`~vllm_ascend_mooncake.datapath.transport.Transport` that sleeps instead of
    copying; one per simulated worker, named by ``session``."""

    def __init__(self, session: str, base_s: float = 0.0, per_descriptor_s: float = 0.0) -> None:
        self.session = session
        self.base_s = base_s
        self.per_descriptor_s = per_descriptor_s
        self._memory: list[MemoryRange] = []
        self._lock = threading.Lock()
        self.num_reads = 0
        self.num_descriptors = 0

    def register(self, ranges: Iterable[MemoryRange]) -> list[MemoryRange]:
        merged = merge_ranges(ranges)
        with self._lock:
            self._memory = merge_ranges([*self._memory, *merged])
        return merged

    def unregister(self) -> list[MemoryRange]:
        with self._lock:
            ranges, self._memory = self._memory, []
        return ranges

    def read(
        self,
        peer_session: str,
        local_addrs: Sequence[int],
        remote_addrs: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        if not len(lengths):
            return
        if not len(local_addrs) == len(remote_addrs) == len(lengths):
            raise TransferError("descriptor lists of different lengths")
        with self._lock:
            self.num_reads += 1
            self.num_descriptors += len(lengths)
        delay = self.base_s + self.per_descriptor_s * len(lengths)
        if delay > 0:
            time.sleep(delay)
        with _lock:
            dead = peer_session in _dead
        if dead:
            raise TransferError(f"transport session {peer_session} is unreachable")

    def close(self) -> None:
        with self._lock:
            self._memory = []
