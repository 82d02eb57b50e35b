"""How a deployment reads its instances' Prometheus pages: every end-to-end test's zero-failed-pulls
check and the fault tests' failures by kind rest on it, so it is checked against the text
prometheus_client writes for the connector's own metric shapes (a labelled counter, a histogram
per engine)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from vllm_ascend_mooncake.launch.prometheus import metric_samples, metric_sum
from vllm_ascend_mooncake.launch.servers import ServerError


def metrics_page() -> str:
    registry = CollectorRegistry()
    failed = Counter("vllm:mooncake_hetero_failed_pulls", "", ["engine", "kind"], registry=registry)
    failed.labels(engine="0", kind="refused").inc(2)
    failed.labels(engine="1", kind="refused").inc(1)
    failed.labels(engine="0", kind="transfer")  # exported at 0, as the connector pre-creates
    Counter("vam_proxy_decode_first_tokens", "", ["reason"], registry=registry)  # none yet
    pulls = Histogram("vllm:mooncake_hetero_pull_seconds", "", ["engine"], registry=registry)
    for engine, seconds in (("0", 0.1), ("0", 0.2), ("1", 0.3)):
        pulls.labels(engine=engine).observe(seconds)
    return generate_latest(registry).decode()


def test_samples_come_with_their_labels_and_sums_cover_every_label_set() -> None:
    page = metrics_page()
    samples = metric_samples(page, "vllm:mooncake_hetero_failed_pulls_total")
    assert sorted((labels["engine"], labels["kind"], value) for labels, value in samples) == [
        ("0", "refused", 2.0),
        ("0", "transfer", 0.0),
        ("1", "refused", 1.0),
    ]
    assert metric_sum(page, "vllm:mooncake_hetero_failed_pulls_total") == 3
    assert metric_sum(page, "vllm:mooncake_hetero_pull_seconds_count") == 3
    assert metric_sum(page, "vllm:mooncake_hetero_failed_pulls_total", {"kind": "refused"}) == 3
    assert metric_sum(page, "vllm:mooncake_hetero_failed_pulls_total", {"engine": "1"}) == 1
    # a label value no sample has yet: a counter not incremented yet, 0
    assert metric_sum(page, "vllm:mooncake_hetero_failed_pulls_total", {"kind": "bad_reply"}) == 0


def test_a_labelled_counter_nobody_incremented_counts_zero() -> None:
    page = metrics_page()
    assert metric_samples(page, "vam_proxy_decode_first_tokens_total") == []
    assert metric_sum(page, "vam_proxy_decode_first_tokens_total", {"reason": "seed"}) == 0


def test_a_metric_the_page_lacks_is_an_error_not_zero() -> None:
    with pytest.raises(ServerError, match="not exported"):
        metric_sum(metrics_page(), "vllm:mooncake_hetero_expired_releases_total")
    with pytest.raises(ServerError, match="not exported"):
        metric_sum(metrics_page(), "vllm:mooncake_hetero_pull")  # a prefix of one is not one
