"""Transfer statistics: aggregation across workers, the logged summary, Prometheus metrics."""

from __future__ import annotations

import pickle

import prometheus_client
from prometheus_client import Counter, Gauge, Histogram

from vllm_ascend_mooncake.stats import TransferPromMetrics, TransferStats


def test_worker_stats_aggregate_and_reduce() -> None:
    a, b = TransferStats(), TransferStats()
    a.record_pull(0.5, 10_000_000, 8)
    b.record_pull(1.5, 30_000_000, 16)
    b.record_failure()
    b.record_expired(2)
    wire = pickle.loads(pickle.dumps(b.take()))  # crosses processes as a pickled dict
    assert b.take() is None  # take() resets
    total = a.take().aggregate(TransferStats(data=wire.data))
    summary = total.reduce()
    assert summary["Num successful pulls"] == 2
    assert summary["Num failed pulls"] == 1
    assert summary["Num expired releases"] == 2
    assert summary["Avg pull time (ms)"] == 1000.0
    assert summary["Total MB pulled"] == 40.0
    assert summary["Avg descriptors per pull"] == 12.0


def test_prometheus_metrics_follow_observations() -> None:
    registry = prometheus_client.CollectorRegistry()

    def bind(cls):
        class Bound(cls):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, registry=registry, **kwargs)

        return Bound

    types = {Gauge: bind(Gauge), Counter: bind(Counter), Histogram: bind(Histogram)}

    class Config:
        kv_transfer_config = None

    metrics = TransferPromMetrics(Config(), types, ["engine"], {0: ["0"]})
    stats = TransferStats()
    stats.record_pull(0.02, 4096, 3)
    stats.record_failure()
    metrics.observe(stats.take().data, engine_idx=0)
    assert (
        registry.get_sample_value("vllm:mooncake_hetero_pulled_bytes_total", {"engine": "0"})
        == 4096
    )
    assert (
        registry.get_sample_value("vllm:mooncake_hetero_failed_pulls_total", {"engine": "0"}) == 1
    )
    assert (
        registry.get_sample_value("vllm:mooncake_hetero_pull_seconds_count", {"engine": "0"}) == 1
    )
