"""Prefill side: the holds table, a held transfer's record, and which decode ranks read it.

A transfer this rank holds is a :class:`Hold`: its readers left, its deadline and bound, its
leases and the decode TP reading it. The transfers held, by transfer id, are a
:class:`HoldTable`, which starts each hold with its deadline and bound, renews it within that
bound and takes out the ones that end. Which decode ranks read a transfer depends on the decode
TP, bound by the first claim or notice that names one (:class:`ReaderTopologies`). None of them
locks: :class:`~.sender.SendTracker`'s lock guards them.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from ..core.topology import Topologies, TopologyError, TransferTopology, request_seed


@dataclass
class Hold:
    """A transfer whose blocks this rank holds until its readers are done."""

    request_id: str
    readers_left: set[int]
    deadline: float
    block_ids: tuple[int, ...] = ()
    num_prompt_tokens: int = -1
    #: the KV cache groups' sizes in ``block_ids`` (none: one group)
    group_sizes: tuple[int, ...] = ()
    failed_readers: set[int] = field(default_factory=set)
    hold_ends: float = float("inf")  # the latest deadline any lease may extend to
    #: decode rank -> the reader (decode worker incarnation) its lease was first granted to
    lessees: dict[int, str] = field(default_factory=dict)
    #: the TP size of the decode instance reading it, once a claim or notice named it
    decode_tp: int | None = None
    #: when it was held, in the table's order (set by :meth:`HoldTable.start`)
    held_order: int = field(default=0, compare=False)


#: However often a transfer is claimed, its blocks are held at most this many release timeouts
#: in all: a reader that keeps renewing its lease cannot pin prefill memory for ever.
MAX_HOLD_TIMEOUTS = 4


class HoldTable:
    """The transfers this rank holds, by transfer id (guarded by the tracker's lock).

    Each is held one release timeout (``timeout_s``) from when it was held or last renewed, and
    never past :data:`MAX_HOLD_TIMEOUTS` release timeouts in all.

    Every engine step takes out the overdue holds and every idle step asks for the soonest
    deadline, so both cost what ends, not what is held: deadlines sit in a heap (a deadline only
    ever grows, so a renewal pushes the new one and the old entry goes stale; a released hold's
    entry goes stale too). Stale entries are dropped as they reach the top, and the heap is
    rebuilt whenever they outnumber the holds, so it stays within twice the holds (plus
    :data:`_HEAP_SLACK`)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._holds: dict[str, Hold] = {}
        #: (deadline, held order, transfer id, hold): one per start or renewal, some stale
        self._deadlines: list[tuple[float, int, str, Hold]] = []
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._holds)

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._holds

    def get(self, transfer_id: str) -> Hold | None:
        return self._holds.get(transfer_id)

    def start(self, transfer_id: str, hold: Hold, now: float) -> None:
        """Hold ``transfer_id`` from ``now``: one release timeout, at most the bound in all."""
        hold.deadline = now + self.timeout_s
        hold.hold_ends = now + MAX_HOLD_TIMEOUTS * self.timeout_s
        hold.held_order = next(self._order)
        self._holds[transfer_id] = hold
        self._push(transfer_id, hold)

    def renew(self, transfer_id: str, held: Hold, now: float) -> str | None:
        """Hold ``held`` (``transfer_id``'s) another release timeout from ``now``, never past
        its bound; the reason to refuse when its bound has passed."""
        before = held.deadline
        held.deadline = min(max(held.deadline, now + self.timeout_s), held.hold_ends)
        if held.deadline != before and self._holds.get(transfer_id) is held:
            self._push(transfer_id, held)
        if held.deadline <= now:
            return (
                f"held for {MAX_HOLD_TIMEOUTS} release timeouts already, the longest any "
                f"transfer is held"
            )
        return None

    def pop(self, transfer_id: str) -> Hold:
        return self._holds.pop(transfer_id)

    def take(self, leased: bool | None = None) -> list[tuple[str, Hold]]:
        """Take out every hold (only those somebody has a lease on, or nobody has, if
        ``leased`` says so), in the order they were held."""
        taken = [
            (transfer_id, held)
            for transfer_id, held in self._holds.items()
            if leased is None or bool(held.lessees) == leased
        ]
        for transfer_id, _ in taken:
            del self._holds[transfer_id]
        return taken

    def take_overdue(self, now: float) -> list[tuple[str, Hold]]:
        """Take out the holds whose deadline has passed, in the order they were held."""
        taken = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, _, transfer_id, held = heapq.heappop(heap)
            if self._holds.get(transfer_id) is held and held.deadline <= now:
                del self._holds[transfer_id]
                taken.append((transfer_id, held))
        taken.sort(key=lambda item: item[1].held_order)
        return taken

    def soonest_deadline(self) -> float:
        """The soonest deadline of a hold (infinity when none is held)."""
        heap = self._deadlines
        while heap and not self._is_live(heap[0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else float("inf")

    def latest_deadline(self) -> float:
        return max(held.deadline for held in self._holds.values())

    def _push(self, transfer_id: str, hold: Hold) -> None:
        heap = self._deadlines
        if len(heap) > 2 * len(self._holds) + _HEAP_SLACK:
            heap[:] = [
                (h.deadline, h.held_order, t, h) for t, h in self._holds.items() if h is not hold
            ]
            heapq.heapify(heap)
        heapq.heappush(heap, (hold.deadline, hold.held_order, transfer_id, hold))

    def _is_live(self, entry: tuple[float, int, str, Hold]) -> bool:
        deadline, _, transfer_id, hold = entry
        return self._holds.get(transfer_id) is hold and hold.deadline == deadline


#: Stale deadline entries the heap may keep beyond twice the holds before it is rebuilt.
_HEAP_SLACK = 64


class ReaderTopologies:
    """Which decode ranks read this prefill rank's transfers, per decode TP size."""

    def __init__(self, topology: TransferTopology, rank: int) -> None:
        self.configured = topology
        self._topologies = Topologies(topology, local_is_decode=False)
        self._rank = rank

    def readers(self, topology: TransferTopology, transfer_id: str) -> set[int]:
        return set(topology.readers_of(self._rank, request_seed(transfer_id)))

    def for_tp(self, decode_tp: int) -> TransferTopology | None:
        """The topology for readers of TP ``decode_tp`` (< 0: the configured one); None when
        this rank cannot serve that size."""
        configured = self.configured
        if decode_tp < 0 or decode_tp == configured.decode_tp:
            return configured
        if configured.replicates_on_prefill:
            return None  # replicated heads: see :mod:`.sender`'s docstring
        try:
            return self._topologies.with_remote_tp(decode_tp)
        except TopologyError:
            return None

    def bind(self, held: Hold, transfer_id: str, decode_tp: int) -> str | None:
        """Bind ``held`` to the decode TP its readers run; the reason to refuse when that
        cannot be. The readers switch to that size's before any spoke."""
        configured = self.configured
        if decode_tp < 0:
            decode_tp = configured.decode_tp
        if held.decode_tp is not None:
            if held.decode_tp == decode_tp:
                return None
            return (
                f"a decode instance of TP {held.decode_tp} reads this transfer already, this "
                f"reader runs TP {decode_tp}"
            )
        topology = self.for_tp(decode_tp)
        if topology is None:
            replicated = configured.replicates_on_prefill
            heads = " and ".join(str(g.heads) for g in configured.head_groups)
            why = (
                f"this prefill instance replicates its {heads} KV heads over TP "
                f"{configured.prefill_tp} and serves only decode TP "
                f"{configured.decode_tp} (kv_connector_extra_config's decode.tp_size)"
                if replicated
                else f"prefill TP {configured.prefill_tp} cannot pair with it"
            )
            return f"the decode instance runs TP {decode_tp}: {why}"
        if topology is not configured:
            held.readers_left = self.readers(topology, transfer_id) - set(held.lessees)
        held.decode_tp = decode_tp
        return None
