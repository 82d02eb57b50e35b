"""Decode side: prefill workers' metadata, fetched once per peer, checked, and invalidated.

A peer is one prefill worker's side channel ``(host, port)``. Its metadata (regions, transfer
engine session, incarnation) is fetched on first use, checked for compatibility and decoded once
into a :class:`PrefillPeer`, which every request reading that peer then shares; it is dropped
when a read from that peer fails or when a request names a different engine or incarnation, so a
restarted prefill worker is re-fetched instead of read at stale addresses.

A peer nobody answers for fails fast: before its first metadata request a TCP connect tells a closed
port (nobody listens: a wrong address, a stopped prefill) from a live one in one round trip (an
unreachable host within one side-channel timeout), and a peer that was found closed or stayed silent
through every attempt is not asked again for ``cooldown_s``, so requests naming it fail at once
instead of each waiting out the timeouts. A port that accepts the connection but does not answer (a
frozen or busy worker) is asked again.

Nothing here grows with the prefill workers ever seen (a fleet whose pods are replaced under new
addresses sees unboundedly many): a peer's metadata not used by a pull for :data:`PEER_IDLE_S`
is dropped (its next pull fetches it again, one round trip), and a peer's cool-down entry goes
once it has passed. Both are kept in order of last use (of expiry), so dropping them looks at the
oldest entries only: a look-up costs O(1), whatever the number of peers.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from ..core.layout import Region
from ..core.state_layout import StateGroup
from ..core.topology import Topologies, TopologyError, TransferTopology
from ..log import get_logger
from .compat import IncompatiblePeerError, check_peer
from .side_channel import (
    BadAddress,
    ClientClosed,
    PeerRefused,
    PeerSilent,
    SideChannelClient,
    SideChannelError,
    check_address,
)
from .wire import WorkerMetadata

#: After a read from a prefill never settled (a frozen peer), decode fails further reads from
#: that prefill at once for this long (its circuit is open), then tries one again: the pulls
#: queued for it end at once instead of each costing the read's timeouts and a quarantine.
PEER_COOLDOWN_S = 10.0
#: Each further read in a row that never settles doubles the cool-down, up to this: a prefill
#: whose data path stays frozen while its side channel answers costs one quarantined read (its
#: decode blocks and a staging area, kept until restart) per this long, not per 10 s plus the
#: read's timeouts. A read that lands, or a new incarnation of the peer, ends the back-off.
PEER_COOLDOWN_MAX_S = 640.0

#: A prefill worker's metadata no pull used for this long is dropped: a pod replaced under a new
#: address leaves nothing behind, and a peer idle that long is fetched again on its next pull.
PEER_IDLE_S = 600.0

logger = get_logger(__name__)

# Pauses between metadata fetch attempts (the last value is unused: no retry after it).
FETCH_BACKOFF_S = (0.2, 1.0, 0.0)


@dataclass(frozen=True)
class PrefillPeer:
    """A prefill worker as decode reads it, decided once at handshake: its checked metadata, its
    regions decoded, and the topology pairing its instance's TP size with this decode's."""

    metadata: WorkerMetadata
    regions: tuple[Region, ...]
    topology: TransferTopology
    state_groups: tuple[StateGroup, ...] = ()

    @classmethod
    def of(cls, metadata: WorkerMetadata, topology: TransferTopology) -> PrefillPeer:
        return cls(
            metadata,
            tuple(metadata.to_regions()),
            topology,
            tuple(metadata.to_state_groups()),
        )

    @property
    def transport_session(self) -> str:
        return self.metadata.transport_session

    @property
    def incarnation(self) -> str:
        return self.metadata.incarnation

    @property
    def engine_id(self) -> str:
        return self.metadata.engine_id


class PeerDirectory:
    """Thread-safe cache of prefill workers' metadata."""

    def __init__(
        self,
        client: SideChannelClient,
        local: WorkerMetadata,
        topology: TransferTopology,
        cooldown_s: float = PEER_COOLDOWN_S,
        idle_s: float | None = None,
    ) -> None:
        """``idle_s``: how long an unused peer's metadata is kept (None: :data:`PEER_IDLE_S`)."""
        self._client = client
        self._cooldown_s = cooldown_s
        self._idle_s = PEER_IDLE_S if idle_s is None else idle_s
        #: (host, port) -> (until when requests naming it fail at once, why), soonest first
        self._down: OrderedDict[tuple[str, int], tuple[float, str]] = OrderedDict()
        self._local = local
        #: one topology per prefill TP size met (``topology`` is the configured one)
        self.topologies = Topologies(topology, local_is_decode=True)
        #: (host, port) -> (the peer, when a pull last used it), least recently used first
        self._cache: OrderedDict[tuple[str, int], tuple[PrefillPeer, float]] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def num_entries(self) -> int:
        """Peers whose metadata is kept, and peers cooling down (for tests and metrics)."""
        with self._lock:
            return len(self._cache) + len(self._down)

    def _cached(self, key: tuple[str, int]) -> PrefillPeer | None:
        """``key``'s peer, marked used now; drops peers idle past ``idle_s`` and cool-downs
        that ended (lock held; O(1) amortized: only the oldest entries are looked at)."""
        now = time.monotonic()
        self._forget_idle(now)
        entry = self._cache.get(key)
        if entry is None:
            return None
        self._cache[key] = (entry[0], now)
        self._cache.move_to_end(key)
        return entry[0]

    def _forget_idle(self, now: float) -> None:
        cache, down = self._cache, self._down
        while cache and next(iter(cache.values()))[1] < now - self._idle_s:
            cache.popitem(last=False)
        while down and next(iter(down.values()))[0] <= now:
            down.popitem(last=False)

    @property
    def local(self) -> WorkerMetadata:
        """This decode worker's own metadata (its incarnation names it as a reader)."""
        return self._local

    def get(
        self,
        host: str,
        port: int,
        engine_id: str | None = None,
        incarnation: str | None = None,
    ) -> PrefillPeer:
        """The peer, checked and decoded; re-fetched when stale. Raises on mismatch or
        incompatibility."""
        key = (host, port)
        with self._lock:
            cached = self._cached(key)
        if cached is not None and _matches(cached.metadata, engine_id, incarnation):
            return cached
        check_address(host, port)  # a malformed address is not asked (nor retried) at all
        self._fail_if_down(key)
        if cached is None:
            self._probe(key)
        reply = self._fetch_with_retries(host, port)
        if not isinstance(reply, WorkerMetadata):
            raise SideChannelError(f"{host}:{port} answered metadata with {type(reply).__name__}")
        if not _matches(reply, engine_id, incarnation):
            raise SideChannelError(
                f"{host}:{port} is engine {reply.engine_id} incarnation {reply.incarnation}, "
                f"but the request expects engine {engine_id} incarnation {incarnation}: the "
                f"prefill instance was restarted or the request names the wrong instance"
            )
        try:
            try:
                topology = self.topologies.with_remote_tp(reply.tp_size)
            except TopologyError as exc:
                raise IncompatiblePeerError(
                    f"prefill engine {reply.engine_id} rank {reply.tp_rank} runs TP "
                    f"{reply.tp_size}, which this decode instance cannot read: {exc}"
                ) from exc
            check_peer(self._local, reply, topology)
        except IncompatiblePeerError as exc:
            exc.incarnation = reply.incarnation  # it can still be told to release its hold
            raise
        peer = PrefillPeer.of(reply, topology)
        with self._lock:
            self._cache[key] = (peer, time.monotonic())
            self._cache.move_to_end(key)
        if cached is None:
            logger.info(
                "prefill engine %s rank %d at %s:%d paired: %s",
                reply.engine_id,
                reply.tp_rank,
                host,
                port,
                topology.describe(),
            )
        return peer

    def _fail_if_down(self, key: tuple[str, int]) -> None:
        with self._lock:
            self._forget_idle(time.monotonic())
            until, why = self._down.get(key, (0.0, ""))
        left = until - time.monotonic()
        if left > 0:
            raise PeerSilent(
                f"{key[0]}:{key[1]} is not asked for {left:.1f} s more: {why} (a prefill that "
                f"restarted there is asked again once that time is up)"
            )

    def _mark_down(self, key: tuple[str, int], why: str) -> None:
        with self._lock:
            self._down.pop(key, None)  # to the end: entries stay in order of expiry
            self._down[key] = (time.monotonic() + self._cooldown_s, why)

    def _probe(self, key: tuple[str, int]) -> None:
        """Fail at once where nobody listens: ZMQ would wait out the timeouts in silence."""
        host, port = key
        try:
            # as long as one side-channel exchange may take: a stalled host is not taken for
            # an unreachable one sooner than a metadata request would give up on it
            with socket.create_connection(key, timeout=self._client.timeout_s):
                return
        except ConnectionRefusedError:
            why = f"nobody listens on {host}:{port} (connection refused)"
        except OSError as exc:
            if exc.errno not in (errno.EHOSTUNREACH, errno.ENETUNREACH) and not isinstance(
                exc, TimeoutError
            ):
                return  # another local failure: let the metadata request report it
            why = f"{host}:{port} is unreachable ({exc or type(exc).__name__})"
        self._mark_down(key, why)
        raise PeerSilent(
            f"{why}: check the prefill instance's side_channel_port and VLLM_HOST_IP, and that "
            f"it is running"
        )

    def _fetch_with_retries(self, host: str, port: int):
        """A busy prefill worker (first request, CPU contention) may miss one exchange; a peer
        silent through every attempt is marked down for ``cooldown_s``; a refusal, a bad address
        and a closed client are not retried (asking again would get the same answer)."""
        for attempt, backoff_s in enumerate(FETCH_BACKOFF_S):
            try:
                return self._client.fetch_metadata(host, port)
            except (PeerRefused, BadAddress, ClientClosed):
                raise
            except SideChannelError as exc:
                if self._client.closed:  # closed while this exchange ran: the worker shuts down
                    raise ClientClosed(f"metadata fetch from {host}:{port}: {exc}") from exc
                if attempt == len(FETCH_BACKOFF_S) - 1:
                    if isinstance(exc, PeerSilent):
                        self._mark_down((host, port), f"it did not answer ({exc})")
                    raise
                logger.warning(
                    "metadata fetch from %s:%d failed (%s); retrying in %.1f s",
                    host,
                    port,
                    exc,
                    backoff_s,
                )
                time.sleep(backoff_s)
        raise AssertionError("unreachable")

    def invalidate(self, host: str, port: int) -> None:
        with self._lock:
            self._cache.pop((host, port), None)


def _matches(meta: WorkerMetadata, engine_id: str | None, incarnation: str | None) -> bool:
    return (engine_id is None or meta.engine_id == engine_id) and (
        incarnation is None or meta.incarnation == incarnation
    )
