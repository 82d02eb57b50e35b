"""The Mooncake transport: one transfer engine per worker process, checked return codes.

Mooncake's Python binding returns bare integers; here every failure becomes a typed error that says
what was attempted, with which peer, and what to check. Read calls take *local first, peer second*:
``(peer, local_addrs, remote_addrs, lengths)``.

How a read waits matters on small hosts. ``batch_transfer_sync_read`` waits by spinning on the batch
status without ever sleeping: one busy core per read in flight, taken from the TCP threads that
move the bytes (a TP 2 decode's receiver thread on 2 cores had burned 75 s of CPU). The ``poll``
wait submits each descriptor as its own asynchronous batch and checks them with
``transfer_check_status`` (which, unlike the batch calls, returns at once), sleeping between
rounds; ``benchmarks/micro/bench_read_wait.py`` measures both. It is the default over TCP; other
transports keep Mooncake's own ``sync`` wait, which is what they were measured with upstream.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..deps import require_mooncake_engine
from ..log import get_logger
from ..names import CONNECTOR_NAME, VLLM_ASCEND, VLLM_MOONCAKE
from ..options import Alias, Bound, Computed, ConnectorConfigError, by_protocol, one_of, option
from .transport import (
    MemoryRange,
    TransferError,
    TransportSetupError,
    UnsettledTransfer,
    merge_ranges,
    session_name,
)

logger = get_logger(__name__)

METADATA_P2P = "P2PHANDSHAKE"

#: Mooncake transports accepted as ``protocol``.
PROTOCOLS = ("tcp", "rdma", "ascend", "nvlink", "efa")
#: ``protocol`` per device type when the configuration does not name one ...
DEFAULT_PROTOCOLS = {"cpu": "tcp", "cuda": "rdma", "npu": "ascend"}
#: ... and for any other device type.
FALLBACK_PROTOCOL = "tcp"
#: How reads wait for completion (``read_wait``): see the module's docstring.
READ_WAITS = ("poll", "sync")


def default_protocol(device_type: str) -> str:
    """``protocol`` when the configuration does not name one."""
    return DEFAULT_PROTOCOLS.get(device_type, FALLBACK_PROTOCOL)


def default_read_wait(protocol: str) -> str:
    """``read_wait`` when the configuration does not say: ``poll`` over tcp, else ``sync``."""
    return "poll" if protocol == "tcp" else "sync"


def _string(where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConnectorConfigError(f"{where} must be str, got {value!r}")
    return value


def _ascend_direct_protocol(where: str, value: Any) -> str:
    """vllm-ascend's ``use_ascend_direct``: ``true`` gave Mooncake the plain host address (the
    form of its ADXL/HIXL transport, with protocol ``ascend``), which is what this connector
    always does; ``false`` chose the HCCL form ``host:0:npu_<id>``, which it cannot do."""
    if value is True:
        return "ascend"
    if value is False:
        raise ConnectorConfigError(
            f"{where} false chose vllm-ascend's legacy HCCL transport address "
            f"(host:0:npu_<id>), removed from vllm-ascend in December 2025 (#4547); "
            f"{CONNECTOR_NAME} has no equivalent: it always gives Mooncake the plain host "
            f"address, as Mooncake's ADXL/HIXL transport (built with USE_ASCEND_DIRECT) needs. "
            f"Remove the key (protocol 'ascend' is the default on NPUs)"
        )
    raise ConnectorConfigError(f"{where} must be bool, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class MooncakeOptions:
    """The keys :class:`MooncakeTransport` is started with."""

    protocol: str = option(
        computed=Computed(
            ", ".join(
                f"`{protocol}` on {device.upper()}"
                for device, protocol in DEFAULT_PROTOCOLS.items()
            )
            + f", else `{FALLBACK_PROTOCOL}`"
        ),
        summary="Mooncake transport.",
        details="With `tcp`, `MC_FORCE_TCP=1` is set unless you set it.",
        bound=one_of(
            PROTOCOLS,
            "{where} {value!r} is not a Mooncake transport (" + ", ".join(PROTOCOLS) + ")",
        ),
        aliases=(
            Alias("mooncake_protocol", VLLM_MOONCAKE, _string),
            Alias("use_ascend_direct", VLLM_ASCEND, _ascend_direct_protocol),
        ),
    )
    device_name: str = option(
        "", summary="Mooncake NIC/device list (`mlx5_0,mlx5_1`); empty = auto."
    )
    read_wait: str = option(
        computed=by_protocol(default_read_wait),
        summary=(
            "how a read waits for Mooncake: `poll` submits one asynchronous batch per descriptor "
            "and sleeps between status checks; `sync` is Mooncake's `batch_transfer_sync_read`, "
            "which keeps a core spinning per read in flight (see docs/deploy-single-host.md, small "
            "CPU hosts)."
        ),
        bound=one_of(READ_WAITS),
        as_default=Bound('""', lambda value: value == "", '`""`'),
    )


# Mooncake's own sync-call timeout: MC_TRANSFER_TIMEOUT seconds (default 30, at least 5) plus one
# nanosecond per byte. The polled wait keeps the same budget.
def transfer_timeout_s() -> float:
    try:
        seconds = float(os.environ.get("MC_TRANSFER_TIMEOUT", "30"))
    except ValueError:
        seconds = 30.0
    return max(seconds, 5.0)


#: The device address alignment Mooncake's Ascend docs ask for under HCCS
#: (``docs/source/design/transfer-engine/ascend_direct_transport.md``).
NPU_ADDRESS_ALIGNMENT = 2 << 20

#: What ``batch_transfer_async_read`` returns when it fails: 0 since Mooncake 0.3.12 (#2433);
#: 0.3.11.post1 (vllm-ascend's images) returned the int -1 as an unsigned batch id.
BATCH_ID_FAILED = frozenset({0, (1 << 64) - 1})

# Polled wait: first sleep, and the longest sleep between two rounds of status checks.
POLL_FIRST_SLEEP_S = 50e-6
POLL_MAX_SLEEP_S = 0.5e-3
# A read still in flight at its timeout is waited for this many more timeouts before its memory
# is given up as quarantined (the transport normally fails or completes it well before).
SETTLE_TIMEOUTS = 3

# Registration rules, as read in Mooncake's sources (v0.3.11.post1, the vllm-ascend images', and
# v0.3.12.post1): ``TransferEngineImpl::registerLocalMemoryBatch`` refuses overlaps (-7) and, in
# newer releases, empty ranges; the ADXL transport (``ascend_direct_transport.cpp``
# ``registerLocalMemory``/``registerMem``, what the PyPI NPU wheels build for protocol "ascend")
# checks only that the address is ACL memory; the HCCL transport (source builds) only counts
# registrations, up to ASCEND_TRANSPORT_MAX_REG_MEMORY_NUM (8192). No length or alignment rule
# is enforced; Mooncake's docs ask for 2 MiB-aligned device addresses under HCCS, which
# vllm-ascend's caches are (``_allocate_int8_cache_tensor``) and :func:`.registration.
# kv_memory_ranges` keeps (it registers the views, not their unaligned storage). So nothing is
# refused here that Mooncake would accept; an address off 2 MiB is only warned about.


class MooncakeTransport:
    """A started Mooncake transfer engine with this process's KV memory registered
    (a :class:`~.transport.Transport`)."""

    def __init__(
        self,
        hostname: str,
        protocol: str,
        device_name: str = "",
        device_type: str = "cpu",
        read_wait: str | None = None,
    ) -> None:
        read_wait = read_wait or default_read_wait(protocol)
        if read_wait not in READ_WAITS:
            raise TransportSetupError(f"read_wait must be one of {READ_WAITS}, not {read_wait!r}")
        mooncake = require_mooncake_engine()
        if protocol == "tcp":
            # Without it an engine on a host with RDMA NICs silently picks RDMA.
            os.environ.setdefault("MC_FORCE_TCP", "1")
        self._engine = mooncake.TransferEngine()
        rc = self._engine.initialize(hostname, METADATA_P2P, protocol, device_name)
        if rc != 0:
            raise TransportSetupError(
                f"Mooncake TransferEngine.initialize({hostname!r}, {METADATA_P2P!r}, {protocol!r}, "
                f"{device_name!r}) returned {rc}: check that the host address is local and, for "
                f"protocol {protocol!r}, that the transport is available (use 'tcp' without NICs)"
            )
        self.protocol = protocol
        self.device_type = device_type
        self.read_wait = read_wait
        self._timeout_s = transfer_timeout_s()  # Mooncake reads MC_TRANSFER_TIMEOUT once, too
        self.session = session_name(hostname, self._engine.get_rpc_port())
        self._registered: list[MemoryRange] = []
        self._lock = threading.Lock()
        logger.info(
            "Mooncake transfer engine up: session %s, protocol %s, reads wait by %s",
            self.session,
            protocol,
            read_wait,
        )

    @property
    def registered(self) -> Sequence[MemoryRange]:
        return tuple(self._registered)

    def register(self, ranges: Iterable[MemoryRange]) -> list[MemoryRange]:
        """Register memory once per backing storage; returns what was registered."""
        merged = merge_ranges(ranges, touching=False)  # adjacent allocations stay apart
        if self.device_type == "npu":
            unaligned = [r for r in merged if r.addr % NPU_ADDRESS_ALIGNMENT]
            if unaligned:
                logger.warning(
                    "%d of %d npu memory range(s) to register start off a 2 MiB boundary (the "
                    "first at %#x); Mooncake's docs ask for 2 MiB-aligned device addresses "
                    "under HCCS, and vllm-ascend aligns its KV caches so",
                    len(unaligned),
                    len(merged),
                    unaligned[0].addr,
                )
        rc = self._engine.batch_register_memory(
            [r.addr for r in merged], [r.length for r in merged]
        )
        if rc != 0:
            overlap = " (overlaps an existing registration)" if rc == -7 else ""
            raise TransportSetupError(
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
        wait = self._read_sync if self.read_wait == "sync" else self._read_polled
        wait(peer_session, list(local_addrs), list(remote_addrs), list(lengths))

    def _read_sync(
        self, peer: str, local: list[int], remote: list[int], lengths: list[int]
    ) -> None:
        rc = self._engine.batch_transfer_sync_read(peer, local, remote, lengths)
        if rc != 0:
            raise TransferError(
                f"Mooncake batch_transfer_sync_read from {peer} of {len(lengths)} "
                f"descriptor(s), {int(sum(lengths))} B, returned {rc}: the peer is unreachable, "
                f"restarted, or the addresses are no longer registered"
            )

    def _read_polled(
        self, peer: str, local: list[int], remote: list[int], lengths: list[int]
    ) -> None:
        """One asynchronous batch per descriptor, checked without spinning.

        The call returns only once every submitted descriptor has *settled* (completed, or failed
        and finalized by the transport), so no byte lands in local memory after it: the caller hands
        failed blocks back to vLLM, which recomputes into them or gives them to another request.
        A failed descriptor therefore never ends the wait early, and a read that outlives the
        timeout is waited for once more (``SETTLE_TIMEOUTS`` timeouts) before it is reported
        failed. Mooncake cannot cancel a descriptor: one still in flight after that raises
        :class:`UnsettledTransfer`, and its local memory must never be reused.
        """
        total = int(sum(lengths))
        budget_s = self._timeout_s + total * 1e-9
        pending: list[int] = []
        rejected = 0
        for local_addr, remote_addr, length in zip(local, remote, lengths, strict=True):
            batch_id = self._engine.batch_transfer_async_read(
                peer, [local_addr], [remote_addr], [length]
            )
            if batch_id in BATCH_ID_FAILED:
                rejected += 1
                break  # the peer is unusable; wait out what is already in flight
            pending.append(batch_id)
        not_submitted = len(lengths) - len(pending) - rejected
        what = f"Mooncake read from {peer} of {len(lengths)} descriptor(s), {total} B"
        pending, failed = self._wait_settled(pending, time.monotonic() + budget_s)
        if pending:
            logger.warning(
                "%s: %d descriptor(s) still in flight after %.0f s (MC_TRANSFER_TIMEOUT); waiting "
                "for the transport to settle them before the blocks are handed back",
                what,
                len(pending),
                budget_s,
            )
            settle_by = time.monotonic() + SETTLE_TIMEOUTS * budget_s
            pending, late_failed = self._wait_settled(pending, settle_by)
            if pending:
                raise UnsettledTransfer(
                    f"{what}: {len(pending)} descriptor(s) never settled in "
                    f"{(SETTLE_TIMEOUTS + 1) * budget_s:.0f} s; their local memory may still be "
                    f"written and is quarantined"
                )
            raise TransferError(
                f"{what} did not finish within {budget_s:.0f} s (MC_TRANSFER_TIMEOUT); the peer is "
                f"stalled or overloaded ({failed + late_failed} descriptor(s) failed)"
            )
        if failed or rejected:
            raise TransferError(
                f"{what}: {failed} failed"
                + (f", {rejected} refused at submission" if rejected else "")
                + (f", {not_submitted} not submitted" if not_submitted else "")
                + ": the peer is unreachable, restarted, or the addresses are no longer registered"
            )

    def _wait_settled(self, pending: list[int], deadline: float) -> tuple[list[int], int]:
        """Poll batches until each settles or ``deadline`` passes: (still in flight, failed)."""
        failed = 0
        sleep_s = POLL_FIRST_SLEEP_S
        while pending:
            still = []
            for batch_id in pending:
                status = self._engine.transfer_check_status(batch_id)
                if status in (0, -2):
                    # -2 is Mooncake's slice-age "timeout": the batch is neither finished nor
                    # freed and its bytes may still land, so it is still in flight. Only 1
                    # (done) and -1 (failed, finalized by the transport) are terminal.
                    still.append(batch_id)
                elif status < 0:
                    failed += 1
            pending = still
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(sleep_s)
            sleep_s = min(sleep_s * 2, POLL_MAX_SLEEP_S)
        return pending, failed

    def unregister(self) -> list[MemoryRange]:
        with self._lock:
            ranges, self._registered = self._registered, []
        if ranges:
            rc = self._engine.batch_unregister_memory([r.addr for r in ranges])
            if rc != 0:
                logger.warning("Mooncake batch_unregister_memory returned %d", rc)
        return ranges

    def close(self) -> None:
        self.unregister()
