"""The proxy's Prometheus metrics (``GET /metrics``): per-leg latency, fallbacks, load, health.

Each app has a registry of its own (several apps in one process, as in the tests, do not clash),
fed from the request's :class:`~vllm_ascend_mooncake.timeline` stamps when its answer is over,
and from the routing decisions as they happen. In-flight requests and health per instance are
read from the balancers at scrape time, so the gauges never drift from what routing sees.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .balancer import Balancer

#: (leg label, start stamp, end stamps in order of preference) of the latency histogram.
LEGS = (
    ("prefill", "prefill_sent", ("prefill_answered",)),
    ("decode_first_chunk", "decode_sent", ("first_chunk", "decode_answered")),
    ("time_to_first_chunk", "received", ("first_chunk", "decode_answered")),
    ("total", "received", ("done",)),
)
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _UpstreamGauges(Collector):
    """Per-instance gauges read from the balancers when scraped."""

    def __init__(self, balancers: Iterable[Balancer]) -> None:
        self._balancers = list(balancers)

    def collect(self):
        in_flight = GaugeMetricFamily(
            "vam_proxy_in_flight_requests",
            "requests the proxy has sent to an instance and not finished",
            labels=["role", "instance"],
        )
        healthy = GaugeMetricFamily(
            "vam_proxy_upstream_healthy",
            "1 while an instance's circuit is closed, 0 while it is ejected or half-open",
            labels=["role", "instance"],
        )
        for balancer in self._balancers:
            for upstream in balancer.upstreams:
                labels = [balancer.role, upstream.url]
                in_flight.add_metric(labels, upstream.in_flight)
                healthy.add_metric(labels, 1 if balancer.is_healthy(upstream) else 0)
        yield in_flight
        yield healthy


class ProxyMetrics:
    """Counters and histograms of one proxy app."""

    def __init__(self, balancers: Iterable[Balancer]) -> None:
        balancers = list(balancers)
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "vam_proxy_requests",
            "generation requests answered, by how the legs ran (decode_alone: no prefill leg, "
            "every prefill instance left being one no decode can read)",
            ["legs"],
            registry=self.registry,
        )
        self.leg_seconds = Histogram(
            "vam_proxy_leg_seconds",
            "seconds per leg of a P/D request, seen from the proxy",
            ["leg"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.failovers = Counter(
            "vam_proxy_failovers",
            "connections an instance refused, after which the next instance was tried",
            ["role"],
            registry=self.registry,
        )
        self.serial_fallbacks = Counter(
            "vam_proxy_serial_fallbacks",
            "overlapped requests that went serial because the known prefill refused them",
            registry=self.registry,
        )
        self.decode_resends = Counter(
            "vam_proxy_decode_resends",
            "decode legs sent again because prefill did not hold the KV under the transfer id "
            "or on the engine decode was told",
            registry=self.registry,
        )
        self.decode_first_tokens = Counter(
            "vam_proxy_decode_first_tokens",
            "requests whose first token decode sampled again instead of continuing from "
            "prefill's, by the reason (a parameter, 'asked' by flag or header, or 'other': an "
            "unknown parameter or header value)",
            ["reason"],
            registry=self.registry,
        )
        self.hold_renewals = Counter(
            "vam_proxy_hold_renewals",
            "prefill holds renewed while their decode request may have been queued",
            registry=self.registry,
        )
        self.ejections = Counter(
            "vam_proxy_ejections",
            "times an instance was taken out of rotation after failing to accept connections "
            "or its health check",
            ["role", "instance"],
            registry=self.registry,
        )
        for balancer in balancers:  # exported at 0 from the start, so increase() sees the first
            for upstream in balancer.upstreams:
                self.ejections.labels(balancer.role, upstream.url)
        self.registry.register(_UpstreamGauges(balancers))

    def observe(self, mode: str, stamps: Mapping[str, float]) -> None:
        """Record a request whose answer is over, from its timeline stamps."""
        self.requests.labels(mode).inc()
        for leg, start, ends in LEGS:
            end = next((stamps[name] for name in ends if name in stamps), None)
            if start in stamps and end is not None:
                self.leg_seconds.labels(leg).observe(max(0.0, end - stamps[start]))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
