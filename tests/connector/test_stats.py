"""Transfer statistics: aggregation across workers, the logged summary, Prometheus metrics."""

from __future__ import annotations

import pickle

import prometheus_client
from prometheus_client import Counter, Gauge, Histogram

from vllm_ascend_mooncake.connector.stats import (
    MAX_UNPAIRABLE_ENGINE_LABELS,
    TransferPromMetrics,
    TransferStats,
)
from vllm_ascend_mooncake.datapath.failures import FailureKind
from vllm_ascend_mooncake.datapath.pairing import PairingOutcome, PairingVerdict
from vllm_ascend_mooncake.timeline import PHASES, PullTimeline


def test_worker_stats_aggregate_and_reduce() -> None:
    a, b = TransferStats(), TransferStats()
    a.record_pull(0.5, 10_000_000, 8)
    b.record_pull(1.5, 30_000_000, 16)
    b.record_failure(FailureKind.TRANSFER)
    a.record_failure(FailureKind.REFUSED)
    b.record_failure(FailureKind.TRANSFER)
    b.record_expired(2)
    wire = pickle.loads(pickle.dumps(b.take()))  # crosses processes as a pickled dict
    assert b.take() is None  # take() resets
    total = a.take().aggregate(TransferStats(data=wire.data))
    summary = total.reduce()
    assert summary["Num successful pulls"] == 2
    assert summary["Num failed pulls"] == 3
    assert summary["Num failed pulls (transfer)"] == 2
    assert summary["Num failed pulls (refused)"] == 1
    assert summary["Num expired releases"] == 2
    assert summary["Avg pull time (ms)"] == 1000.0
    assert summary["Total MB pulled"] == 40.0
    assert summary["Avg descriptors per pull"] == 12.0


def registered_metrics(
    per_engine_labels: dict[int, list[str]],
) -> tuple[prometheus_client.CollectorRegistry, TransferPromMetrics]:
    """The connector's Prometheus metrics (label ``engine``) in a registry of their own."""
    registry = prometheus_client.CollectorRegistry()

    def bind(cls):
        class Bound(cls):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, registry=registry, **kwargs)

        return Bound

    types = {Gauge: bind(Gauge), Counter: bind(Counter), Histogram: bind(Histogram)}

    class Config:
        kv_transfer_config = None

    return registry, TransferPromMetrics(Config(), types, ["engine"], per_engine_labels)


def test_prometheus_metrics_follow_observations() -> None:
    registry, metrics = registered_metrics({0: ["0"]})
    stats = TransferStats()
    stats.record_pull(0.02, 4096, 3, {"grant_wait": 0.04, "read": 0.003})
    stats.record_failure(FailureKind.PEER_UNAVAILABLE)
    stats.record_failure(FailureKind.PEER_UNAVAILABLE)
    stats.record_failure(FailureKind.INTEGRITY)
    stats.record_hold_delay(0.002)
    metrics.observe(stats.take().data, engine_idx=0)
    for phase, total in (("grant_wait", 0.04), ("read", 0.003), ("fixup", None)):
        labels = {"engine": "0", "phase": phase}
        name = "vllm:mooncake_hetero_pull_phase_seconds"
        assert registry.get_sample_value(f"{name}_sum", labels) == (total or 0.0)
        assert registry.get_sample_value(f"{name}_count", labels) == (1 if total else 0)
    hold = "vllm:mooncake_hetero_hold_delay_seconds_sum"
    assert registry.get_sample_value(hold, {"engine": "0"}) == 0.002
    assert (
        registry.get_sample_value("vllm:mooncake_hetero_pulled_bytes_total", {"engine": "0"})
        == 4096
    )
    failed = "vllm:mooncake_hetero_failed_pulls_total"
    for kind, count in (("peer_unavailable", 2), ("integrity", 1), ("transfer", 0)):
        assert registry.get_sample_value(failed, {"engine": "0", "kind": kind}) == count
    # a kind this version does not know (an older or newer worker's) is counted, as internal
    metrics.observe({"failed_pulls": ["from_the_future"]}, engine_idx=0)
    assert registry.get_sample_value(failed, {"engine": "0", "kind": "internal"}) == 1
    assert (
        registry.get_sample_value("vllm:mooncake_hetero_pull_seconds_count", {"engine": "0"}) == 1
    )


