"""The chaos run's attribution: each error and failed pull to the fault that caused it."""

from __future__ import annotations

import datetime

from benchmarks.e2e.fault_attribution import (
    UNATTRIBUTED,
    causes,
    count_by_cause,
    failed_pulls,
    fault_windows,
)

EVENTS = {
    "prefill B killed": 3.0,
    "prefill B back": 24.0,
    "prefill A frozen": 27.0,
    "prefill A thawed": 47.0,
    "link slowed": 51.0,
}


def test_each_fault_is_a_window_widened_by_its_lag() -> None:
    windows = {w.name: (w.start, w.end) for w in fault_windows(EVENTS, 80.0, lag=5.0)}
    assert windows == {
        "prefill B killed": (3.0, 29.0),
        "prefill A frozen": (27.0, 52.0),
        "link slowed": (51.0, 85.0),
    }
    assert fault_windows({}, 80.0, lag=5.0) == []


def test_errors_go_to_every_fault_they_overlap_and_others_are_unattributed() -> None:
    windows = fault_windows(EVENTS, 80.0, lag=5.0)
    assert causes(10.0, 12.0, windows) == ["prefill B killed"]
    assert causes(28.0, 28.5, windows) == ["prefill B killed", "prefill A frozen"]
    assert causes(0.0, 2.5, windows) == [UNATTRIBUTED]
    counts = count_by_cause([(10.0, 12.0), (28.0, 28.5), (0.0, 2.0)], windows)
    assert counts == {"prefill B killed": 2, "prefill A frozen": 1, UNATTRIBUTED: 1}


def test_decode_logs_failed_pulls_are_read_with_their_stamps() -> None:
    started = datetime.datetime(2026, 12, 6, 12, 34, 40, 500000)
    log = (
        "(EngineCore pid=9) INFO 12-06 12:34:41 [worker.py:380] KV load of request a cancelled\n"
        "(EngineCore pid=9) WARNING 12-06 12:35:10 [worker.py:384] KV load failed for request "
        "cmpl-7-0 (peer_unavailable): prefill 10.0.0.1:20001 did not answer within 5000 ms\n"
    )
    (pull,) = failed_pulls(log, started)
    assert (pull.seconds, pull.request, pull.kind) == (30.0, "cmpl-7-0", "peer_unavailable")
    assert pull.reason.startswith("prefill 10.0.0.1:20001")
