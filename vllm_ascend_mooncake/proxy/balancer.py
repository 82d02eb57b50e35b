"""Instance selection for one role (prefill or decode): least in-flight requests, round-robin ties.

Requests to vLLM differ wildly in cost, so counting what each instance is still working on
spreads load better than plain rotation; the rotation only breaks ties, which keeps an idle
fleet evenly used. The proxy runs on one asyncio event loop, so no locking is needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(eq=False)
class Upstream:
    """One vLLM instance and the number of proxied requests it has not finished yet."""

    url: str
    in_flight: int = 0


class Balancer:
    """Orders the instances of one role for each request and tracks their in-flight requests."""

    def __init__(self, role: str, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError(f"at least one {role} instance URL is required")
        normalized = [url.rstrip("/") for url in urls]
        duplicates = sorted({url for url in normalized if normalized.count(url) > 1})
        if duplicates:
            raise ValueError(f"{role} instance URLs are listed more than once: {duplicates}")
        self.role = role
        self.upstreams = [Upstream(url) for url in normalized]
        self._next_index = 0

    def ranked(self) -> list[Upstream]:
        """Return every instance, best first: fewest in-flight, then the round-robin order.

        Callers try them in this order and use the first that accepts the connection, so an
        instance that is down costs one refused connection, not the request.
        """
        count = len(self.upstreams)
        order = sorted(
            range(count),
            key=lambda index: (
                self.upstreams[index].in_flight,
                (index - self._next_index) % count,
            ),
        )
        return [self.upstreams[index] for index in order]

    def acquire(self, upstream: Upstream) -> None:
        """Count a request against ``upstream`` and move the round-robin cursor past it."""
        upstream.in_flight += 1
        self._next_index = (self.upstreams.index(upstream) + 1) % len(self.upstreams)

    def release(self, upstream: Upstream) -> None:
        """Stop counting a request that ``upstream`` finished (or that failed)."""
        if upstream.in_flight <= 0:
            raise RuntimeError(f"{self.role} instance {upstream.url} released more than acquired")
        upstream.in_flight -= 1