def test_unpairable_prefill_engines_are_counted_once_each_under_a_bounded_label() -> None:
    registry, metrics = registered_metrics({0: ["0"], 1: ["1"]})
    name = "vllm:mooncake_hetero_unpairable_prefill_engines_total"
    stats = TransferStats()
    stats.record_unpairable("prefill-a", "kv cache dtype bfloat16 differs from float16")
    stats.record_unpairable("prefill-a", "again, from another pull")
    stats.record_pairing(PairingVerdict("prefill-b", PairingOutcome.REFUSED, "other geometry"))
    stats.record_pairing(PairingVerdict("prefill-c", PairingOutcome.PAIRED))
    stats.record_pairing(PairingVerdict("prefill-d", PairingOutcome.UNREACHABLE, "down"))
    metrics.observe(pickle.loads(pickle.dumps(stats.take())).data, engine_idx=0)
    metrics.observe({"unpairable_engines": [["prefill-a", "a later report"]]}, engine_idx=0)
    metrics.observe({"unpairable_engines": [["prefill-a", "another engine's"]]}, engine_idx=1)

    def value(engine: str, prefill_engine: str) -> float | None:
        return registry.get_sample_value(name, {"engine": engine, "prefill_engine": prefill_engine})

    assert value("0", "prefill-a") == 1 and value("1", "prefill-a") == 1
    assert value("0", "prefill-b") == 1
    assert value("0", "prefill-c") is None and value("0", "prefill-d") is None
    # the reason is no label: the decode's log has it
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name.startswith("vllm:mooncake_hetero_unpairable"):
                assert set(sample.labels) == {"engine", "prefill_engine"}
    # engine ids change with each prefill restart: past the bound they share "other"
    many = [[f"restart-{index}", "why"] for index in range(MAX_UNPAIRABLE_ENGINE_LABELS + 5)]
    metrics.observe({"unpairable_engines": many}, engine_idx=0)
    labelled = {
        sample.labels["prefill_engine"]
        for metric in registry.collect()
        for sample in metric.samples
        if sample.name == name
    }
    assert len(labelled) == MAX_UNPAIRABLE_ENGINE_LABELS + 1  # "other" included
    assert value("0", "other") == 7  # prefill-a and prefill-b took 2 of the labels


def test_timeline_phases_follow_the_stamps_reached() -> None:
    timeline = PullTimeline(submitted=10.0)
    assert timeline.phases() == {}
    timeline.granted = 10.5
    timeline.mark_first_read(10.7)
    timeline.mark_first_read(10.6)  # the earliest lane to start counts
    timeline.landed, timeline.fixed_up = 10.9, 11.0
    phases = timeline.phases()
    assert list(phases) == list(PHASES[:4])  # not reported yet
    assert [round(v, 6) for v in phases.values()] == [0.5, 0.1, 0.3, 0.1]
    timeline.reported = 11.25
    assert round(timeline.phases()["report_wait"], 6) == 0.25


def test_phase_means_are_logged_per_interval() -> None:
    stats = TransferStats()
    stats.record_pull(0.01, 100, 1, {"grant_wait": 0.03, "read": 0.002})
    stats.record_pull(0.01, 100, 1, {"grant_wait": 0.05, "read": 0.004})
    stats.record_hold_delay(0.001)
    summary = stats.take().reduce()
    assert summary["Avg grant wait (ms)"] == 40.0
    assert summary["Avg read (ms)"] == 3.0
    assert summary["Avg hold delay (ms)"] == 1.0
    assert "Avg fixup (ms)" not in summary  # nothing observed
