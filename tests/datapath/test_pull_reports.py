"""What the decode side reports to vLLM: ``PullReports`` alone, then end to end.

The first tests, without threads or peers, pin each method's effect on the state vLLM waits on;
the last ones check the same rules end to end on the in-process cluster
(``receiver_cluster.py``), as the receiver's tests (``test_receiver.py``) do.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from vllm_ascend_mooncake.datapath.failures import FailureKind, PullCancelled, PullError
from vllm_ascend_mooncake.datapath.orders import PullOrder
from vllm_ascend_mooncake.datapath.pull_reports import PullReports, PullStats


def order(request_id: str, blocks=(1, 2)) -> PullOrder:
    return PullOrder(request_id, request_id, tuple(blocks), (3, 4), "h", 1, "engine-p")


def test_a_pull_is_reported_once_loaded_or_failed() -> None:
    reports = PullReports()
    for request_id in ("ok", "bad"):
        assert reports.admit(order(request_id)) is None
    reports.finish(order("ok"), None)
    reports.finish(order("bad"), PullError(FailureKind.REFUSED, "no"))
    done, failed = reports.take_finished()
    assert done == {"ok"}
    assert failed["bad"].local_block_ids == (1, 2) and failed["bad"].kind is FailureKind.REFUSED
    assert failed["bad"].prefill_engine_id == "engine-p" and not failed["bad"].cancelled
    assert reports.take_finished() == (set(), {})


def test_only_a_pull_in_flight_can_be_cancelled() -> None:
    reports = PullReports()
    reports.cancel("not-admitted")
    reports.check_cancelled(order("not-admitted"))  # nothing to give up
    reports.admit(order("a"))
    reports.cancel("a")
    with pytest.raises(PullCancelled):
        reports.check_cancelled(order("a"))
    reports.finish(order("a"), None)
    reports.check_cancelled(order("a"))  # ended: the cancel is forgotten with it


def test_sleep_interrupts_pulls_in_flight_and_fails_new_ones() -> None:
    reports = PullReports()
    reports.admit(order("a"))
    started = time.monotonic()
    reports.suspend("asleep", timeout_s=0.05)  # "a" never ends: the wait runs out
    assert time.monotonic() - started >= 0.05
    with pytest.raises(PullError) as interrupted:
        reports.check_cancelled(order("a"))
    assert interrupted.value.kind is FailureKind.UNAVAILABLE_HERE
    assert reports.admit(order("b")) == "asleep"
    reports.resume()
    assert reports.admit(order("c")) is None


def test_a_forgotten_pull_is_never_reported_and_never_waited_for() -> None:
    reports = PullReports()
    reports.admit(order("unsettled"))
    reports.forget("unsettled")
    started = time.monotonic()
    reports.suspend("asleep", timeout_s=5.0)  # nothing in flight: returns at once
    reports.wait_for_news(5.0)
    assert time.monotonic() - started < 1.0
    assert reports.take_finished() == (set(), {})


def test_stats_are_taken_once() -> None:
    reports = PullReports()
    stats = PullStats("a", 10, 1, 0.1)
    reports.record_stats(stats)
    assert reports.take_stats() == [stats]
    assert reports.take_stats() == []


# -- end to end, on the in-process cluster ----------------------------------------------------


def test_a_release_only_pull_frees_prefill_and_is_never_reported(cluster) -> None:
    c = cluster(4, prefill_tp=2, decode_tp=1)
    (decode,) = c.decode
    c.pull("r1", [], [3, 4])
    assert all(c.freed(p, "r1") for p in c.prefill)
    assert all(p.notices == [("t-r1", 0, True)] for p in c.prefill)
    time.sleep(0.1)
    assert decode.receiver.take_finished() == (set(), {})
    assert decode.transport.num_reads == 0
    assert np.array_equal(decode.cache.bytes, decode.snapshot)


def test_a_pull_cancelled_before_its_grant_is_reported_cancelled(cluster) -> None:
    c = cluster(4, prefill_tp=1, decode_tp=1)
    (decode,) = c.decode
    decode.receiver.submit(c.order("r1", [1, 2], [3, 4], early=True))
    time.sleep(0.1)  # its claim waits: prefill never holds it
    started = time.monotonic()
    decode.receiver.cancel("r1")
    decode.wait(["r1"], timeout_s=2.0)
    assert time.monotonic() - started < 1.0  # the cancel, not prefill_wait_s, ended it
    failure = decode.failed["r1"]
    assert failure.cancelled and failure.local_block_ids == (1, 2)
    assert decode.transport.num_reads == 0
    assert np.array_equal(decode.cache.bytes, decode.snapshot)
