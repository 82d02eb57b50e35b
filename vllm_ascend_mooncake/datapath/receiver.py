"""Decode side: pull each request's KV from the prefill ranks the topology names, then fix it up.

A :class:`PullOrder` goes through three stages, none of which lets one peer hold up the others.
Its prefill instance's lookup lane finds the ranks it reads (fetching their metadata on first
contact: a peer that does not answer holds one planning thread, not all). Every rank's read claim
then goes out at once through :mod:`.claims`, one thread for all the claims that wait for a grant;
the last grant plans the reads on a planning thread. Reads run on a thread pool with one FIFO lane
per prefill peer: different peers in parallel, one peer strictly in order. All layers of a
request-peer pair go out as one batched read, split at the descriptor cap. The fix-up runs only
once every pull of the request has landed; a partially read request is never fixed up or reported
loaded. Each peer read gets a read-done notification (success or not) so the prefill side can free
its blocks; :mod:`.notifier` sends it off the read path.

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

from ..core.layout import Region
from ..core.plan import (
    PeerPlan,
    PlanOptions,
    RequestPlan,
    RequestPulls,
    StagingArea,
    TransferBatch,
    plan_request,
    request_needs_staging,
)
from ..core.relayout import LocalMemory, apply_swaps
from ..core.topology import TransferTopology, request_seed
from ..log import get_logger
from ..options import KIB, NEGATIVE, NON_NEGATIVE, POSITIVE, by_protocol, option, same_option
from ..timeline import PullTimeline
from .claims import ClaimExchange
from .compat import IncompatiblePeerError
from .copy_overlap import CopyOverlap
from .failures import FailureKind, PullCancelled, PullError, as_pull_error
from .lanes import FifoLane
from .leases import LeasedPeer, Leases, LeaseTerms, agreed_block_ids, check_same_tp
from .notifier import ReadDoneNotifier
from .orders import PullOrder
from .peers import PEER_COOLDOWN_MAX_S, PEER_COOLDOWN_S, PeerDirectory
from .side_channel import SideChannelClient, SideChannelError
from .staging_pool import StagingPool
from .transport import TransferError, Transport, UnsettledTransfer
from .verify import IntegrityError, check_digest, landed_checksum, verify_request
from .wire import ClaimReply, ReadDone, bounded_text

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
class _Circuit:
    """A prefill transport whose reads left bytes in flight lately (a frozen data path)."""

    incarnation: str  # the peer process those reads went to
    strikes: int  # unsettled reads in a row (each one quarantined a pull)
    until: float  # reads fail at once until then (``time.monotonic``)


@dataclass(frozen=True)
class PullFailure:
    """A request whose KV could not be loaded: these local blocks hold garbage."""

    local_block_ids: tuple[int, ...]
    reason: str
    kind: FailureKind = FailureKind.INTERNAL
    #: the prefill engine the pull read from ("" when the order named none)
    prefill_engine_id: str = ""

    @property
    def cancelled(self) -> bool:
        """vLLM finished (aborted) the request while it waited for prefill, and the pull gave
        up before reading: not a transfer failure."""
        return self.kind is FailureKind.CANCELLED


@dataclass(frozen=True)
class PullStats:
    request_id: str
    num_bytes: int
    num_descriptors: int
    seconds: float  # first read to KV ready
    fixup_seconds: float = 0.0
    timeline: PullTimeline | None = None  # the worker stamps ``reported`` when it takes these
    transfer_id: str = ""  # joins this decode rank's timeline to prefill's log lines


@dataclass
class _InFlight:
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


@dataclass(frozen=True)
class _Lookup:
    """What a request reads: its topology, seed, each region's head pulls, and each prefill
    rank's regions."""

    topology: TransferTopology
    seed: int
    pulls: RequestPulls
    remote_tables: dict[int, Sequence[Region]]


def _shutting_down(exc: Exception) -> PullError:
    return PullError(FailureKind.UNAVAILABLE_HERE, f"the decode worker is shutting down ({exc})")


