"""The proxy's Prometheus metrics (``GET /metrics``): per-leg latency, fallbacks, load.

Each app has a registry of its own (several apps in one process, as in the tests, do not clash),
fed from the request's :class:`~vllm_ascend_mooncake.timeline` stamps when its answer is over,
and from the routing decisions as they happen. In-flight requests per instance are read from
the balancers at scrape time, so the gauge never drifts from what routing sees.
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


class _InFlight(Collector):
    def __init__(self, balancers: Iterable[Balancer]) -> None:
        self._balancers = list(balancers)

    def collect(self):
        gauge = GaugeMetricFamily(
            "vam_proxy_in_flight_requests",
            "requests the proxy has sent to an instance and not finished",
            labels=["role", "instance"],
        )
        for balancer in self._balancers:
            for upstream in balancer.upstreams:
                gauge.add_metric([balancer.role, upstream.url], upstream.in_flight)
        yield gauge


class ProxyMetrics:
    """Counters and histograms of one proxy app."""

    def __init__(self, balancers: Iterable[Balancer]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "vam_proxy_requests",
            "generation requests answered through both legs, by how the legs ran",
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
            "decode legs sent again because prefill did not hold the KV under the transfer id",
            registry=self.registry,
        )
        self.registry.register(_InFlight(balancers))

    def observe(self, mode: str, stamps: Mapping[str, float]) -> None:
        """Record a request whose answer is over, from its timeline stamps."""
        self.requests.labels(mode).inc()
        for leg, start, ends in LEGS:
            end = next((stamps[name] for name in ends if name in stamps), None)
            if start in stamps and end is not None:
                self.leg_seconds.labels(leg).observe(max(0.0, end - stamps[start]))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
