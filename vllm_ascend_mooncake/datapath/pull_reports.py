"""Decode side: the state vLLM waits on, and every method that changes it.

vLLM hears of a pull once, when it ended and no byte can land any more: loaded
(:meth:`PullReports.take_finished`'s first set) or failed (its blocks are load errors). Between
:meth:`PullReports.admit` and :meth:`PullReports.finish` a pull is *in flight*; vLLM may cancel
it (it finished the request), sleep mode may interrupt it (its blocks are then load errors, never
loaded), and a pull whose read never settled is *forgotten* (never reported: vLLM keeps its
blocks). Release-only pulls (no local blocks) never come here: vLLM waits for nothing of them.

One lock guards it all; the threads of :class:`~.receiver.Receiver`'s stages only call the
methods below.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from ..log import get_logger
from ..timeline import PullTimeline
from .failures import FailureKind, PullCancelled, PullError
from .orders import PullOrder

logger = get_logger(__name__)


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


class PullReports:
    """The pulls vLLM waits for: in flight, cancelled, interrupted, done, failed, and stats."""

    def __init__(self) -> None:
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
        #: why pulls fail at once while vLLM's sleep mode has the KV cache (None: awake)
        self._suspended: str | None = None

    # -- a pull's life ----------------------------------------------------------------------

    def admit(self, pull: PullOrder) -> str | None:
        """Count ``pull`` as in flight; why it must fail at once (sleep mode), or None."""
        with self._lock:
            self._waited_for += 1
            self._in_flight.add(pull.request_id)
            return self._suspended

    def check_cancelled(self, pull: PullOrder) -> None:
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

    def record_stats(self, stats: PullStats) -> None:
        with self._lock:
            self._stats.append(stats)

    def finish(self, pull: PullOrder, failure: PullError | None) -> None:
        """``pull`` ended: report it loaded, or failed with ``failure``."""
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
            self._end(pull.request_id)
            self._news.notify_all()

    def forget(self, request_id: str) -> None:
        """A pull whose read never settled ended: it is never reported, so vLLM keeps its
        blocks and nobody waits for it."""
        with self._lock:
            self._end(request_id)

    def _end(self, request_id: str) -> None:
        """No longer in flight (caller holds the lock)."""
        self._waited_for -= 1
        self._in_flight.discard(request_id)
        self._cancelled.discard(request_id)
        self._interrupted.pop(request_id, None)

    # -- what vLLM (and shutdown) asks ------------------------------------------------------

    def cancel(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._in_flight:
                self._cancelled.add(request_id)

    def cancel_all(self) -> None:
        """Shutting down: every pull in flight gives up at its next check."""
        with self._lock:
            self._cancelled |= self._in_flight

    def suspend(self, reason: str, timeout_s: float) -> None:
        """Fail new pulls with ``reason``, interrupt those in flight, and wait up to
        ``timeout_s`` for them to end."""
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
        with self._lock:
            self._suspended = None

    def wait_for_news(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` while pulls are in flight and none has ended unreported."""
        with self._news:
            if self._waited_for and not self._done and not self._failed:
                self._news.wait(timeout_s)

    def take_finished(self) -> tuple[set[str], dict[str, PullFailure]]:
        with self._lock:
            done, self._done = self._done, set()
            failed, self._failed = self._failed, {}
        return done, failed

    def take_stats(self) -> list[PullStats]:
        with self._lock:
            stats, self._stats = self._stats, []
        return stats
