"""Decode side: read one prefill peer's batches of a pull, under that peer's read lease.

A read goes ahead only while the pull is still wanted and the peer's circuit is closed (a peer
whose read never settled lately fails at once, for a cool-down doubled per such read in a row);
a lease half spent in the lane's queue is renewed first. Batches are read in order, each one's
row copies out of staging overlapped with the next read (:mod:`.copy_overlap`), a batch retried
on a transient :class:`~.transport.TransferError` (never on an
:class:`~.transport.UnsettledTransfer`: a second read would race the bytes still landing), and
checked against prefill's checksum when ``verify_reads`` is on. Bytes that may postdate the
lease (the read outlasted it, less a safety margin) are refused.

A circuit is kept while it is open and for ``peer_cooldown_max_s`` after (so a probe that hangs
again doubles the cool-down), then dropped when another circuit opens: a frozen pod replaced
under a new address, whose transport session is never read again, leaves no circuit behind, and
the circuits kept are those opened lately, never one per frozen peer ever seen.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..core.plan import PeerPlan, TransferBatch
from ..core.relayout import LocalMemory
from ..log import get_logger
from .copy_overlap import CopyOverlap
from .failures import FailureKind, PullError
from .leases import LeasedPeer, Leases
from .orders import PullOrder
from .peers import PeerDirectory
from .side_channel import SideChannelClient, SideChannelError
from .transport import TransferError, Transport, UnsettledTransfer
from .verify import IntegrityError, check_digest, landed_checksum, verify_request

logger = get_logger(__name__)


@dataclass(frozen=True)
class ReadTerms:
    """How a peer is read (the receiver's options)."""

    read_retries: int  # extra attempts for a failed batch read (transient transport errors)
    retry_backoff_s: float  # wait before retry n is n times this
    lease_margin: float  # fraction of a lease kept as safety margin
    peer_cooldown_s: float  # a circuit's first cool-down
    peer_cooldown_max_s: float  # ... doubled per unsettled read in a row, up to this
    verify_reads: bool  # compare every batch's checksum with prefill's


@dataclass
class _Circuit:
    """A prefill transport whose reads left bytes in flight lately (a frozen data path)."""

    incarnation: str  # the peer process those reads went to
    strikes: int  # unsettled reads in a row (each one quarantined a pull)
    until: float  # reads fail at once until then (``time.monotonic``)


class PeerReader:
    """Reads peers' batches for one decode worker; owns every prefill transport's circuit."""

    def __init__(
        self,
        transport: Transport,
        memory: LocalMemory,
        copies: CopyOverlap,
        leases: Leases,
        peers: PeerDirectory,
        client: SideChannelClient,
        decode_rank: int,
        terms: ReadTerms,
        still_wanted: Callable[[PullOrder], None],
    ) -> None:
        """``still_wanted(pull)`` raises once the pull is not to go on (cancelled, asleep)."""
        self._transport = transport
        self._memory = memory
        self._copies = copies
        self._leases = leases
        self._peers = peers
        self._client = client
        self._rank = decode_rank
        self._terms = terms
        self._still_wanted = still_wanted
        self._lock = threading.Lock()
        #: prefill transport session -> its reads that never settled lately: they fail at once
        #: for a cool-down doubled per such read in a row (PEER_COOLDOWN_S .. _MAX_S)
        self._open_circuits: dict[str, _Circuit] = {}

    def read(self, pull: PullOrder, peer: LeasedPeer, peer_plan: PeerPlan) -> None:
        """Read every batch of ``peer_plan`` under a valid lease; raise if that fails. A pull
        cancelled or cut short by sleep mode while its reads waited in the peer's lane reads no
        further batch: sleep unregisters the memory they would land in."""
        self._still_wanted(pull)
        self._check_circuit(peer)
        if time.monotonic() - peer.claimed_at > peer.lease_s / 2:
            self._leases.claim(pull, peer).result()  # waited long in the queue: renew first

        def read(batch: TransferBatch) -> None:
            self._still_wanted(pull)
            self._read_batch(peer.transport_session, batch)
            if self._terms.verify_reads:
                self._verify_batch(pull, peer, batch)

        self._copies.read_all(peer_plan.batches, read)
        lease_end = peer.claimed_at + peer.lease_s * (1 - self._terms.lease_margin)
        if time.monotonic() > lease_end:
            raise PullError(
                FailureKind.LEASE_OUTLASTED,
                f"the read outlasted its {peer.lease_s:.0f} s lease: prefill may already have "
                f"reused the blocks",
            )
        with self._lock:
            self._open_circuits.pop(peer.transport_session, None)

    def failed(self, pull: PullOrder, peer: LeasedPeer, failure: PullError, exc: Exception) -> None:
        """A read from ``peer`` failed: log it, and unless the pull was merely stopped, look the
        peer up afresh next time (opening its circuit if the read never settled)."""
        if failure.kind in (FailureKind.CANCELLED, FailureKind.UNAVAILABLE_HERE):
            # cancelled or asleep before this read started: nothing wrong with the peer
            logger.info(
                "request %s: no read from prefill rank %d: %s", pull.request_id, peer.rank, exc
            )
            return
        if failure.kind is FailureKind.UNSETTLED:  # frozen: others would hang as long
            self._open_circuit(peer)
        self._peers.invalidate(peer.host, peer.port)
        logger.warning(
            "request %s: read from prefill rank %d (%s) failed (%s): %s",
            pull.request_id,
            peer.rank,
            peer.transport_session,
            failure.kind.value,
            exc,
        )

    def _open_circuit(self, peer: LeasedPeer) -> None:
        """A read from ``peer`` never settled: fail its reads at once for a cool-down, doubled
        for each such read in a row (the one read let through after a cool-down is the probe;
        if it hangs too, the next wait is twice as long), never past ``peer_cooldown_max_s``."""
        terms = self._terms
        now = time.monotonic()
        with self._lock:
            # circuits closed this long are forgotten: opening one is rare (an unsettled read)
            forgotten = [
                session
                for session, circuit in self._open_circuits.items()
                if circuit.until + terms.peer_cooldown_max_s < now
            ]
            for session in forgotten:
                del self._open_circuits[session]
            circuit = self._open_circuits.get(peer.transport_session)
            if circuit is None or circuit.incarnation != peer.incarnation:
                circuit = _Circuit(peer.incarnation, 0, 0.0)
                self._open_circuits[peer.transport_session] = circuit
            circuit.strikes += 1
            cooldown = terms.peer_cooldown_s * 2 ** min(circuit.strikes - 1, 32)
            circuit.until = now + min(cooldown, terms.peer_cooldown_max_s)

    def _check_circuit(self, peer: LeasedPeer) -> None:
        """Fail at once while ``peer``'s circuit is open (a read from it never settled); a new
        incarnation of the peer (restarted behind the same transport session) starts afresh."""
        session = peer.transport_session
        with self._lock:
            circuit = self._open_circuits.get(session)
            if circuit is not None and circuit.incarnation != peer.incarnation:
                del self._open_circuits[session]  # replaced: not the process that froze
                circuit = None
        left = circuit.until - time.monotonic() if circuit is not None else 0.0
        if left > 0:
            raise PullError(
                FailureKind.PEER_UNAVAILABLE,
                f"a read from prefill transport {session} never settled lately (a frozen peer?); "
                f"it is not read again for {left:.1f} s (its circuit is open)",
            )

    def _verify_batch(self, pull: PullOrder, peer: LeasedPeer, batch: TransferBatch) -> None:
        """Fail the pull unless the landed bytes are prefill's (before anything moves them)."""
        self._memory.fence()
        local = landed_checksum(self._memory, batch.local_addrs, batch.lengths)
        question = verify_request(
            pull.transfer_id,
            self._rank,
            self._peers.local.incarnation,
            batch.remote_addrs,
            batch.lengths,
        )
        try:
            reply = self._client.request(peer.host, peer.port, question)
        except SideChannelError as exc:
            raise IntegrityError(f"prefill rank {peer.rank} could not be asked: {exc}") from exc
        check_digest(reply, local, f"{len(batch)} range(s) read from prefill rank {peer.rank}")

    def _read_batch(self, transport_session: str, batch: TransferBatch) -> None:
        for attempt in range(self._terms.read_retries + 1):
            try:
                self._transport.read(
                    transport_session, batch.local_addrs, batch.remote_addrs, batch.lengths
                )
                return
            except UnsettledTransfer:
                raise  # bytes may still land: a second read into the same memory would race it
            except TransferError:
                if attempt == self._terms.read_retries:
                    raise
                time.sleep(self._terms.retry_backoff_s * (attempt + 1))
