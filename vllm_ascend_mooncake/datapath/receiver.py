"""Decode side: pull each request's KV from the prefill ranks the topology names, then fix it up.

A pull is a short pipeline; no stage lets one peer hold up the others. Its stages in time, the
thread each runs on and the state each owns:

========  ========================  ============================  ==================================
stage     code                      runs on                       owns
========  ========================  ============================  ==================================
admit     ``submit``                vLLM's worker thread          ``_reports``: the pull in flight
dispatch  ``_dispatch``             ``vam-recv-dispatch`` (one)   ``_queue``: submitted pulls
look up   ``_prepare`` →            the prefill instance's        ``_lookup``: pulls per rank;
          ``PeerLookup.look_up``    lookup lane, ``vam-prepare``  ``_peers``: each rank's metadata
claim     ``Leases.first_claim``    the claims thread (one)       ``_claims``: claims not answered
plan      ``_granted`` →            ``vam-prepare``, once the     a staging area; the ``_InFlight``
          ``_plan_and_read``        last claim is answered
read      ``_read_from`` →          the peer's lane (``_lanes``)  ``_reader``: each peer's circuit;
          ``PeerReader.read``       on ``vam-recv``; row copies   ``_InFlight``: reads left, failure
                                    on ``vam-copy``
notify    ``_notify``               ``vam-notify-<port>``         ``_notifier``: notices per peer
fix up    ``_complete``             the pull's last read          the staging area's release
report    ``PullReports.finish``    the last read, or the         ``_reports``: done, failed, stats
                                    stage that gave up
========  ========================  ============================  ==================================

A failure in look up, claim or plan gives the pull up (``_give_up``): every rank looked up is
told to release its hold, and the pull is reported failed. Reads run with one FIFO lane per
prefill peer: different peers in parallel, one peer strictly in order (a lane, a look-up lane
too, exists only while it has work: :mod:`.lanes`). All layers of a request-peer pair go out as
one batched read, split at the descriptor cap. The fix-up runs only
once every pull of the request has landed; a partially read request is never fixed up or reported
loaded. Each peer read gets a read-done notification (success or not) so the prefill side can free
its blocks.

What is reported to vLLM is what vLLM waits for, and only once no byte can land any more: a
release-only pull (no local blocks) is never reported; a failed request is reported only after
every one of its reads has settled. A read whose descriptors are still in flight after the
transport's settle window is never reported (:class:`~.transport.UnsettledTransfer`): vLLM then
keeps its blocks allocated, so late bytes can never reach a block that was recomputed or reused.

A pull admitted before prefill finished (overlapped legs) has no remote block ids yet: its claims
wait for up to ``prefill_wait_s`` (prefill holds each claim open and answers it as soon as it
registers the request), and the grant carries the block ids. Every prefill rank must report the
same ones. Such a pull is bound to prefill by its unique transfer id, not by an engine id the
proxy may have cached before prefill restarted: a restarted peer is looked up again.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from ..core.groups import block_groups
from ..core.layout import Region
from ..core.plan import (
    PeerPlan,
    PlanOptions,
    RequestPlan,
    StagingArea,
    plan_grouped_request,
    request_needs_staging,
)
from ..core.relayout import LocalMemory, apply_swaps
from ..core.state_layout import StateGroup
from ..core.topology import TransferTopology
from ..log import get_logger
from ..options import KIB, NEGATIVE, NON_NEGATIVE, POSITIVE, by_protocol, option, same_option
from ..timeline import PullTimeline
from .claims import ClaimExchange
from .copy_overlap import CopyOverlap
from .failures import FailureKind, PullError, as_pull_error
from .lanes import FifoLanes
from .leases import HeldBlocks, LeasedPeer, Leases, LeaseTerms, agreed_blocks
from .notifier import ReadDoneNotifier
from .orders import PullOrder
from .peer_lookup import Lookup, PeerLookup
from .peer_reads import PeerReader, ReadTerms
from .peers import PEER_COOLDOWN_MAX_S, PEER_COOLDOWN_S, PeerDirectory
from .pull_reports import PullFailure, PullReports, PullStats
from .side_channel import SideChannelClient
from .staging_pool import StagingPool
from .transport import Transport
from .wire import ClaimReply, ReadDone, bounded_text

__all__ = ["PullFailure", "PullStats", "Receiver", "ReceiverOptions"]

logger = get_logger(__name__)


#: The longest a prefill may hold a decode's pending claim open (long poll), at most half of
#: ``side_channel_timeout_s`` (:attr:`..connector.config.ConnectorConfig.claim_park_s`).
CLAIM_PARK_S = 1.0
#: ``max_descriptor_kib`` over tcp; 0 (never split) on other transports.
TCP_MAX_DESCRIPTOR_KIB = 1024
#: ``block_reads_from_kib`` over tcp; 0 (never) on other transports.
TCP_BLOCK_READS_FROM_KIB = 256


def default_max_descriptor_kib(protocol: str) -> int:
    """``max_descriptor_kib`` when the configuration does not say."""
    return TCP_MAX_DESCRIPTOR_KIB if protocol == "tcp" else 0


def default_block_reads_from_kib(protocol: str) -> int:
    """``block_reads_from_kib`` when the configuration does not say."""
    return TCP_BLOCK_READS_FROM_KIB if protocol == "tcp" else 0


@dataclass(frozen=True)
class ReceiverOptions:
    """The decode side's settings, in bytes and seconds. Those declared with ``option`` are keys
    of kv_connector_extra_config (:mod:`..options`), in the order the docs list them; the worker
    passes the configured values (:class:`~..connector.config.ConnectorConfig`)."""

    # how long a "pending" prefill (request not registered yet) is asked
    claim_wait_s: float = option(
        10.0,
        summary=(
            "before reading, decode claims a read lease from each prefill rank; a rank that has not"
            " registered the request yet (it learns of it one engine step after answering) is asked"
            " again for up to this long."
        ),
        details=(
            "A rank that already released the request refuses, so a late read never sees reused "
            "blocks. The lease lasts `release_timeout_s` and is renewed before reading when half of"
            " it has passed; bytes read after the lease ended are discarded."
        ),
        unit="s",
        bound=POSITIVE,
    )
    # the same, for a pull admitted before prefill finished
    prefill_wait_s: float = option(
        120.0,
        summary=(
            "the same wait for a request whose decode leg was sent alongside its prefill (the "
            'proxy\'s overlapped legs): the lease is "pending" until prefill is done.'
        ),
        details=f"Prefill holds a pending claim open (up to {CLAIM_PARK_S:g} s, or half of "
        "`side_channel_timeout_s`, at a time) and answers it the moment it registers the "
        "request, so decode neither polls nor waits longer than needed. A prefill request that "
        "is aborted refuses the lease at once.",
        unit="s",
        bound=POSITIVE,
    )
    # extra attempts for a failed batch read (transient transport errors)
    read_retries: int = option(
        1,
        summary=(
            "extra attempts, with a short backoff, for a batched read that failed (transient "
            "transport errors)."
        ),
        bound=NON_NEGATIVE,
    )
    max_descriptors_per_batch: int = same_option(PlanOptions, "max_descriptors_per_batch")
    max_descriptor_bytes: int = option(
        0,  # 0: never split (the configured default depends on the protocol)
        key="max_descriptor_kib",
        scale=KIB,
        computed=by_protocol(default_max_descriptor_kib),
        summary="split descriptors larger than this many KiB (0: never).",
        details=(
            "Mooncake's TCP transport moves ~1 MiB descriptors faster than much larger ones; RDMA "
            "slices large ones itself. A negative value is read as the default, not refused."
        ),
        unit="KiB",
        bound=NON_NEGATIVE,
        as_default=NEGATIVE,
    )
    coalesce_runs: bool = same_option(PlanOptions, "coalesce_runs")
    block_reads_from_bytes: int = option(
        0,  # 0: never (likewise)
        key="block_reads_from_kib",
        scale=KIB,
        computed=by_protocol(default_block_reads_from_kib),
        summary=(
            "head-major merges (prefill TP > decode TP) read block by block, with no local "
            "permutation, when a prefill block is at least this many KiB (0: never)."
        ),
        details=(
            "Over TCP per-block reads of 256 KiB blocks beat run-level coalescing plus its "
            "permutation, 128 KiB blocks did not (see benchmarks/README.md); smaller blocks stay "
            "coalesced. A negative value is read as the default, not refused."
        ),
        unit="KiB",
        bound=NON_NEGATIVE,
        as_default=NEGATIVE,
    )
    #: compare every read batch's checksum with prefill's before reporting (:mod:`.verify`)
    verify_reads: bool = option(
        False,
        summary=(
            "decode only: check every read batch end to end before the pull is reported: decode "
            "compares the checksum of the bytes that landed with prefill's checksum of the bytes it"
            " serves."
        ),
        details=(
            "A mismatch (corruption in flight, a planned destination written short or not at all, "
            "blocks changed under the read) fails the pull, counted and logged, instead of loading "
            "wrong KV. It checks the transport's copy of the ranges the plan chose, not the plan: "
            "a wrong offset or block chosen by the planner, and the copies and swaps that run after"
            " the bytes land, pass unseen (datapath/verify.py). It costs a "
            "side-channel round trip per batch and a checksum pass over the bytes on both sides, on"
            " the KV's own device (benchmarks/README.md); both sides must run a version that knows "
            "it."
        ),
    )
    num_threads: int = option(
        4,
        key="receiver_threads",
        summary=(
            "decode threads issuing reads; different prefill peers are read in parallel, one peer "
            "in order."
        ),
        bound=POSITIVE,
    )
    requests_per_turn: int = 4
    claim_poll_s: tuple[float, float] = (0.001, 0.01)  # first and longest wait between asks
    # prefill may hold a pending claim's reply this long (long poll)
    claim_park_s: float = CLAIM_PARK_S
    #: how long reads from a prefill that left a read unsettled fail at once (circuit open)
    peer_cooldown_s: float = PEER_COOLDOWN_S
    #: ... doubled per unsettled read in a row from that prefill, up to this
    peer_cooldown_max_s: float = PEER_COOLDOWN_MAX_S
    claim_attempts: int = 2  # exchanges tried per claim when the peer is silent (busy host)
    retry_backoff_s: float = 0.2
    lease_margin: float = 0.1  # fraction of a lease kept as safety margin
    notify_attempts: int = 4  # read-done deliveries tried per peer before the prefill's deadline
    notify_backoff_s: float = 1.0  # wait before retry n is n times this


@dataclass
class _InFlight:
    """A pull between its plan and its report: the reads left, and the first failure."""

    pull: PullOrder
    plan: RequestPlan
    peers: dict[int, LeasedPeer]
    remaining: int
    started: float
    timeline: PullTimeline
    staging: StagingArea | None = None
    failure: PullError | None = None
    quarantined: bool = False  # a read may still write its local memory: never report it
    lock: threading.Lock = field(default_factory=threading.Lock)


def _shutting_down(exc: Exception) -> PullError:
    return PullError(FailureKind.UNAVAILABLE_HERE, f"the decode worker is shutting down ({exc})")


class Receiver:
    """Pulls requests' KV into this decode worker's cache (the stages: module docstring)."""

    def __init__(
        self,
        transport: Transport,
        topology: TransferTopology,
        decode_rank: int,
        local_regions: Sequence[Region],
        memory: LocalMemory,
        peers: PeerDirectory,
        client: SideChannelClient,
        options: ReceiverOptions | None = None,
        staging: StagingPool | None = None,
        region_groups: Sequence[int] = (),
        state_groups: Sequence[StateGroup] = (),
    ) -> None:
        self._topology = topology
        self._rank = decode_rank
        self._local_regions = list(local_regions)
        #: each region's KV cache group (vLLM's hybrid manager), none: one group
        self._region_groups = tuple(region_groups)
        #: the state layers' groups (hybrid linear-attention models), planned apart
        self._state_groups = tuple(state_groups)
        self._memory = memory
        self._peers = peers
        self._options = options = options or ReceiverOptions()
        self._staging = staging
        self._reports = PullReports()
        self._queue: queue.Queue[tuple[PullOrder, PullTimeline] | None] = queue.Queue()
        self._lookup = PeerLookup(peers, decode_rank, self._local_regions)
        # Planning waits on peers (metadata, leases) and staging buffers: it gets its own threads
        # so that it can neither block the reads that free staging buffers nor queue behind a
        # dead peer's timeouts on one thread, hence more threads than for reads.
        self._prepare_pool = ThreadPoolExecutor(
            4 * options.num_threads, thread_name_prefix="vam-prepare"
        )
        # Claims wait for their grants (early pulls up to prefill_wait_s) on one thread, all at
        # once: a pull whose KV is held already never queues behind them.
        self._claims = ClaimExchange(client, options.claim_attempts, options.claim_poll_s)
        self._leases = Leases(
            self._claims,
            peers,
            LeaseTerms(options.claim_wait_s, options.prefill_wait_s, options.claim_park_s),
            decode_rank,
            topology.decode_tp,
            self._reports.check_cancelled,
            self._submit_planning,
        )
        self._pool = ThreadPoolExecutor(options.num_threads, thread_name_prefix="vam-recv")
        self._copies = CopyOverlap(memory, options.num_threads)
        self._reader = PeerReader(
            transport,
            memory,
            self._copies,
            self._leases,
            peers,
            client,
            decode_rank,
            ReadTerms(
                options.read_retries,
                options.retry_backoff_s,
                options.lease_margin,
                options.peer_cooldown_s,
                options.peer_cooldown_max_s,
                options.verify_reads,
            ),
            self._reports.check_cancelled,
        )
        #: reads, by prefill transport session; a lane exists only while it has work
        self._lanes = FifoLanes(self._pool, self._read_from, options.requests_per_turn)
        #: peer lookups, by prefill instance (host, first side-channel port); likewise
        self._lookup_lanes = FifoLanes(self._prepare_pool, self._prepare, options.requests_per_turn)
        self._notifier = ReadDoneNotifier(
            client, attempts=options.notify_attempts, backoff_s=options.notify_backoff_s
        )
        self._dispatcher = threading.Thread(
            target=self._dispatch, name="vam-recv-dispatch", daemon=True
        )
        self._dispatcher.start()

    # -- what vLLM calls --------------------------------------------------------------------

    def submit(self, pull: PullOrder) -> None:
        if not pull.release_only:
            suspended = self._reports.admit(pull)
            if suspended is not None:
                self._finish(pull, PullError(FailureKind.UNAVAILABLE_HERE, suspended))
                return
        self._queue.put((pull, PullTimeline(submitted=time.monotonic())))

    def suspend(self, reason: str, timeout_s: float) -> None:
        """Before vLLM's sleep mode discards the KV cache: fail new pulls with ``reason``, make
        pulls still waiting for a grant give up and reads still queued on a lane never start
        (each fails with ``reason``, its blocks load errors), and wait up to ``timeout_s`` for
        reads under way to settle (they write into the memory about to be unregistered)."""
        self._reports.suspend(reason, timeout_s)

    def resume(self) -> None:
        """Pull again (after vLLM's wake-up)."""
        self._reports.resume()

    def cancel(self, request_id: str) -> None:
        """vLLM finished the request while its KV loads: a pull still waiting for prefill's
        grant gives up within a tick of the claims thread (:data:`~.claims.TICK_S`), reads still
        queued on a peer's lane do not start. Reads already under way run to the end: a
        Mooncake read cannot be cancelled, and vLLM keeps the blocks until it is told."""
        self._reports.cancel(request_id)

    def wait_for_news(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` while pulls are in flight and none has ended unreported.

        An engine with only loading requests steps in a tight loop; waiting here instead keeps
        it from taking the CPU that the transfer (and, on a shared host, prefill) needs.
        """
        self._reports.wait_for_news(timeout_s)

    def take_finished(self) -> tuple[set[str], dict[str, PullFailure]]:
        """Requests whose pull ended since the last call: loaded ones, and failed ones with the
        local blocks that must not be used."""
        return self._reports.take_finished()

    def take_stats(self) -> list[PullStats]:
        return self._reports.take_stats()

    def shutdown(self) -> None:
        """Stop: pulls still waiting for a grant give up at once instead of waiting out
        ``prefill_wait_s``; reads under way end."""
        self._reports.cancel_all()
        self._queue.put(None)
        self._dispatcher.join(timeout=5)
        self._claims.close()  # claims still waiting fail now, their pulls on planning threads
        self._prepare_pool.shutdown(wait=True, cancel_futures=False)
        self._pool.shutdown(wait=True, cancel_futures=False)
        self._copies.shutdown()
        self._notifier.shutdown()

    # -- dispatch, look up, claim -----------------------------------------------------------

    def _dispatch(self) -> None:
        while (item := self._queue.get()) is not None:
            pull = item[0]
            try:
                # One lane per prefill instance: a peer that does not answer its metadata
                # requests holds one planning thread, never all of them, and its other pulls
                # wait behind it (then fail at once while it is marked down).
                self._lookup_lanes.push((pull.remote_host, pull.remote_port), item)
            except RuntimeError as exc:  # the pool shut down
                self._finish(pull, _shutting_down(exc))

    def _submit_planning(self, pull: PullOrder, task: Callable[..., None], *args) -> None:
        """Run ``task`` on a planning thread; a pull that cannot get one (shutting down) fails."""
        try:
            self._prepare_pool.submit(task, *args)
        except RuntimeError as exc:
            self._finish(pull, _shutting_down(exc))

    def _prepare(self, pull: PullOrder, timeline: PullTimeline) -> None:
        """Look the prefill ranks up and claim every one's lease at once; the plan is made when
        the last grant arrives. No thread waits for a grant (:mod:`.claims`)."""
        peers: dict[int, LeasedPeer] = {}
        try:
            lookup = self._lookup.look_up(pull, peers)
            if not pull.local_block_ids:  # release-only: nothing to claim or read
                self._plan_and_read(pull, peers, lookup, None, timeline)
                return
            claims = {
                rank: self._leases.first_claim(pull, peer, lookup.remote_tables, lookup.topology)
                for rank, peer in peers.items()
            }
        except Exception as exc:
            self._give_up(pull, peers, exc)
            return
        unanswered = [len(claims)]
        guard = threading.Lock()

        def answered(_: Future) -> None:
            with guard:
                unanswered[0] -= 1
                if unanswered[0]:
                    return
            self._submit_planning(pull, self._granted, pull, peers, lookup, claims, timeline)

        for claim in claims.values():
            claim.add_done_callback(answered)

    def _granted(
        self,
        pull: PullOrder,
        peers: dict[int, LeasedPeer],
        lookup: Lookup,
        claims: dict[int, Future[ClaimReply]],
        timeline: PullTimeline,
    ) -> None:
        """Every rank answered its claim: plan the reads if all granted the same blocks."""
        try:
            blocks = None
            if pull.remote_block_ids is not None:
                blocks = (pull.remote_block_ids, pull.remote_group_sizes)
            for rank, claim in claims.items():
                blocks = agreed_blocks(pull, rank, blocks, claim.result())
            timeline.granted = time.monotonic()
            self._plan_and_read(pull, peers, lookup, blocks, timeline)
        except Exception as exc:
            self._give_up(pull, peers, exc)

    def _give_up(self, pull: PullOrder, peers: dict[int, LeasedPeer], exc: Exception) -> None:
        failure = as_pull_error(exc)
        if failure.kind in (FailureKind.CANCELLED, FailureKind.CLIENT_LEFT):
            logger.info("cannot pull KV for request %s: %s", pull.request_id, exc)
        elif failure.kind is FailureKind.INTERNAL:
            logger.error("cannot pull KV for request %s: %s", pull.request_id, exc, exc_info=exc)
        else:
            logger.warning(
                "cannot pull KV for request %s (%s): %s", pull.request_id, failure.kind.value, exc
            )
        for peer in peers.values():  # release what was looked up; others expire it
            self._notify(peer, pull.transfer_id, str(exc))
        self._finish(pull, failure)

    # -- plan, read, fix up, report ---------------------------------------------------------

    def _plan_and_read(
        self,
        pull: PullOrder,
        peers: dict[int, LeasedPeer],
        lookup: Lookup,
        remote: HeldBlocks | None,
        timeline: PullTimeline,
    ) -> None:
        """Plan the request's reads (in a staging area if it needs one) and queue them on
        each peer's lane."""
        groups = max((*self._region_groups, *(s.group for s in self._state_groups)), default=0) + 1
        try:  # blocks that do not split into this worker's groups: a grant mismatch
            local_groups = block_groups(pull.local_block_ids, pull.local_group_sizes, groups)
            remote_groups = block_groups(*(remote or ((), ())), groups)
        except ValueError as exc:
            raise PullError(FailureKind.GRANT_MISMATCH, str(exc)) from exc
        staging = None
        if pull.local_block_ids and request_needs_staging(
            self._local_regions, lookup.remote_tables, lookup.pulls
        ):
            if self._staging is None:
                raise PullError(
                    FailureKind.NO_STAGING,
                    "this worker has no staging buffer, which this request needs (a slice of "
                    "token-major blocks, or head-major blocks of another block size): set "
                    "staging_buffer_mib on this decode instance",
                )
            staging = self._staging.acquire(
                self._options.claim_wait_s,
                lambda: self._reports.check_cancelled(pull),
                self._options.claim_park_s,
            )
        try:
            plan = plan_grouped_request(
                lookup.topology,
                self._rank,
                lookup.seed,
                self._local_regions,
                lookup.remote_tables,
                self._region_groups,
                local_groups,
                remote_groups,
                PlanOptions(
                    max_descriptors_per_batch=self._options.max_descriptors_per_batch,
                    coalesce_runs=self._options.coalesce_runs,
                    block_reads_from_bytes=self._options.block_reads_from_bytes,
                    staging=staging,
                    max_descriptor_bytes=self._options.max_descriptor_bytes,
                ),
                num_tokens=pull.num_prompt_tokens if pull.num_prompt_tokens >= 0 else None,
                local_states=self._state_groups,
                remote_states=lookup.remote_states,
            )
        except Exception:
            if staging is not None:
                self._staging.release(staging)
            raise
        state = _InFlight(
            pull, plan, dict(peers), len(peers), time.perf_counter(), timeline, staging
        )
        for peer_plan in plan.peers:
            if peer_plan.batches:
                self._lanes.push(
                    peers[peer_plan.prefill_rank].transport_session, (state, peer_plan)
                )
            else:  # nothing to read (decode already caches the prompt): just release
                self._read_from(state, peer_plan)

    def _read_from(self, state: _InFlight, peer_plan: PeerPlan) -> None:
        """Read one peer's part of a pull, tell that peer, and complete the pull if it was the
        last part."""
        peer = state.peers[peer_plan.prefill_rank]
        failure = None
        with state.lock:
            state.timeline.mark_first_read(time.monotonic())
        if state.failure is None and peer_plan.batches:
            try:
                self._reader.read(state.pull, peer, peer_plan)
            except Exception as exc:  # any failure: the request is failed, never half-used
                failure = as_pull_error(exc)
                if failure.kind is FailureKind.UNSETTLED:
                    state.quarantined = True
                self._reader.failed(state.pull, peer, failure, exc)
        reason = failure or state.failure
        self._notify(peer, state.pull.transfer_id, None if reason is None else str(reason))
        with state.lock:
            if failure is not None and state.failure is None:
                state.failure = failure
            state.remaining -= 1
            last = state.remaining == 0
        if last:
            state.timeline.landed = time.monotonic()
            self._complete(state)

    def _notify(self, peer: LeasedPeer, transfer_id: str, failure: str | None) -> None:
        """Tell ``peer`` this worker is done with ``transfer_id`` (if no other pull of it still
        reads that peer), so prefill can free its blocks."""
        if not self._lookup.last_reader(transfer_id, peer):
            return
        message = ReadDone(
            request_id=transfer_id,
            decode_rank=self._rank,
            incarnation=peer.incarnation,
            success=failure is None,
            reason=bounded_text(failure or ""),
            reader=self._peers.local.incarnation,
            decode_tp=self._topology.decode_tp,
        )
        self._notifier.send(peer.host, peer.port, peer.rank, message)

    def _complete(self, state: _InFlight) -> None:
        """Every read of the pull settled: fix the KV up and report it (a quarantined pull is
        never reported)."""
        if state.quarantined:
            # Never reported: vLLM keeps the blocks (and this staging area stays out of use), so
            # the bytes still in flight cannot land in KV that anyone else computes or reads.
            logger.error(
                "request %s: a KV read never settled (%s); its %d decode block(s) stay allocated "
                "and the request waits until the engine restarts",
                state.pull.request_id,
                state.failure,
                len(state.pull.local_block_ids),
            )
            if state.staging is not None and self._staging is not None:
                self._staging.quarantine(state.staging)
            self._reports.forget(state.pull.request_id)  # nothing to wait for
            return
        fixup_started = time.perf_counter()
        try:
            if state.failure is None:
                apply_swaps(self._memory, state.plan.fixups)
            # Queued fix-ups run before the blocks are reported loaded and before the staging
            # area goes to another request (relayout's ordering contract).
            self._memory.fence()
        except Exception as exc:
            state.failure = PullError(FailureKind.FIXUP, f"fix-up failed: {exc}")
            logger.exception("request %s: KV fix-up failed", state.pull.request_id)
        finally:
            if state.staging is not None and self._staging is not None:
                self._staging.release(state.staging)
        state.timeline.fixed_up = time.monotonic()
        if state.failure is None and not state.pull.release_only:
            self._reports.record_stats(
                PullStats(
                    state.pull.request_id,
                    state.plan.num_bytes,
                    state.plan.num_descriptors,
                    time.perf_counter() - state.started,
                    time.perf_counter() - fixup_started,
                    state.timeline,
                    state.pull.transfer_id,
                )
            )
        self._finish(state.pull, state.failure)

    def _finish(self, pull: PullOrder, failure: PullError | None) -> None:
        if pull.release_only:
            if failure is not None:
                logger.info(
                    "request %s: releasing prefill's hold failed: %s", pull.request_id, failure
                )
            return  # vLLM loads nothing for it and must never hear of it
        self._reports.finish(pull, failure)
