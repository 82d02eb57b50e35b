"""Upstream health: background ``GET /health`` probes, and the one place outcomes reach routing.

Requests find a dead instance only by paying for it (a refused connection, or a whole connect
timeout when packets are dropped). The probes find it first, and find it back: every
``interval_s`` each instance's ``/health`` is asked with a short timeout, on the proxy's event
loop next to the requests (they never wait on a probe). A failed probe (no connection, a timeout,
or any status but 200, which is what vLLM answers once its engine died) counts like a failed
connection; a passing probe readmits an ejected instance at once.

:class:`UpstreamOutcomes` feeds both sources to the balancers, counts ejections and logs state
changes only (WARNING on ejection, INFO on readmission), never once per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import httpx

from .balancer import Balancer, CircuitState, Upstream
from .errors import describe_error
from .metrics import ProxyMetrics
from .pairing import PairingWatch

logger = logging.getLogger(__name__)

#: Often enough that a restarted instance is back within seconds, rare enough to cost nothing.
DEFAULT_HEALTH_INTERVAL_S = 5.0
#: vLLM answers ``/health`` from its API server's state, without asking the engine: a live
#: instance takes milliseconds, so 2 s only fails an instance that is hung or unreachable.
DEFAULT_HEALTH_TIMEOUT_S = 2.0


class UpstreamOutcomes:
    """Reports connection and probe outcomes to the balancers; logs and counts ejections."""

    def __init__(self, metrics: ProxyMetrics) -> None:
        self.metrics = metrics

    def failed(self, balancer: Balancer, upstream: Upstream, cause: str) -> None:
        """``upstream`` did not accept a connection, or failed its health check."""
        backoff_s = balancer.record_failure(upstream, cause)
        if backoff_s is not None:
            self.metrics.ejections.labels(balancer.role, upstream.url).inc()
            if balancer.healthy_count() == 0:
                meanwhile = f"every {balancer.role} instance is ejected; requests still try them"
            else:
                meanwhile = f"requests go to the other {balancer.role} instances meanwhile"
            logger.warning(
                "%s instance %s ejected for %g s (ejection %d in a row, after %d consecutive "
                "failure(s); last: %s); %s",
                balancer.role,
                upstream.url,
                backoff_s,
                upstream.ejections_in_a_row,
                upstream.consecutive_failures,
                cause,
                meanwhile,
            )
        elif balancer.state(upstream) is CircuitState.HEALTHY:
            logger.info(
                "%s instance %s failed (%s): %d of the %d consecutive failures that eject it",
                balancer.role,
                upstream.url,
                cause,
                upstream.consecutive_failures,
                balancer.policy.failure_threshold,
            )
        else:  # already ejected: the failure only confirms it
            logger.debug("%s instance %s still failing: %s", balancer.role, upstream.url, cause)

    def succeeded(self, balancer: Balancer, upstream: Upstream, how: str) -> None:
        """``upstream`` accepted a request, or passed its health check."""
        failures = upstream.consecutive_failures
        if balancer.record_success(upstream):
            logger.info(
                "%s instance %s readmitted after %d consecutive failure(s): %s",
                balancer.role,
                upstream.url,
                failures,
                how,
            )


class HealthChecker:
    """Probes every instance's ``/health`` in the background while the app runs."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        balancers: Sequence[Balancer],
        outcomes: UpstreamOutcomes,
        interval_s: float = DEFAULT_HEALTH_INTERVAL_S,
        timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"the health-check interval must be positive, got {interval_s}")
        if timeout_s <= 0:
            raise ValueError(f"the health-check timeout must be positive, got {timeout_s}")
        self.client = client
        self.balancers = list(balancers)
        self.outcomes = outcomes
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._first_round_done = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: set by the app: after each round's probes, reads which prefill engines the decode
        #: instances cannot read (:mod:`.pairing`)
        self.pairing: PairingWatch | None = None

    def start(self) -> None:
        """Start probing: the first round at once, then one every ``interval_s``."""
        if self._task is not None:
            raise RuntimeError("the health checks are already running")
        self._task = asyncio.create_task(self._run(), name="vam-proxy-health-checks")

    async def stop(self) -> None:
        """Stop probing and wait until no probe is left running."""
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None

    async def wait_first_round(self) -> None:
        """Return once every instance has been probed once (at most one probe timeout after the
        start), so a readiness check at start-up reports what the probes saw, not a guess."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._first_round_done.wait(), timeout=self.timeout_s + 1.0)

    async def check_all(self) -> None:
        """Probe every instance once, all at the same time; then (the probes having said which
        decode instances are healthy) read what those report of prefill engines."""
        await asyncio.gather(
            *(
                self.probe(balancer, upstream)
                for balancer in self.balancers
                for upstream in balancer.upstreams
            )
        )
        if self.pairing is not None:
            await self.pairing.check()

    async def probe(self, balancer: Balancer, upstream: Upstream) -> None:
        """Ask one instance's ``/health``: healthy only if it answers 200 within the timeout.

        A connection that breaks without an answer is asked again once on a new connection:
        a server closing an idle keep-alive connection just as the probe reuses it ("Server
        disconnected without sending a response") says nothing about the instance. A timeout
        or a refused connection counts at once."""
        url = f"{upstream.url}/health"
        try:
            try:
                response = await self.client.get(url, timeout=self.timeout_s)
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
                async with httpx.AsyncClient() as fresh:
                    response = await fresh.get(url, timeout=self.timeout_s)
        except httpx.HTTPError as error:
            self.outcomes.failed(balancer, upstream, f"health check: {describe_error(error)}")
            return
        if response.status_code == 200:
            self.outcomes.succeeded(balancer, upstream, "its health check answered 200")
        else:
            self.outcomes.failed(
                balancer, upstream, f"health check answered {response.status_code}"
            )

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_round = loop.time()
        while True:
            try:
                await self.check_all()
            except Exception:  # a bug here must not end the checks for good
                logger.exception("health-check round failed; the next one runs as planned")
            finally:
                self._first_round_done.set()
            # A fixed rate, but a round slower than the interval is not made up for in a burst.
            next_round = max(next_round + self.interval_s, loop.time())
            await asyncio.sleep(next_round - loop.time())


def readiness(prefill: Balancer, decode: Balancer) -> tuple[bool, dict[str, Any]]:
    """Whether both roles have a healthy instance, and every instance as routing sees it (its
    ejection's end as UTC wall-clock time, ISO 8601), for ``GET /ready``.

    A prefill instance marked unpairable (state ``unpairable``, the reason in ``unpairable``)
    still counts as healthy here: the proxy keeps serving, through the other prefill instances
    or decode alone (:mod:`.pairing`)."""

    def entry(balancer: Balancer, upstream: Upstream) -> dict[str, Any]:
        report = balancer.report(upstream)
        remaining_s = report["ejected_for_s"]
        report["ejected_until"] = (
            None
            if remaining_s is None
            else datetime.fromtimestamp(time.time() + remaining_s, timezone.utc).isoformat()
        )
        return report

    serving = prefill.healthy_count() > 0 and decode.healthy_count() > 0
    return serving, {
        "status": "ready" if serving else "unready",
        "prefill": [entry(prefill, upstream) for upstream in prefill.upstreams],
        "decode": [entry(decode, upstream) for upstream in decode.upstreams],
    }
