"""An in-process :class:`~.transport.Transport` for unit tests; never used in production.

Every :class:`InProcessTransport` of a process is listed in a module-level registry under its
``session``, so a decode-side transport finds a prefill-side one exactly as Mooncake does, by the
session its peer advertises. A read checks that the peer exists and is open and that every range,
remote and local, lies inside registered memory (the bounds Mooncake enforces), then copies with
``memmove``. Tests inject failures (settled or not), corrupted bytes, a per-read delay, and count
reads and descriptors.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .transport import (
    MemoryRange,
    TransferError,
    TransportSetupError,
    UnsettledTransfer,
    merge_ranges,
)

_registry: dict[str, InProcessTransport] = {}
_registry_lock = threading.Lock()
_names = itertools.count()


@dataclass
class _Fault:
    remaining: int | None  # None: every matching read until cleared
    peer: str | None  # None: reads from any peer
    unsettled: bool


class InProcessTransport:
    """Moves bytes between transports of this process (a test double for Mooncake)."""

    def __init__(self, session: str | None = None) -> None:
        self.session = session or f"inproc-{next(_names)}"
        self._memory: list[MemoryRange] = []
        self._lock = threading.Lock()
        self._faults: list[_Fault] = []
        self._closed = False
        #: seconds every read sleeps before copying (a slow link)
        self.delay_s = 0.0
        #: reads still to corrupt (:meth:`corrupt_reads`)
        self._corruptions = 0
        #: read calls (failed ones included), their descriptors, and the bytes that landed
        self.num_reads = 0
        self.num_descriptors = 0
        self.num_bytes = 0
        self.num_failed_reads = 0
        with _registry_lock:
            if self.session in _registry:
                raise TransportSetupError(f"transport session {self.session} exists already")
            _registry[self.session] = self

    # -- fault injection ----------------------------------------------------------------------

    def fail_reads(
        self, count: int | None = 1, *, peer: str | None = None, unsettled: bool = False
    ) -> None:
        """Make the next ``count`` reads (from ``peer`` only, when given; every one when
        ``count`` is None) raise :class:`TransferError`, or :class:`UnsettledTransfer`."""
        with self._lock:
            self._faults.append(_Fault(count, peer, unsettled))

    def corrupt_reads(self, count: int = 1) -> None:
        """Make the next ``count`` reads that succeed land one flipped bit (in the last byte of
        their first descriptor): a corruption in flight no transport error reports."""
        with self._lock:
            self._corruptions += count

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def _take_fault(self, peer: str) -> _Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.peer is None or fault.peer == peer:
                    if fault.remaining is not None:
                        fault.remaining -= 1
                        if fault.remaining == 0:
                            self._faults.remove(fault)
                    return fault
        return None

    # -- the Transport protocol ---------------------------------------------------------------

    @property
    def registered(self) -> Sequence[MemoryRange]:
        with self._lock:
            return tuple(self._memory)

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
        with self._lock:
            self.num_reads += 1
            self.num_descriptors += len(lengths)
        try:
            self._read(peer_session, local_addrs, remote_addrs, lengths)
        except TransferError:
            with self._lock:
                self.num_failed_reads += 1
            raise

    def _read(
        self,
        peer_session: str,
        local_addrs: Sequence[int],
        remote_addrs: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        if not len(local_addrs) == len(remote_addrs) == len(lengths):
            raise TransferError(
                f"read of {len(lengths)} descriptors names {len(local_addrs)} local and "
                f"{len(remote_addrs)} remote addresses"
            )
        if self.delay_s:
            time.sleep(self.delay_s)
        with _registry_lock:
            peer = _registry.get(peer_session)
        if peer is None or peer._closed:
            raise TransferError(f"transport session {peer_session} is unknown or closed")
        if self._closed:
            raise TransferError(f"transport {self.session} is closed")
        fault = self._take_fault(peer_session)
        if fault is not None:
            error = UnsettledTransfer if fault.unsettled else TransferError
            raise error(f"injected read failure from {peer_session}")
        remote_memory, local_memory = peer.registered, self.registered
        for i, (local, remote, length) in enumerate(
            zip(local_addrs, remote_addrs, lengths, strict=True)
        ):
            if not _inside(remote_memory, int(remote), int(length)):
                raise TransferError(
                    f"descriptor {i}: remote [{int(remote):#x}, +{int(length)}) is outside the "
                    f"memory {peer_session} registered"
                )
            if not _inside(local_memory, int(local), int(length)):
                raise TransferError(
                    f"descriptor {i}: local [{int(local):#x}, +{int(length)}) is outside the "
                    f"memory {self.session} registered"
                )
        for local, remote, length in zip(local_addrs, remote_addrs, lengths, strict=True):
            ctypes.memmove(int(local), int(remote), int(length))
        with self._lock:
            self.num_bytes += sum(int(length) for length in lengths)
            corrupt = self._corruptions > 0 and len(lengths) > 0
            self._corruptions -= corrupt
        if corrupt:
            last = ctypes.c_uint8.from_address(int(local_addrs[0]) + int(lengths[0]) - 1)
            last.value ^= 0x10

    def close(self) -> None:
        with _registry_lock:
            self._closed = True
            if _registry.get(self.session) is self:
                del _registry[self.session]


def _inside(memory: Sequence[MemoryRange], addr: int, length: int) -> bool:
    return length >= 0 and any(r.addr <= addr and addr + length <= r.end for r in memory)
