"""The Mooncake TransferEngine wrapper: one engine per worker process, checked return codes.

Mooncake's Python binding returns bare integers; here every failure becomes a typed error that says
what was attempted, with which peer, and what to check. Reads use ``batch_transfer_sync_read``,
whose argument order is *local first, peer second*: ``(peer, local_addrs, remote_addrs, lengths)``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .deps import require_mooncake_engine
from .log import get_logger

logger = get_logger(__name__)

METADATA_P2P = "P2PHANDSHAKE"

# Protocol per device type, used when the configuration does not name one.
DEFAULT_PROTOCOLS = {"cpu": "tcp", "cuda": "rdma", "npu": "ascend"}

# Ascend's HCCL transport registers device memory in 2 MiB-aligned regions, at most 256 of them.
DEVICE_REGISTRATION_LIMITS = {"npu": (2 << 20, 256)}


class TransferEngineError(RuntimeError):
    """The Mooncake transfer engine failed to start or to register memory."""


class TransferError(RuntimeError):
    """A batched read failed; the bytes of the whole batch must be considered garbage."""


@dataclass(frozen=True)
class MemoryRange:
    addr: int
    length: int

    @property
    def end(self) -> int:
        return self.addr + self.length


def merge_ranges(ranges: Iterable[MemoryRange]) -> list[MemoryRange]:
    """Merge overlapping or touching ranges (vLLM's layers share one allocation)."""
    merged: list[MemoryRange] = []
    for r in sorted(ranges, key=lambda r: r.addr):
        if merged and r.addr <= merged[-1].end:
            last = merged[-1]
            merged[-1] = MemoryRange(last.addr, max(last.end, r.end) - last.addr)
        else:
            merged.append(r)
    return merged


def default_protocol(device_type: str) -> str:
    return DEFAULT_PROTOCOLS.get(device_type, "tcp")


def session_name(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class MooncakeEngine:
    """A started transfer engine with this process's KV memory registered."""

    def __init__(
        self, hostname: str, protocol: str, device_name: str = "", device_type: str = "cpu"
    ) -> None:
        mooncake = require_mooncake_engine()
        if protocol == "tcp":
            # Without it an engine on a host with RDMA NICs silently picks RDMA.
            os.environ.setdefault("MC_FORCE_TCP", "1")
        self._engine = mooncake.TransferEngine()
        rc = self._engine.initialize(hostname, METADATA_P2P, protocol, device_name)
        if rc != 0:
            raise TransferEngineError(
                f"Mooncake TransferEngine.initialize({hostname!r}, {METADATA_P2P!r}, {protocol!r}, "
                f"{device_name!r}) returned {rc}: check that the host address is local and, for "
                f"protocol {protocol!r}, that the transport is available (use 'tcp' without NICs)"
            )
        self.protocol = protocol
        self.device_type = device_type
        self.session = session_name(hostname, self._engine.get_rpc_port())
        self._registered: list[MemoryRange] = []
        self._lock = threading.Lock()
        logger.info("Mooncake transfer engine up: session %s, protocol %s", self.session, protocol)

    @property
    def registered(self) -> Sequence[MemoryRange]:
        return tuple(self._registered)

    def register(self, ranges: Iterable[MemoryRange]) -> list[MemoryRange]:
        """Register memory once per backing storage; returns what was registered."""
        merged = merge_ranges(ranges)
        alignment, max_regions = DEVICE_REGISTRATION_LIMITS.get(self.device_type, (1, None))
        if max_regions is not None and len(self._registered) + len(merged) > max_regions:
            raise TransferEngineError(
                f"{len(merged)} memory regions would exceed the {self.device_type} limit of "
                f"{max_regions} registrations per process"
            )
        for r in merged:
            if r.addr % alignment or r.length % alignment:
                raise TransferEngineError(
                    f"{self.device_type} memory registration needs {alignment}-byte alignment; "
                    f"region [{r.addr:#x}, +{r.length}) is not aligned"
                )
        rc = self._engine.batch_register_memory(
            [r.addr for r in merged], [r.length for r in merged]
        )
        if rc != 0:
            overlap = " (overlaps an existing registration)" if rc == -7 else ""
            raise TransferEngineError(
                f"Mooncake batch_register_memory of {len(merged)} region(s), "
                f"{sum(r.length for r in merged)} B, returned {rc}{overlap}"
            )
        with self._lock:
            self._registered.extend(merged)
        logger.debug("registered %d memory region(s) with Mooncake", len(merged))
        return merged

    def read(
        self,
        peer_session: str,
        local_addrs: Sequence[int],
        remote_addrs: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        """Copy ``lengths[i]`` bytes at peer ``remote_addrs[i]`` into local ``local_addrs[i]``."""
        if not len(lengths):
            return
        rc = self._engine.batch_transfer_sync_read(
            peer_session, list(local_addrs), list(remote_addrs), list(lengths)
        )
        if rc != 0:
            raise TransferError(
                f"Mooncake batch_transfer_sync_read from {peer_session} of {len(lengths)} "
                f"descriptor(s), {int(sum(lengths))} B, returned {rc}: the peer is unreachable, "
                f"restarted, or the addresses are no longer registered"
            )

    def close(self) -> None:
        with self._lock:
            ranges, self._registered = self._registered, []
        if ranges:
            rc = self._engine.batch_unregister_memory([r.addr for r in ranges])
            if rc != 0:
                logger.warning("Mooncake batch_unregister_memory returned %d", rc)
