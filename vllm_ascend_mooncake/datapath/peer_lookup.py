"""Decode side: find the prefill ranks a pull reads, and count the pulls reading each one.

The request's topology (its prefill TP, as its params say) names the ranks;
:class:`~.peers.PeerDirectory` fetches each rank's metadata on first contact and checks it. Two
pulls of one transfer (a router retrying the decode leg) may read the same ranks: each rank's
read-done notice is sent by the last of them only (:meth:`PeerLookup.last_reader`), so none
reads blocks already released.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..core.layout import Region
from ..core.plan import RequestPulls
from ..core.state_layout import StateGroup
from ..core.topology import TransferTopology, request_seed
from .compat import IncompatiblePeerError
from .leases import LeasedPeer, check_same_tp
from .orders import PullOrder
from .peers import PeerDirectory


@dataclass(frozen=True)
class Lookup:
    """What a request reads: its topology, seed, each region's head pulls, and each prefill
    rank's regions."""

    topology: TransferTopology
    seed: int
    pulls: RequestPulls
    remote_tables: dict[int, Sequence[Region]]
    #: each prefill rank's state groups (hybrid linear-attention models; empty otherwise)
    remote_states: dict[int, Sequence[StateGroup]] = field(default_factory=dict)


class PeerLookup:
    """Looks up the prefill ranks of one decode rank's pulls."""

    def __init__(
        self, peers: PeerDirectory, decode_rank: int, local_regions: Sequence[Region]
    ) -> None:
        self._peers = peers
        self._rank = decode_rank
        self._local_regions = local_regions
        self._lock = threading.Lock()
        # (transfer id, prefill host, port) -> pulls on this worker that looked the peer up for
        # it and have not sent their read-done notice: only the last one sends it, so a second
        # pull of one transfer (a router retrying the decode leg) never reads released blocks.
        self._readers: dict[tuple[str, str, int], int] = {}

    def look_up(self, pull: PullOrder, peers: dict[int, LeasedPeer]) -> Lookup:
        """The request's topology and the prefill ranks it reads (into ``peers``, so that a
        failure later releases exactly those)."""
        seed = request_seed(pull.transfer_id)
        topology = self._topology_of(pull)
        pulls = RequestPulls.of(topology, self._rank, seed, self._local_regions)
        remote_tables: dict[int, Sequence[Region]] = {}
        remote_states: dict[int, Sequence[StateGroup]] = {}
        # An early pull is bound by its unique transfer id; the engine id it carries may predate
        # a prefill restart (the proxy learns the new one from the answer that follows).
        engine_id = None if pull.early else pull.remote_engine_id
        refused: IncompatiblePeerError | None = None
        for rank in pulls.prefill_ranks:
            port = pull.remote_port + rank
            try:
                prefill = self._peers.get(pull.remote_host, port, engine_id)
            except IncompatiblePeerError as exc:
                # every refused rank is still told to release its hold (by the receiver's
                # give-up), not left to its release timeout
                refused = refused or exc
                if exc.incarnation:
                    peers[rank] = LeasedPeer(rank, pull.remote_host, port, "", exc.incarnation)
                continue
            check_same_tp(prefill, topology)
            remote_tables[rank] = prefill.regions
            remote_states[rank] = prefill.state_groups
            peers[rank] = LeasedPeer(
                rank, pull.remote_host, port, prefill.transport_session, prefill.incarnation
            )
            with self._lock:
                key = (pull.transfer_id, pull.remote_host, port)
                self._readers[key] = self._readers.get(key, 0) + 1
        if refused is not None:
            raise refused
        return Lookup(topology, seed, pulls, remote_tables, remote_states)

    def last_reader(self, transfer_id: str, peer: LeasedPeer) -> bool:
        """One pull of ``transfer_id`` is done with ``peer``: whether it was the last pull on
        this worker reading it (and so the one to send the read-done notice)."""
        key = (transfer_id, peer.host, peer.port)
        with self._lock:
            left = self._readers.pop(key, 1) - 1
            if left > 0:  # another pull of this transfer still reads this peer: it notifies
                self._readers[key] = left
                return False
        return True

    def _topology_of(self, pull: PullOrder) -> TransferTopology:
        """The topology pairing the request's prefill instance (its TP size, as its params say)
        with this decode instance; the configured one when the pull does not say."""
        topologies = self._peers.topologies
        if pull.remote_tp_size is None:
            return topologies.configured
        return topologies.with_remote_tp(pull.remote_tp_size)
