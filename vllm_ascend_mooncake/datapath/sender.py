"""Prefill side: hold each request's blocks until every decode rank that reads them is done.

This module is :class:`SendTracker`, the coordinator of the state (holds, leases, releases) under
one lock; its docstring's table lists the parts that state is in and which thread changes each:
the holds table and a held transfer's record, per decode TP (:mod:`.holds`), what is remembered
about transfers not held (:mod:`.remembered`) and the requests vLLM may free (:mod:`.finished`).
The side-channel service that answers decode workers and routers with this state is
:mod:`.prefill_service` (its table lists each message, the method answering it and its thread).

The topology tells this rank which decode ranks will read it for a request (possibly none: then the
request is finished at once). Decode ranks claim a lease before reading; a lease keeps a busy but
live decode from being cut off, and a request whose blocks were already released is refused, so a
late read never sees reused blocks. Read-done notifications may arrive before this worker learns
of the request (the decode side can be faster than this worker's next step), so early ones are
kept until the request shows up. A request nobody finishes reading is released when its deadline
(``release_timeout_s`` after it was held, or the end of the latest lease) passes. Each request is
reported finished exactly once.

Requests are tracked under their transfer id (vLLM's request id unless the proxy overlapped the
legs and chose one). A claim that arrives before prefill is done is held open by the side channel
and answered the moment prefill registers the request ("pending" if that takes longer than the
claim's wait); the grant carries the prompt's block ids, which is how a decode that was admitted
early learns them. A
prefill request that ends without a hand-off (aborted) is dropped, so its claims are refused at
once instead of waiting for a prefill that will never come.

A decode rank's lease belongs to the reader it was first granted to (the decode worker's
incarnation): nobody else can renew it or end it with a read-done notice. However often it is
renewed, a transfer is held at most ``MAX_HOLD_TIMEOUTS`` release timeouts in all. A router may
renew a hold nobody leased yet (``KeepHold``: its decode request waits in decode's queue, where
vLLM tells the connector nothing), within the same bound, and free one nobody leased
(``DropHold``: its client left, so the decode request was aborted and nobody will read it).

Decode instances of any TP size this prefill can pair with may read it: the readers a transfer
waits for are those of the configured ``decode.tp_size`` until the first claim or notice for it
names another size, and then those of that size; a later message naming a third size is
refused. Only a prefill that replicates KV heads (TP larger than the head count of any head
group) serves its configured decode TP alone: which replicas are read depends on the decode TP,
and the unread ones were released when the request was held.

Before vLLM's sleep mode discards the KV cache, the tracker is suspended: claims are refused,
holds nobody has a lease on are released at once, and :meth:`SendTracker.suspend` waits for the
leases already granted to end (read-done or expiry), so no decode reads memory that the wake-up
hands to other requests. Transfers released then stay refused after :meth:`SendTracker.resume`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..core.topology import TransferTopology
from ..log import get_logger
from .finished import FinishedRequests
from .holds import MAX_HOLD_TIMEOUTS, Hold, HoldTable, ReaderTopologies
from .prefill_service import MAX_CLAIM_PARK_S, PrefillSender
from .remembered import EarlyNotices, ReleasedIds
from .wire import ClaimReply

__all__ = ["MAX_CLAIM_PARK_S", "MAX_HOLD_TIMEOUTS", "PrefillSender", "SendTracker"]

logger = get_logger(__name__)

# Early read-done notifications and released ids are remembered this many timeouts long; a
# hostile peer can therefore grow them only at its own message rate, for a bounded time.
MEMORY_TIMEOUTS = 2
#: Read-done notices for requests this rank does not hold yet that are remembered at most: a
#: flood of notices for made-up ids cannot grow memory past this (the rest are ignored).
MAX_EARLY_NOTICES = 1 << 16
#: Why a transfer went, as a later claim or renewal is told (with the others at their release).
_DROPPED = "the router freed it: its client left, so the decode request was aborted"
_EXPIRED = "its release timeout passed before every decode rank had read it"
_ASLEEP = "released for vLLM's sleep mode"


class SleepMode:
    """Whether vLLM's sleep mode has the KV cache, and what a claim is told meanwhile."""

    def __init__(self) -> None:
        #: why claims are refused while vLLM's sleep mode has the KV cache (None: awake)
        self.reason: str | None = None

    @property
    def asleep(self) -> bool:
        return self.reason is not None

    def refusal(self) -> ClaimReply | None:
        """The answer to a claim or renewal while asleep; None when awake."""
        return None if self.reason is None else ClaimReply("refused", reason=self.reason)