class Receiver:
    """Pulls requests' KV into this decode worker's cache."""

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
    ) -> None:
        self._transport = transport
        self._topology = topology
        self._rank = decode_rank
        self._local_regions = list(local_regions)
        self._memory = memory
        self._peers = peers
        self._client = client
        self._options = options or ReceiverOptions()
        self._staging = staging
        self._pool = ThreadPoolExecutor(self._options.num_threads, thread_name_prefix="vam-recv")
        self._copies = CopyOverlap(memory, self._options.num_threads)
        # Planning waits on peers (metadata, leases) and staging buffers: it gets its own threads
        # so that it can neither block the reads that free staging buffers nor queue behind a
        # dead peer's timeouts on one thread, hence more threads than for reads.
        self._prepare_pool = ThreadPoolExecutor(
            4 * self._options.num_threads, thread_name_prefix="vam-prepare"
        )
        # Claims wait for their grants (early pulls up to prefill_wait_s) on one thread, all at
        # once: a pull whose KV is held already never queues behind them.
        self._claims = ClaimExchange(
            client, self._options.claim_attempts, self._options.claim_poll_s
        )
        self._leases = Leases(
            self._claims,
            peers,
            LeaseTerms(
                self._options.claim_wait_s,
                self._options.prefill_wait_s,
                self._options.claim_park_s,
            ),
            decode_rank,
            topology.decode_tp,
            self._check_cancelled,
            self._submit_planning,
        )
        self._lanes: dict[str, FifoLane] = {}  # reads, by prefill transport session
        #: peer lookups, by prefill instance (host, first side-channel port)
        self._lookup_lanes: dict[tuple[str, int], FifoLane] = {}
        self._notifier = ReadDoneNotifier(
            client,
            attempts=self._options.notify_attempts,
            backoff_s=self._options.notify_backoff_s,
        )
        self._queue: queue.Queue[tuple[PullOrder, PullTimeline] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._news = threading.Condition(self._lock)  # a pull vLLM waits for has ended
        self._waited_for = 0  # pulls vLLM waits for that have not ended yet
        self._done: set[str] = set()
        self._failed: dict[str, PullFailure] = {}
        self._in_flight: set[str] = set()  # request ids of pulls vLLM waits for, not ended yet
        self._cancelled: set[str] = set()  # ... of those, the ones vLLM no longer wants
        #: ... of those, the ones vLLM still wants that sleep mode cut short, and why: a failure
        #: (their blocks are load errors), not a cancel (vLLM would use the blocks unloaded)
        self._interrupted: dict[str, str] = {}
        self._stats: list[PullStats] = []
        # (transfer id, prefill host, port) -> pulls on this worker that looked the peer up for
        # it and have not sent their read-done notice: only the last one sends it, so a second
        # pull of one transfer (a router retrying the decode leg) never reads released blocks.
        self._readers: dict[tuple[str, str, int], int] = {}
        #: prefill transport session -> its reads that never settled lately: they fail at once
        #: for a cool-down doubled per such read in a row (PEER_COOLDOWN_S .. _MAX_S)
        self._open_circuits: dict[str, _Circuit] = {}
        #: why pulls fail at once while vLLM's sleep mode has the KV cache (None: awake)
        self._suspended: str | None = None
        self._dispatcher = threading.Thread(
            target=self._dispatch, name="vam-recv-dispatch", daemon=True
        )
        self._dispatcher.start()

    # -- public API -------------------------------------------------------------------------

    def submit(self, pull: PullOrder) -> None:
        if not pull.release_only:
            with self._lock:
                self._waited_for += 1
                self._in_flight.add(pull.request_id)
                suspended = self._suspended
            if suspended is not None:
                self._finish(pull, PullError(FailureKind.UNAVAILABLE_HERE, suspended))
                return
        self._queue.put((pull, PullTimeline(submitted=time.monotonic())))

    def suspend(self, reason: str, timeout_s: float) -> None:
        """Before vLLM's sleep mode discards the KV cache: fail new pulls with ``reason``, make
        pulls still waiting for a grant give up and reads still queued on a lane never start
        (each fails with ``reason``, its blocks load errors), and wait up to ``timeout_s`` for
        reads under way to settle (they write into the memory about to be unregistered)."""
        deadline = time.monotonic() + timeout_s
        with self._news:
            self._suspended = reason
            for request_id in self._in_flight:
                self._interrupted.setdefault(request_id, reason)
            while self._waited_for and (left := deadline - time.monotonic()) > 0:
                self._news.wait(left)
            if self._waited_for:
                logger.warning(
                    "%d pull(s) still under way when the KV cache is unregistered for sleep",
                    self._waited_for,
                )

    def resume(self) -> None:
        """Pull again (after vLLM's wake-up)."""
        with self._lock:
            self._suspended = None

    def cancel(self, request_id: str) -> None:
        """vLLM finished the request while its KV loads: a pull still waiting for prefill's
        grant gives up within a tick of the claims thread (:data:`~.claims.TICK_S`), reads still
        queued on a peer's lane do not start. Reads already under way run to the end: a
        Mooncake read cannot be cancelled, and vLLM keeps the blocks until it is told."""
        with self._lock:
            if request_id in self._in_flight:
                self._cancelled.add(request_id)

    def _check_cancelled(self, pull: PullOrder) -> None:
        """Raise while ``pull`` is no longer to go on: :class:`PullCancelled` once vLLM finished
        the request, a failure of its own once sleep mode interrupted it (vLLM still waits for
        its blocks, which must then be reported as load errors, never as loaded)."""
        with self._lock:
            cancelled = pull.request_id in self._cancelled
            interrupted = self._interrupted.get(pull.request_id)
        if cancelled:
            raise PullCancelled(f"request {pull.request_id} finished before its KV was read")
        if interrupted is not None:
            raise PullError(
                FailureKind.UNAVAILABLE_HERE,
                f"{interrupted} (the pull of request {pull.request_id} was interrupted)",
            )

    def wait_for_news(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` while pulls are in flight and none has ended unreported.

        An engine with only loading requests steps in a tight loop; waiting here instead keeps
        it from taking the CPU that the transfer (and, on a shared host, prefill) needs.
        """
        with self._news:
            if self._waited_for and not self._done and not self._failed:
                self._news.wait(timeout_s)

    def take_finished(self) -> tuple[set[str], dict[str, PullFailure]]:
        """Requests whose pull ended since the last call: loaded ones, and failed ones with the
        local blocks that must not be used."""
        with self._lock:
            done, self._done = self._done, set()
            failed, self._failed = self._failed, {}
        return done, failed

    def take_stats(self) -> list[PullStats]:
        with self._lock:
            stats, self._stats = self._stats, []
        return stats

    def shutdown(self) -> None:
        """Stop: pulls still waiting for a grant give up at once instead of waiting out
        ``prefill_wait_s``; reads under way end."""
        with self._lock:
            self._cancelled |= self._in_flight
        self._queue.put(None)
        self._dispatcher.join(timeout=5)
        self._claims.close()  # claims still waiting fail now, their pulls on planning threads
        self._prepare_pool.shutdown(wait=True, cancel_futures=False)
        self._pool.shutdown(wait=True, cancel_futures=False)
        self._copies.shutdown()
        self._notifier.shutdown()

    # -- dispatch ---------------------------------------------------------------------------

    def _dispatch(self) -> None:
        while (item := self._queue.get()) is not None:
            pull = item[0]
            try:
                self._lookup_lane(pull.remote_host, pull.remote_port).push(item)
            except RuntimeError as exc:  # the pool shut down
                self._finish(pull, _shutting_down(exc))

    def _lookup_lane(self, host: str, port: int) -> FifoLane:
        """The lane looking up one prefill instance's ranks: a peer that does not answer its
        metadata requests holds one planning thread, never all of them, and its other pulls
        wait behind it (then fail at once while it is marked down)."""
        with self._lock:
            lane = self._lookup_lanes.get((host, port))
            if lane is None:
                lane = self._lookup_lanes[(host, port)] = FifoLane(
                    self._prepare_pool, self._prepare, self._options.requests_per_turn
                )
        return lane

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
            lookup = self._look_up(pull, peers)
            if not pull.local_block_ids:  # release-only: nothing to claim or read
                self._plan_and_read(pull, peers, lookup, pull.remote_block_ids, timeline)
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
        lookup: _Lookup,
        claims: dict[int, Future[ClaimReply]],
        timeline: PullTimeline,
    ) -> None:
        """Every rank answered its claim: plan the reads if all granted the same blocks."""
        try:
            remote_block_ids = pull.remote_block_ids
            for rank, claim in claims.items():
                remote_block_ids = agreed_block_ids(pull, rank, remote_block_ids, claim.result())
            timeline.granted = time.monotonic()
            self._plan_and_read(pull, peers, lookup, remote_block_ids, timeline)
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

    def _look_up(self, pull: PullOrder, peers: dict[int, LeasedPeer]) -> _Lookup:
        """The request's topology and the prefill ranks it reads (into ``peers``, so that a
        failure later releases exactly those)."""
        seed = request_seed(pull.transfer_id)
        topology = self._topology_of(pull)
        pulls = RequestPulls.of(topology, self._rank, seed, self._local_regions)
        remote_tables: dict[int, Sequence[Region]] = {}
        # An early pull is bound by its unique transfer id; the engine id it carries may predate
        # a prefill restart (the proxy learns the new one from the answer that follows).
        engine_id = None if pull.early else pull.remote_engine_id
        refused: IncompatiblePeerError | None = None
        for rank in pulls.prefill_ranks:
            port = pull.remote_port + rank
            try:
                prefill = self._peers.get(pull.remote_host, port, engine_id)
            except IncompatiblePeerError as exc:
                # every refused rank is still told to release its hold (by _give_up), not left
                # to its release timeout
                refused = refused or exc
                if exc.incarnation:
                    peers[rank] = LeasedPeer(rank, pull.remote_host, port, "", exc.incarnation)
                continue
            check_same_tp(prefill, topology)
            remote_tables[rank] = prefill.regions
            peers[rank] = LeasedPeer(
                rank, pull.remote_host, port, prefill.transport_session, prefill.incarnation
            )
            with self._lock:
                key = (pull.transfer_id, pull.remote_host, port)
                self._readers[key] = self._readers.get(key, 0) + 1
        if refused is not None:
            raise refused
        return _Lookup(topology, seed, pulls, remote_tables)

    def _plan_and_read(
        self,
        pull: PullOrder,
        peers: dict[int, LeasedPeer],
        lookup: _Lookup,
        remote_block_ids: Sequence[int] | None,
        timeline: PullTimeline,
    ) -> None:
        """Plan the request's reads (in a staging area if it needs one) and queue them on
        each peer's lane."""
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
                lambda: self._check_cancelled(pull),
                self._options.claim_park_s,
            )
        try:
            plan = plan_request(
                lookup.topology,
                self._rank,
                lookup.seed,
                self._local_regions,
                lookup.remote_tables,
                pull.local_block_ids,
                remote_block_ids or (),
                PlanOptions(
                    max_descriptors_per_batch=self._options.max_descriptors_per_batch,
                    coalesce_runs=self._options.coalesce_runs,
                    block_reads_from_bytes=self._options.block_reads_from_bytes,
                    staging=staging,
                    max_descriptor_bytes=self._options.max_descriptor_bytes,
                ),
                num_tokens=pull.num_prompt_tokens if pull.num_prompt_tokens >= 0 else None,
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
                self._lane(peers[peer_plan.prefill_rank].transport_session).push((state, peer_plan))
            else:  # nothing to read (decode already caches the prompt): just release
                self._read_from(state, peer_plan)

    def _topology_of(self, pull: PullOrder) -> TransferTopology:
        """The topology pairing the request's prefill instance (its TP size, as its params say)
        with this decode instance; the configured one when the pull does not say."""
        topologies = self._peers.topologies
        if pull.remote_tp_size is None:
            return topologies.configured
        return topologies.with_remote_tp(pull.remote_tp_size)

    def _lane(self, session: str) -> FifoLane:
        with self._lock:
            lane = self._lanes.get(session)
            if lane is None:
                lane = self._lanes[session] = FifoLane(
                    self._pool, self._read_from, self._options.requests_per_turn
                )
        return lane

    # -- reads ------------------------------------------------------------------------------

    def _read_from(self, state: _InFlight, peer_plan: PeerPlan) -> None:
        peer = state.peers[peer_plan.prefill_rank]
        failure = None
        with state.lock:
            state.timeline.mark_first_read(time.monotonic())
        if state.failure is None and peer_plan.batches:
            try:
                self._read_leased(state.pull, peer, peer_plan)
                with self._lock:
                    self._open_circuits.pop(peer.transport_session, None)
            except Exception as exc:  # any failure: the request is failed, never half-used
                failure = as_pull_error(exc)
                self._read_failed(state, peer, failure, exc)
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

    def _read_failed(
        self, state: _InFlight, peer: LeasedPeer, failure: PullError, exc: Exception
    ) -> None:
        if failure.kind in (FailureKind.CANCELLED, FailureKind.UNAVAILABLE_HERE):
            # cancelled or asleep before this read started: nothing wrong with the peer
            logger.info(
                "request %s: no read from prefill rank %d: %s",
                state.pull.request_id,
                peer.rank,
                exc,
            )
            return
        if failure.kind is FailureKind.UNSETTLED:  # frozen: others would hang as long
            self._open_circuit(peer)
            state.quarantined = True
        self._peers.invalidate(peer.host, peer.port)
        logger.warning(
            "request %s: read from prefill rank %d (%s) failed (%s): %s",
            state.pull.request_id,
            peer.rank,
            peer.transport_session,
            failure.kind.value,
            exc,
        )

    def _open_circuit(self, peer: LeasedPeer) -> None:
        """A read from ``peer`` never settled: fail its reads at once for a cool-down, doubled
        for each such read in a row (the one read let through after a cool-down is the probe;
        if it hangs too, the next wait is twice as long), never past ``peer_cooldown_max_s``."""
        options = self._options
        with self._lock:
            circuit = self._open_circuits.get(peer.transport_session)
            if circuit is None or circuit.incarnation != peer.incarnation:
                circuit = _Circuit(peer.incarnation, 0, 0.0)
                self._open_circuits[peer.transport_session] = circuit
            circuit.strikes += 1
            cooldown = options.peer_cooldown_s * 2 ** min(circuit.strikes - 1, 32)
            circuit.until = time.monotonic() + min(cooldown, options.peer_cooldown_max_s)

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

    def _read_leased(self, pull: PullOrder, peer: LeasedPeer, peer_plan: PeerPlan) -> None:
        """Read every batch under a valid lease; bytes that may postdate the lease are refused.
        A pull cancelled or cut short by sleep mode while its reads waited in the peer's lane
        reads no further batch: sleep unregisters the memory they would land in."""
        self._check_cancelled(pull)
        self._check_circuit(peer)
        if time.monotonic() - peer.claimed_at > peer.lease_s / 2:
            self._leases.claim(pull, peer).result()  # waited long in the queue: renew first

        def read(batch: TransferBatch) -> None:
            self._check_cancelled(pull)
            self._read_batch(peer.transport_session, batch)
            if self._options.verify_reads:
                self._verify_batch(pull, peer, batch)

        self._copies.read_all(peer_plan.batches, read)
        lease_end = peer.claimed_at + peer.lease_s * (1 - self._options.lease_margin)
        if time.monotonic() > lease_end:
            raise PullError(
                FailureKind.LEASE_OUTLASTED,
                f"the read outlasted its {peer.lease_s:.0f} s lease: prefill may already have "
                f"reused the blocks",
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
        for attempt in range(self._options.read_retries + 1):
            try:
                self._transport.read(
                    transport_session, batch.local_addrs, batch.remote_addrs, batch.lengths
                )
                return
            except UnsettledTransfer:
                raise  # bytes may still land: a second read into the same memory would race it
            except TransferError:
                if attempt == self._options.read_retries:
                    raise
                time.sleep(self._options.retry_backoff_s * (attempt + 1))

    def _complete(self, state: _InFlight) -> None:
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
            with self._lock:
                self._waited_for -= 1  # nothing to wait for: it is never reported
                self._in_flight.discard(state.pull.request_id)
                self._cancelled.discard(state.pull.request_id)
                self._interrupted.pop(state.pull.request_id, None)
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
            with self._lock:
                self._stats.append(
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
        with self._lock:
            if failure is None:
                self._done.add(pull.request_id)
            else:
                self._failed[pull.request_id] = PullFailure(
                    tuple(pull.local_block_ids),
                    str(failure),
                    failure.kind,
                    pull.remote_engine_id or "",
                )
            self._in_flight.discard(pull.request_id)
            self._cancelled.discard(pull.request_id)
            self._interrupted.pop(pull.request_id, None)
            self._waited_for -= 1
            self._news.notify_all()

    def _notify(self, peer: LeasedPeer, transfer_id: str, failure: str | None) -> None:
        key = (transfer_id, peer.host, peer.port)
        with self._lock:
            left = self._readers.pop(key, 1) - 1
            if left > 0:  # another pull of this transfer still reads this peer: it notifies
                self._readers[key] = left
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
