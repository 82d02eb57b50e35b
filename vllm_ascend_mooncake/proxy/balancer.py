"""Instance selection for one role (prefill or decode): healthy first, then least in-flight
requests, round-robin ties; instances that fail to accept connections are ejected for a while.

Requests to vLLM differ wildly in cost, so counting what each instance is still working on
spreads load better than plain rotation; the rotation only breaks ties, which keeps an idle
fleet evenly used.

Each instance has a circuit breaker. Connection failures (and failed health checks, see
:mod:`.health`) count as consecutive failures; at the threshold the instance is *ejected*: ranked
after every healthy instance, for a back-off that doubles with each ejection in a row (1 s, 2 s,
4 s ... up to the cap). Once the back-off is over the instance is *half-open*: one request may
try it (only when no health checks run; otherwise the next probe decides), and any success closes
the circuit and resets the back-off. Ejected instances are never dropped: when every instance of
a role is ejected they are still tried, soonest back-off end first, so a fleet that comes back
is used at once.

Separately, a prefill instance can be marked *unpairable* (:mod:`.pairing`: every decode instance
reports that it cannot read that prefill's KV). Its circuit is unaffected, but it is ranked after
every other instance (ejected ones included) until its retry time, when one request may try it
(its answer teaches the proxy its engine id, which changes when it restarts); each retry in a
row doubles the wait. Only the pairing watch clears the mark.

Pure bookkeeping, no I/O: time comes from an injectable clock, so the state machine can be tested
deterministically. The proxy runs on one asyncio event loop, so no locking is needed.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: The first ejection's back-off; each ejection in a row doubles it.
DEFAULT_BASE_BACKOFF_S = 1.0
#: Long enough that a dead instance costs little, short enough that a restarted one is back soon
#: (with health checks on, a passing probe readmits it sooner anyway).
DEFAULT_MAX_BACKOFF_S = 30.0
#: One connection failure is enough: the request never reached the instance, so the failure is
#: unambiguous, and each further attempt would cost a client a refused connection or a whole
#: connect timeout. A false ejection costs little: the first back-off is 1 s, the instance is
#: still tried when no other is left, and one success readmits it.
DEFAULT_FAILURE_THRESHOLD = 1
#: An unpairable prefill instance gets one request after this long, doubling up to the cap:
#: each such trial costs one wasted prefill if it is still unpairable, and finding a restarted,
#: fixed instance within minutes is soon enough.
DEFAULT_UNPAIRABLE_RETRY_S = 30.0
DEFAULT_MAX_UNPAIRABLE_RETRY_S = 300.0


class CircuitState(str, enum.Enum):
    """Where an instance stands with routing."""

    HEALTHY = "healthy"  # circuit closed: routed normally
    EJECTED = "ejected"  # back-off running: ranked after every healthy instance
    HALF_OPEN = "half-open"  # back-off over: the next success readmits, a failure re-ejects


@dataclass(frozen=True)
class EjectionPolicy:
    """When a failing instance is taken out of rotation, and for how long."""

    failure_threshold: int = DEFAULT_FAILURE_THRESHOLD
    base_backoff_s: float = DEFAULT_BASE_BACKOFF_S
    max_backoff_s: float = DEFAULT_MAX_BACKOFF_S

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError(
                f"the ejection threshold must be at least 1 failure, got {self.failure_threshold}"
            )
        if self.base_backoff_s <= 0:
            raise ValueError(f"the ejection back-off must be positive, got {self.base_backoff_s}")
        if self.max_backoff_s < self.base_backoff_s:
            raise ValueError(
                f"the longest ejection ({self.max_backoff_s:g} s) must be at least the first "
                f"one ({self.base_backoff_s:g} s)"
            )

    def backoff_s(self, ejections_in_a_row: int) -> float:
        """The back-off of the n-th ejection in a row: base, 2 x base, 4 x base ..., capped."""
        doublings = min(max(ejections_in_a_row - 1, 0), 64)  # 2**64 x base exceeds any cap
        return min(self.max_backoff_s, self.base_backoff_s * 2.0**doublings)


@dataclass(eq=False)
class Upstream:
    """One vLLM instance: its proxied requests not finished yet, and its circuit breaker."""

    url: str
    in_flight: int = 0
    consecutive_failures: int = 0
    #: ejections since the last success; the back-off doubles with each
    ejections_in_a_row: int = 0
    #: clock time the current ejection's back-off ends (past: half-open); None: circuit closed
    ejected_until: float | None = None
    #: why the latest failure happened, for the readiness report and the logs
    last_failure: str | None = None
    #: a half-open instance's single trial request has been sent and not settled yet
    trial_in_flight: bool = False
    #: why no decode instance can read this (prefill) instance's KV; None: not known to be so
    unpairable: str | None = None
    #: clock time the next request may try an unpairable instance
    unpairable_retry_at: float | None = None
    #: trials of an unpairable instance so far (the wait doubles with each)
    unpairable_trials: int = 0


class Balancer:
    """Orders the instances of one role for each request; tracks their load and failures."""

    def __init__(
        self,
        role: str,
        urls: Sequence[str],
        policy: EjectionPolicy | None = None,
        *,
        request_trials: bool = True,
        clock: Callable[[], float] = time.monotonic,
        unpairable_retry: EjectionPolicy | None = None,
    ) -> None:
        """``request_trials``: whether a half-open instance is tried by one request (turn it off
        when health probes decide instead, so no client waits on an instance that may be dead).
        ``clock``: monotonic seconds; tests pass a fake one. ``unpairable_retry``: when an
        unpairable instance is tried again (its back-off schedule)."""
        if not urls:
            raise ValueError(f"at least one {role} instance URL is required")
        normalized = [url.rstrip("/") for url in urls]
        duplicates = sorted({url for url in normalized if normalized.count(url) > 1})
        if duplicates:
            raise ValueError(f"{role} instance URLs are listed more than once: {duplicates}")
        self.role = role
        self.policy = policy or EjectionPolicy()
        self.request_trials = request_trials
        self.unpairable_retry = unpairable_retry or EjectionPolicy(
            base_backoff_s=DEFAULT_UNPAIRABLE_RETRY_S, max_backoff_s=DEFAULT_MAX_UNPAIRABLE_RETRY_S
        )
        self.upstreams = [Upstream(url) for url in normalized]
        self._clock = clock
        self._next_index = 0

    def state(self, upstream: Upstream) -> CircuitState:
        if upstream.ejected_until is None:
            return CircuitState.HEALTHY
        if upstream.ejected_until > self._clock():
            return CircuitState.EJECTED
        return CircuitState.HALF_OPEN

    def is_healthy(self, upstream: Upstream) -> bool:
        """Whether the circuit is closed (no ejection, nor a half-open one awaiting its trial)."""
        return upstream.ejected_until is None

    def healthy_count(self) -> int:
        return sum(self.is_healthy(upstream) for upstream in self.upstreams)

    def _held_unpairable(self, upstream: Upstream) -> bool:
        """Marked unpairable, and its next trial is not due yet."""
        return upstream.unpairable is not None and (upstream.unpairable_retry_at or 0.0) > (
            self._clock()
        )

    def _routable(self, upstream: Upstream) -> bool:
        """Healthy, or half-open with its one trial request still to be sent; and not held back
        as unpairable."""
        if self._held_unpairable(upstream):
            return False
        state = self.state(upstream)
        return state is CircuitState.HEALTHY or (
            state is CircuitState.HALF_OPEN and self.request_trials and not upstream.trial_in_flight
        )

    def only_unpairable_left(self) -> bool:
        """No instance is routable, and at least one is held back as unpairable: the others
        are ejected (down) or half-open (waiting for their probe)."""
        held = False
        for upstream in self.upstreams:
            if self._routable(upstream):
                return False
            held = held or self._held_unpairable(upstream)
        return held

    def mark_unpairable(self, upstream: Upstream, reason: str) -> float | None:
        """No decode instance can read ``upstream``'s KV: hold it back. Return the seconds until
        a request may try it again when this marks it, None when it was marked already (the
        reason is updated, the retry time kept)."""
        upstream.unpairable = reason
        if upstream.unpairable_retry_at is not None:
            return None
        upstream.unpairable_trials = 0
        retry_s = self.unpairable_retry.backoff_s(1)
        upstream.unpairable_retry_at = self._clock() + retry_s
        return retry_s

    def clear_unpairable(self, upstream: Upstream) -> bool:
        """A decode instance can read it again (or may): route it. Return whether it was
        marked."""
        was_marked = upstream.unpairable is not None
        upstream.unpairable = None
        upstream.unpairable_retry_at = None
        upstream.unpairable_trials = 0
        return was_marked

    def ranked(self) -> list[Upstream]:
        """Return every instance, best first: routable ones by fewest in-flight, then the
        round-robin order; after them the ejected ones, whose back-off ends soonest first.

        Callers try them in this order and use the first that accepts the connection, so an
        instance that is down costs one refused connection, not the request, and once ejected
        not even that.
        """
        count = len(self.upstreams)

        def rank(index: int) -> tuple[int, float, int, int]:
            upstream = self.upstreams[index]
            turn = (index - self._next_index) % count
            if self._routable(upstream):
                # an unpairable instance whose trial is due goes first, so the trial happens
                trial = -1 if upstream.unpairable is not None else 0
                return (0, 0.0, trial if trial else upstream.in_flight, turn)
            if self._held_unpairable(upstream):  # last resort: decode recomputes its prompts
                return (2, upstream.unpairable_retry_at or 0.0, upstream.in_flight, turn)
            return (1, upstream.ejected_until or 0.0, upstream.in_flight, turn)

        return [self.upstreams[index] for index in sorted(range(count), key=rank)]

    def acquire(self, upstream: Upstream) -> None:
        """Count a request against ``upstream`` and move the round-robin cursor past it; on a
        half-open instance the request is its trial."""
        if self.request_trials and self.state(upstream) is CircuitState.HALF_OPEN:
            upstream.trial_in_flight = True
        if upstream.unpairable is not None and not self._held_unpairable(upstream):
            # the trial: until its answer (its engine id) clears the mark, wait longer
            upstream.unpairable_trials += 1
            retry_s = self.unpairable_retry.backoff_s(upstream.unpairable_trials + 1)
            upstream.unpairable_retry_at = self._clock() + retry_s
        upstream.in_flight += 1
        self._next_index = (self.upstreams.index(upstream) + 1) % len(self.upstreams)

    def release(self, upstream: Upstream) -> None:
        """Stop counting a request that ``upstream`` finished (or that failed).

        A trial that ended without a verdict (the client left while connecting) is over too, so
        another request may try the instance.
        """
        if upstream.in_flight <= 0:
            raise RuntimeError(f"{self.role} instance {upstream.url} released more than acquired")
        upstream.in_flight -= 1
        upstream.trial_in_flight = False

    def record_failure(self, upstream: Upstream, cause: str) -> float | None:
        """Count a connection (or health-check) failure; return the back-off in seconds when it
        ejected the instance, None when it did not (below the threshold, or already ejected:
        a failure during the back-off confirms the ejection without lengthening it)."""
        upstream.consecutive_failures += 1
        upstream.last_failure = cause
        upstream.trial_in_flight = False
        if self.state(upstream) is CircuitState.EJECTED:
            return None
        if upstream.consecutive_failures < self.policy.failure_threshold:
            return None
        upstream.ejections_in_a_row += 1
        backoff_s = self.policy.backoff_s(upstream.ejections_in_a_row)
        upstream.ejected_until = self._clock() + backoff_s
        return backoff_s

    def record_success(self, upstream: Upstream) -> bool:
        """The instance answered: close its circuit and reset the back-off. Return whether it
        had been ejected (so the caller can report it readmitted)."""
        was_ejected = upstream.ejected_until is not None
        upstream.consecutive_failures = 0
        upstream.ejections_in_a_row = 0
        upstream.ejected_until = None
        upstream.trial_in_flight = False
        return was_ejected

    def report(self, upstream: Upstream) -> dict[str, Any]:
        """The instance as routing sees it, for the readiness view."""
        remaining_s = None
        if upstream.ejected_until is not None:
            remaining_s = max(0.0, upstream.ejected_until - self._clock())
        state = self.state(upstream).value
        retry_s = None
        if upstream.unpairable is not None:
            retry_s = max(0.0, (upstream.unpairable_retry_at or 0.0) - self._clock())
            if state == CircuitState.HEALTHY.value:  # a dead instance's ejection says more
                state = "unpairable"
        return {
            "url": upstream.url,
            "state": state,
            "healthy": self.is_healthy(upstream),
            "in_flight": upstream.in_flight,
            "consecutive_failures": upstream.consecutive_failures,
            "ejected_for_s": remaining_s,
            "last_failure": upstream.last_failure,
            "unpairable": upstream.unpairable,
            "unpairable_retry_in_s": retry_s,
        }