class SendTracker:
    """Thread-safe bookkeeping of requests whose blocks this prefill rank holds.

    The coordinator of a few parts, each owning its data and the methods that change it:

    ========  ======================================  ==========================================
    part      code                                    owns
    ========  ======================================  ==========================================
    holds     :class:`~.holds.HoldTable`              each held transfer (:class:`~.holds.Hold`):
                                                      readers left, deadline and bound, leases
    readers   :class:`~.holds.ReaderTopologies`       which decode ranks read a transfer, per
                                                      decode TP
    early     :class:`~.remembered.EarlyNotices`      read-done notices for transfers not held
                                                      yet (a bounded number, a bounded time)
    released  :class:`~.remembered.ReleasedIds`       transfers released or dropped and why (a
                                                      bounded time): what a late claim is told
    finished  :class:`~.finished.FinishedRequests`    requests vLLM may free; releases by timeout
    sleep     :class:`SleepMode`                      why claims are refused while vLLM sleeps
    ========  ======================================  ==========================================

    Its methods, the thread each runs on, and the parts each changes:

    ======================  ==========================  ========================================
    method                  runs on                     changes
    ======================  ==========================  ========================================
    ``hold``, ``drop``      vLLM's worker thread        holds, early, released, finished
    ``take_finished``       vLLM's worker thread        holds, early and released (expiry),
                                                        finished
    ``wait_for_news``,      vLLM's worker thread        (reads holds and finished)
    ``take_expired_count``
    ``suspend``,            vLLM's worker thread (at    sleep, holds, finished, released
    ``resume``              sleep and wake-up)
    ``claim``               the side channel's thread   holds (leases, deadlines; one freed if
                                                        its reader's TP cannot be served),
                                                        released, finished
    ``keep``                the side channel's thread   holds (deadlines)
    ``drop_unread``         the side channel's thread   holds, early, released, finished
    ``dropped``             the side channel's thread   (reads released)
    ``read_done``           the side channel's thread   holds, early, finished, released
                            (the notice receiver)
    ``leased_blocks``       the side channel's pool     (reads holds)
    ======================  ==========================  ========================================

    Every part is guarded by one lock, ``_lock`` (``_news``, a condition on it, says a request
    may be finished or a lease ended). The parts do not lock; one lock is what keeps these
    decisions atomic across parts:

    * a read-done notice that finds no hold is remembered as early, and a hold takes the early
      notices as it starts: with a lock per part, a notice could land between the two and be
      lost (the hold would then wait out its deadline for a reader that was done);
    * a release ends the hold, remembers the id as released and reports the request finished
      in one step: a claim never sees a transfer neither held nor released (it would be told
      "pending" for blocks already freed), nor one both finished and held;
    * a claim checks sleep mode and then leases a hold; suspending releases the unleased holds
      and waits for the leased ones: a claim cannot lease a hold that sleep is releasing;
    * ``wait_for_news`` and ``suspend`` wait on ``_news`` with the holds and the finished
      requests in one view, so no wake-up between the check and the wait is missed.

    Each method takes the lock briefly (``suspend`` waits on the condition, which releases it).
    """

    def __init__(
        self,
        topology: TransferTopology,
        rank: int,
        release_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._topology = topology
        self._readers = ReaderTopologies(topology, rank)
        self._timeout = release_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._news = threading.Condition(self._lock)  # a request may be finished now
        remember_s = MEMORY_TIMEOUTS * release_timeout_s
        self._holds = HoldTable(release_timeout_s)
        self._early_notices = EarlyNotices(remember_s, MAX_EARLY_NOTICES)
        self._released_ids = ReleasedIds(remember_s)
        self._finished = FinishedRequests(self._news)
        self._sleep = SleepMode()
        #: Called (outside the lock) after a hold or a drop of a transfer (its id), or with None
        #: when every parked claim may be answered differently, so parked claims are answered.
        self.on_change: Callable[[str | None], None] | None = None

    @property
    def lease_s(self) -> float:
        return self._timeout

    @property
    def num_expired(self) -> int:
        """Releases by timeout in all."""
        return self._finished.num_expired

    @property
    def num_ignored_notices(self) -> int:
        """Read-done notices ignored because too many for transfers not held were remembered."""
        return self._early_notices.num_ignored

    # -- vLLM's worker thread ------------------------------------------------------------------

    def hold(
        self,
        transfer_id: str,
        *,
        request_id: str | None = None,
        block_ids: tuple[int, ...] = (),
        num_prompt_tokens: int = -1,
        group_sizes: tuple[int, ...] = (),
    ) -> None:
        """Start holding a request's blocks until its readers are done (or time runs out);
        ``group_sizes``: the KV cache groups' sizes in ``block_ids`` (none: one group)."""
        self._hold(transfer_id, request_id, tuple(block_ids), num_prompt_tokens, group_sizes)
        if self.on_change is not None:
            self.on_change(transfer_id)

    def _hold(
        self,
        transfer_id: str,
        request_id: str | None,
        block_ids: tuple[int, ...],
        num_prompt_tokens: int,
        group_sizes: tuple[int, ...] = (),
    ) -> None:
        request_id = transfer_id if request_id is None else request_id
        with self._lock:
            held = self._holds.get(transfer_id)
            owner = held.request_id if held is not None else None
            if transfer_id in self._released_ids:
                owner = self._released_ids.owner(transfer_id)
                if not owner:  # dropped before vLLM finished it: nobody will read it
                    why = self._released_ids.why(transfer_id) or ""
                    logger.debug("request %s is not held: %s", request_id, why)
                    self._release(transfer_id, request_id, why)
                    return
            if owner is not None:
                if owner != request_id:
                    # A reused transfer id: decode could not tell the two apart, so nobody
                    # reads this one; free it now rather than hold it until the deadline.
                    logger.warning(
                        "request %s reuses transfer id %s; its KV is not handed off",
                        request_id,
                        transfer_id,
                    )
                    self._finished.add(request_id)
                return
            if self._sleep.asleep:  # its bytes are about to be discarded
                self._release(transfer_id, request_id, _ASLEEP)
                return
            early, early_tp = self._early_notices.take(transfer_id)
            topology = self._readers.for_tp(early_tp) or self._topology
            readers = self._readers.readers(topology, transfer_id) - early
            if not readers:
                self._release(transfer_id, request_id, "every decode rank that reads it was done")
                return
            hold = Hold(
                request_id,
                readers,
                0.0,  # the table sets the deadline and bound
                block_ids,
                num_prompt_tokens,
                group_sizes=tuple(group_sizes),
                decode_tp=topology.decode_tp if early_tp >= 0 else None,
            )
            self._holds.start(transfer_id, hold, self._clock())

    def drop(self, transfer_id: str) -> None:
        """Prefill ended without a hand-off: refuse claims now (nothing is held to free)."""
        with self._lock:
            if transfer_id not in self._holds:
                self._early_notices.forget(transfer_id)
                why = "prefill failed or was aborted: it ended without a hand-off"
                self._released_ids.drop(transfer_id, why, self._clock())
        if self.on_change is not None:
            self.on_change(transfer_id)

    def take_finished(self) -> set[str]:
        """Requests whose blocks can be freed now; expires overdue ones first."""
        now = self._clock()
        with self._lock:
            for transfer_id, held in self._holds.take_overdue(now):
                self._release(transfer_id, held.request_id, _EXPIRED, expired=True)
                logger.warning(
                    "released KV blocks of request %s after its deadline: decode rank(s) %s "
                    "never finished reading",
                    held.request_id,
                    sorted(held.readers_left),
                )
            self._early_notices.expire(now)
            self._released_ids.expire(now)
            return self._finished.take()

    def wait_for_news(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` while blocks are held and none can be freed yet (or until
        the soonest deadline), so an engine that only holds blocks for readers does not spin."""
        with self._news:
            if not self._holds or self._finished:
                return
            soonest = self._holds.soonest_deadline()
            self._news.wait(max(0.0, min(timeout_s, soonest - self._clock())))

    def take_expired_count(self) -> int:
        """Releases by timeout since the last call (for stats)."""
        with self._lock:
            return self._finished.take_expired_count()

    @property
    def num_held(self) -> int:
        with self._lock:
            return len(self._holds)

    def is_held(self, transfer_id: str) -> bool:
        """Whether this rank holds ``transfer_id``'s blocks now."""
        with self._lock:
            return transfer_id in self._holds

    @property
    def num_remembered(self) -> int:
        """Ids remembered for transfers not held: early notices' and released ones (each
        forgotten ``MEMORY_TIMEOUTS`` release timeouts after it was added)."""
        with self._lock:
            return len(self._early_notices) + len(self._released_ids)

    def suspend(self, reason: str, timeout_s: float) -> None:
        """Stop serving before the KV cache is discarded: refuse claims with ``reason``, release
        every hold nobody has a lease on, and wait (up to ``timeout_s``, and never past a lease's
        end) for the granted leases to end; whatever is still held then is released too."""
        give_up = self._clock() + timeout_s
        with self._lock:
            self._sleep.reason = reason
            for transfer_id, held in self._holds.take(leased=False):
                self._release(transfer_id, held.request_id, _ASLEEP)
            while self._holds:
                now = self._clock()
                until = min(give_up, self._holds.latest_deadline())
                if now >= until:
                    break
                self._news.wait(until - now)
            for transfer_id, held in self._holds.take():
                self._release(transfer_id, held.request_id, _ASLEEP)
                logger.warning(
                    "released KV blocks of request %s for sleep while decode rank(s) %s still "
                    "held a lease",
                    held.request_id,
                    sorted(held.readers_left),
                )
        if self.on_change is not None:
            self.on_change(None)  # every parked claim is answered (refused) now

    def resume(self) -> None:
        """Serve claims again (after vLLM's wake-up)."""
        with self._lock:
            self._sleep.reason = None

    # -- the side channel's thread -------------------------------------------------------------

    def claim(
        self,
        transfer_id: str,
        decode_rank: int,
        num_prompt_tokens: int = -1,
        decode_tp: int = -1,
        reader: str = "",
    ) -> ClaimReply:
        """Grant (or renew) a read lease with the prompt's block ids, or say why not.

        A rank's lease is bound to the first ``reader`` it is granted to; another is refused.
        The first claim or notice naming a decode TP binds the transfer to it (module
        docstring); a reader of a TP this rank cannot serve is refused, and the hold is freed at
        once, since the readers this rank waits for will never all come."""
        now = self._clock()
        with self._lock:
            asleep = self._sleep.refusal()
            if asleep is not None:
                return asleep
            held = self._holds.get(transfer_id)
            if held is None:
                why = self._released_ids.why(transfer_id)
                if why is not None:
                    # the router freed it as its client left: decode's request is being aborted
                    status = "dropped" if why == _DROPPED else "refused"
                    return ClaimReply(status, reason=f"its blocks were already released: {why}")
                return ClaimReply("pending", reason="prefill has not finished it yet")
            if held.lessees.get(decode_rank, reader) != reader:
                return ClaimReply(
                    "refused", reason=f"decode rank {decode_rank}'s lease is held by another reader"
                )
            refusal = self._readers.bind(held, transfer_id, decode_tp)
            if refusal is not None:
                if held.decode_tp is None:  # nobody else reads it: free it now
                    self._holds.pop(transfer_id)
                    self._release(transfer_id, held.request_id, refusal)
                return ClaimReply("refused", reason=refusal)
            if decode_rank not in held.readers_left:
                return ClaimReply("refused", reason=f"decode rank {decode_rank} is not a reader")
            known = num_prompt_tokens >= 0 and held.num_prompt_tokens >= 0
            if known and num_prompt_tokens != held.num_prompt_tokens:
                return ClaimReply(
                    "refused",
                    reason=f"prefill computed {held.num_prompt_tokens} prompt tokens, the "
                    f"decode request has {num_prompt_tokens}: the prompts differ",
                )
            refusal = self._holds.renew(transfer_id, held, now)
            if refusal is not None:
                return ClaimReply("refused", reason=refusal)
            if reader:
                held.lessees[decode_rank] = reader
            return ClaimReply(
                "granted",
                lease_s=held.deadline - now,
                block_ids=list(held.block_ids),
                num_prompt_tokens=held.num_prompt_tokens,
                group_sizes=list(held.group_sizes),
            )

    def leased_blocks(
        self, transfer_id: str, decode_rank: int, reader: str
    ) -> tuple[int, ...] | str:
        """The blocks ``reader`` holds ``decode_rank``'s lease of ``transfer_id`` on, or why it
        holds none (what :mod:`.verify` lets a reader ask about)."""
        with self._lock:
            held = self._holds.get(transfer_id)
            if held is None:
                return f"transfer {transfer_id} is not held here"
            if not reader or held.lessees.get(decode_rank) != reader:
                return f"decode rank {decode_rank}'s lease is not this reader's"
            return held.block_ids

    def keep(self, transfer_id: str) -> ClaimReply:
        """Hold ``transfer_id`` another release timeout from now, never past its overall bound
        (:data:`MAX_HOLD_TIMEOUTS`): a router's renewal while its decode request is queued."""
        now = self._clock()
        with self._lock:
            asleep = self._sleep.refusal()
            if asleep is not None:
                return asleep
            held = self._holds.get(transfer_id)
            if held is None:
                why = self._released_ids.why(transfer_id)
                if why is not None:
                    return ClaimReply("refused", reason=f"it was read or released already: {why}")
                return ClaimReply("pending", reason="prefill does not hold it (yet)")
            refusal = self._holds.renew(transfer_id, held, now)
            if refusal is not None:
                return ClaimReply("refused", reason=refusal)
            return ClaimReply("held", lease_s=held.deadline - now)

    def dropped(self, transfer_id: str) -> bool:
        """Whether a router freed ``transfer_id`` because its client left (:meth:`drop_unread`)."""
        with self._lock:
            return self._released_ids.why(transfer_id) == _DROPPED

    def drop_unread(self, transfer_id: str) -> ClaimReply:
        """Free ``transfer_id`` now unless a decode rank leased it (a router's client left, so
        nobody will read it); a leased one waits for its reader's notice. A transfer not held
        yet (the router got prefill's answer before this worker's next step registered the
        hold) is remembered as dropped, so the hold is freed the moment it comes and a claim
        is told why, instead of the blocks waiting out the release timeout."""
        with self._lock:
            held = self._holds.get(transfer_id)
            if held is not None and held.lessees:
                return ClaimReply("held", reason="a decode rank holds a lease on it")
            if held is not None:
                self._holds.pop(transfer_id)
                self._release(transfer_id, held.request_id, _DROPPED)
                reason = f"freed: {_DROPPED}"
            elif transfer_id in self._released_ids:
                return ClaimReply("refused", reason="it is not held")
            else:
                self._early_notices.forget(transfer_id)
                self._released_ids.drop(transfer_id, _DROPPED, self._clock())
                reason = f"freed before it was held: {_DROPPED}"
        if self.on_change is not None:  # a claim parked for it is answered now
            self.on_change(transfer_id)
        return ClaimReply("refused", reason=reason)

    def read_done(
        self,
        transfer_id: str,
        decode_rank: int,
        success: bool,
        reader: str = "",
        decode_tp: int = -1,
    ) -> bool:
        """A decode rank is done with a transfer; False (and ignored) when that rank's lease was
        granted to another reader, or its decode TP is not the transfer's."""
        with self._lock:
            held = self._holds.get(transfer_id)
            if held is None:
                if transfer_id in self._released_ids:
                    return True
                return self._early_notices.note(transfer_id, decode_rank, decode_tp, self._clock())
            if held.lessees.get(decode_rank, reader) != reader:
                return False
            if self._readers.bind(held, transfer_id, decode_tp):
                return False
            held.readers_left.discard(decode_rank)
            if not success:
                held.failed_readers.add(decode_rank)
            if not held.readers_left:
                self._holds.pop(transfer_id)
                why = "every decode rank that reads it was done (read it, or gave up)"
                self._release(transfer_id, held.request_id, why)
            elif self._sleep.asleep:
                self._news.notify_all()  # suspend waits for leases to end
        return True

    # -- with the lock held --------------------------------------------------------------------

    def _release(self, transfer_id: str, request_id: str, why: str, expired: bool = False) -> None:
        """Report the request finished (caller holds the lock, and took its hold out) and refuse
        later claims, telling them ``why``."""
        self._finished.add(request_id, expired=expired)
        self._released_ids.release(transfer_id, request_id, why, self._clock())
