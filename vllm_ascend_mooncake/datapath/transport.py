"""The transport seam: what the data path needs from whatever moves KV bytes between hosts.

Decode reads prefill's memory one-sidedly: a transport registers this process's KV memory, names
itself with a ``session`` string that peers read from, and copies byte ranges from a peer's
registered memory into local memory. :class:`~.mooncake.MooncakeTransport` is the real one;
:class:`~.fake.InProcessTransport` moves bytes between transports in one process, so that the
receiver, sender and wiring can be unit-tested in milliseconds. A new transport (NIXL, HIXL)
implements :class:`Transport` and is added to :func:`~..connector.wiring.create_transport`.

The errors are part of the contract: :class:`TransferError` means a read failed and *settled* (no
byte of it will land any more), :class:`UnsettledTransfer` that bytes may still land in local
memory later, which the receiver must then never hand back for reuse.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

#: Transports accepted as the ``transport`` key;
#: :func:`~..connector.wiring.create_transport` builds them.
TRANSPORTS = ("mooncake",)


class TransportSetupError(RuntimeError):
    """The transport failed to start or to register memory."""


class TransferError(RuntimeError):
    """A batched read failed and settled: its bytes are garbage, but no more will land."""


class UnsettledTransfer(TransferError):
    """A read failed with descriptors still in flight: their local memory may be written later.

    Mooncake cannot cancel a descriptor, so that memory must never be handed back for reuse.
    """


@dataclass(frozen=True)
class MemoryRange:
    addr: int
    length: int

    @property
    def end(self) -> int:
        return self.addr + self.length


def merge_ranges(ranges: Iterable[MemoryRange], *, touching: bool = True) -> list[MemoryRange]:
    """Merge overlapping ranges, and touching ones unless ``touching`` is False (vLLM's layers
    share one allocation; two allocations that happen to be adjacent are not one)."""
    merged: list[MemoryRange] = []
    for r in sorted(ranges, key=lambda r: r.addr):
        if merged and (r.addr <= merged[-1].end if touching else r.addr < merged[-1].end):
            last = merged[-1]
            merged[-1] = MemoryRange(last.addr, max(last.end, r.end) - last.addr)
        else:
            merged.append(r)
    return merged


def session_name(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@runtime_checkable
class Transport(Protocol):
    """One per worker process; shared by the receiver's threads (``read`` is thread-safe)."""

    #: How peers address this process (advertised in ``WorkerMetadata.transport_session``).
    session: str

    def register(self, ranges: Iterable[MemoryRange]) -> list[MemoryRange]:
        """Make memory readable by peers (and writable by reads); returns what was registered."""
        ...

    def unregister(self) -> list[MemoryRange]:
        """Drop every registration (vLLM's sleep mode); returns what was registered, to be
        registered again on wake-up. Peers' reads of that memory fail until then."""
        ...

    def read(
        self,
        peer_session: str,
        local_addrs: Sequence[int],
        remote_addrs: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        """Copy ``lengths[i]`` bytes at the peer's ``remote_addrs[i]`` to ``local_addrs[i]``.

        Returns once every byte landed; raises :class:`TransferError` once the read settled, or
        :class:`UnsettledTransfer` when it may still write local memory.
        """
        ...

    def close(self) -> None:
        """Unregister memory and stop; peers' reads of this process fail afterwards."""
        ...
