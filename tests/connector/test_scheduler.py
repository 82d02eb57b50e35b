"""Scheduler side with real vLLM requests and block lists: pulls, holds, params, validation."""

from __future__ import annotations

import pytest
from vllm.v1.request import Request, RequestStatus

from vam_testing.scheduler_fakes import (
    connector_scheduler,
    kv_blocks,
    vllm_request,
)
from vllm_ascend_mooncake.connector.config import parse_config
from vllm_ascend_mooncake.connector.params import MAX_TRANSFER_ID_CHARS
from vllm_ascend_mooncake.connector.scheduler import ConnectorScheduler
from vllm_ascend_mooncake.datapath.orders import HoldOrder

BLOCK = 32


def scheduler(role: str) -> ConnectorScheduler:
    """TP 2 -> 1, 4 KV heads, prefill's side channel on port 40000."""
    return connector_scheduler(
        role, prefill_tp=2, num_kv_heads=4, block_size=BLOCK, extra={"side_channel_port": 40000}
    )


def request(request_id: str, num_tokens: int, params: dict | None) -> Request:
    return vllm_request(request_id, num_tokens, params)


blocks = kv_blocks


def prefill_params(num_tokens: int) -> dict:
    p = scheduler("kv_producer")
    req = request("p-1", num_tokens, {"do_remote_decode": True})
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = p.request_finished(req, ([7, 8, 9, 10, 11],))
    (held,) = p.build_step_orders().holds
    assert delay and (held.request_id, held.transfer_id) == ("p-1", "p-1")
    assert held.num_prompt_tokens == num_tokens
    return params


def overlapped_params(transfer_id: str = "t-1") -> dict:
    """What the proxy gives decode when it sends both legs at once: no block ids yet."""
    return {
        "do_remote_prefill": True,
        "remote_request_id": transfer_id,
        "remote_engine_id": "engine-p",
        "remote_host": "127.0.0.1",
        "remote_port": 40000,
        "remote_tp_size": 2,
    }


def test_prefill_holds_prompt_blocks_and_returns_params() -> None:
    params = prefill_params(70)  # 3 prompt blocks of 32; the 4th+ hold generated tokens
    assert params["remote_block_ids"] == [7, 8, 9]
    assert params["remote_request_id"] == "p-1" and params["remote_engine_id"] == "engine-p"
    assert (params["remote_host"], params["remote_port"], params["remote_tp_size"]) == (
        "127.0.0.1",
        40000,
        2,
    )
    assert params["do_remote_prefill"] and not params["do_remote_decode"]
    assert (params["remote_dp_rank"], params["remote_dp_size"]) == (0, 1)


def test_a_data_parallel_prefill_names_its_engine_and_port() -> None:
    """Engine 1 of 2 behind one API server: its own side-channel ports (base + rank * TP) and
    the index a proxy pins the next request to it with."""
    p = ConnectorScheduler(
        parse_config(
            kv_role="kv_producer",
            engine_id="engine-p_dp1",
            extra={
                "prefill": {"tp_size": 2, "dp_size": 2},
                "decode": {"tp_size": 1},
                "side_channel_port": 40000,
            },
            local_tp=2,
            local_dp=2,
            dp_rank=1,
            server_dp=(1, 2),
            num_kv_heads=4,
            is_mla=False,
            block_size=BLOCK,
            device_type="cpu",
        )
    )
    req = request("p-dp", 40, {"do_remote_decode": True})
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = p.request_finished(req, ([1, 2],))
    assert params["remote_engine_id"] == "engine-p_dp1" and params["remote_port"] == 40002
    assert (params["remote_dp_rank"], params["remote_dp_size"]) == (1, 2)


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR])
def test_prefill_frees_aborted_requests_at_once(status) -> None:
    p = scheduler("kv_producer")
    req = request("p-2", 40, {"do_remote_decode": True})
    req.status = status
    assert p.request_finished(req, ([1, 2],)) == (False, None)
    orders = p.build_step_orders()
    assert orders.holds == [] and orders.drops == []


def test_prefill_holds_under_the_proxys_transfer_id() -> None:
    p = scheduler("kv_producer")
    req = request("p-6", 70, {"do_remote_decode": True, "transfer_id": "t-6"})
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = p.request_finished(req, ([7, 8, 9, 10],))
    assert delay and params["remote_request_id"] == "t-6"
    assert p.build_step_orders().holds == [HoldOrder("p-6", "t-6", (7, 8, 9), 70)]


@pytest.mark.parametrize("transfer_id", ["", 7, "x" * (MAX_TRANSFER_ID_CHARS + 1)])
def test_prefill_ignores_unusable_transfer_ids(transfer_id) -> None:
    p = scheduler("kv_producer")
    req = request("p-7", 40, {"do_remote_decode": True, "transfer_id": transfer_id})
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = p.request_finished(req, ([1, 2],))
    assert params["remote_request_id"] == "p-7"


def test_a_request_id_longer_than_the_wire_carries_is_handed_off_under_a_bounded_id() -> None:
    """vLLM builds its request id from the client's X-Request-Id (#27 row 7): however long, the
    params decode receives must be accepted, so decode pulls (and frees prefill's hold)."""
    long_ids = [f"cmpl-{'a' * 250}-0-1a2b3c4d", f"cmpl-{'a' * 250}-0-5e6f7a8b"]
    p = scheduler("kv_producer")
    handed = []
    for request_id in long_ids:
        req = request(request_id, 70, {"do_remote_decode": True})
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        delay, params = p.request_finished(req, ([7, 8, 9],))
        assert delay
        handed.append(params)
    holds = p.build_step_orders().holds
    assert [hold.request_id for hold in holds] == long_ids
    transfer_ids = [params["remote_request_id"] for params in handed]
    assert [hold.transfer_id for hold in holds] == transfer_ids
    assert len(set(transfer_ids)) == 2  # ids differing only at their end stay apart
    assert all(len(transfer_id) <= MAX_TRANSFER_ID_CHARS for transfer_id in transfer_ids)
    d = scheduler("kv_consumer")
    req = request("d-long", 70, dict(handed[0]))
    assert d.get_num_new_matched_tokens(req, 0) == (70, True)
    d.update_state_after_alloc(req, blocks([4, 5, 6]), 70)
    (pull,) = d.build_step_orders().pulls
    assert pull.transfer_id == transfer_ids[0]


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR])
def test_prefill_drops_an_aborted_transfer_so_the_waiting_decode_is_refused(status) -> None:
    p = scheduler("kv_producer")
    req = request("p-8", 40, {"do_remote_decode": True, "transfer_id": "t-8"})
    req.status = status
    assert p.request_finished(req, ([1, 2],)) == (False, None)
    orders = p.build_step_orders()
    assert orders.holds == [] and orders.drops == ["t-8"]


def test_prefill_hands_off_when_its_token_is_eos() -> None:
    p = scheduler("kv_producer")
    req = request("p-3", 40, {"do_remote_decode": True})
    req.status = RequestStatus.FINISHED_STOPPED
    delay, params = p.request_finished(req, ([1, 2],))
    assert delay and params["remote_block_ids"] == [1, 2]


def test_decode_pulls_uncached_blocks_once() -> None:
    d = scheduler("kv_consumer")
    req = request("d-1", 70, prefill_params(70))
    assert d.get_num_new_matched_tokens(req, 0) == (70, True)
    assert d.get_num_new_matched_tokens(req, 0) == (70, True)  # side-effect free
    d.update_state_after_alloc(req, blocks([4, 5, 6]), 70)
    (pull,) = d.build_step_orders().pulls
    assert pull.local_block_ids == (4, 5, 6) and pull.remote_block_ids == (7, 8, 9)
    assert pull.transfer_id == "p-1" and pull.remote_port == 40000
    assert d.get_num_new_matched_tokens(req, 0) == (0, False)  # never twice
    assert d.build_step_orders().pulls == []


def test_decode_admitted_before_prefill_pulls_without_block_ids() -> None:
    d = scheduler("kv_consumer")
    req = request("d-6", 70, overlapped_params())
    assert d.get_num_new_matched_tokens(req, 0) == (70, True)
    d.update_state_after_alloc(req, blocks([4, 5, 6]), 70)
    (pull,) = d.build_step_orders().pulls
    assert pull.remote_block_ids is None and pull.local_block_ids == (4, 5, 6)
    assert (pull.transfer_id, pull.num_prompt_tokens) == ("t-1", 70)


def test_decode_admitted_before_prefill_with_a_prefix_hit_pulls_the_suffix() -> None:
    d = scheduler("kv_consumer")
    req = request("d-7", 70, overlapped_params())
    assert d.get_num_new_matched_tokens(req, 32) == (38, True)
    d.update_state_after_alloc(req, blocks([4, 5, 6]), 38)
    (pull,) = d.build_step_orders().pulls
    assert pull.local_block_ids == (5, 6) and pull.remote_block_ids is None


def test_decode_prefix_hit_reads_the_suffix_only() -> None:
    d = scheduler("kv_consumer")
    req = request("d-2", 70, prefill_params(70))
    assert d.get_num_new_matched_tokens(req, 32) == (38, True)
    d.update_state_after_alloc(req, blocks([4, 5, 6]), 38)
    (pull,) = d.build_step_orders().pulls
    assert pull.local_block_ids == (5, 6)


def test_decode_full_hit_still_releases_the_prefill_blocks() -> None:
    d = scheduler("kv_consumer")
    req = request("d-3", 64, prefill_params(64))
    assert d.get_num_new_matched_tokens(req, 64) == (0, False)
    d.update_state_after_alloc(req, blocks([]), 0)
    (pull,) = d.build_step_orders().pulls
    assert pull.local_block_ids == () and pull.transfer_id == "p-1"


@pytest.mark.parametrize("prefill_tp", [1, 2, 4, 8])
def test_decode_reads_a_prefill_of_any_tp_it_pairs_with(prefill_tp: int) -> None:
    """Configured for prefill TP 2, a decode instance also takes prefills of other sizes: the
    pull carries the size its params name."""
    d = scheduler("kv_consumer")
    params = prefill_params(64)
    params["remote_tp_size"] = prefill_tp
    req = request("d-tp", 64, params)
    assert d.get_num_new_matched_tokens(req, 0) == (64, True)
    d.update_state_after_alloc(req, blocks([5, 6]), 64)
    (pull,) = d.build_step_orders().pulls
    assert pull.remote_tp_size == prefill_tp and pull.local_block_ids == (5, 6)


def test_decode_request_aborted_before_scheduling_releases_prefill() -> None:
    d = scheduler("kv_consumer")
    req = request("d-4", 70, prefill_params(70))
    assert d.request_finished(req, ([],)) == (False, None)
    (pull,) = d.build_step_orders().pulls
    assert pull.local_block_ids == ()


@pytest.mark.parametrize(
    "corrupt,names_a_prefill",
    [
        (lambda p: p.update(remote_block_ids="lots"), True),
        (lambda p: p.update(remote_block_ids=[1, 2]), True),  # wrong count for the prompt
        (lambda p: p.update(remote_block_ids=[-1, 2, 3]), True),
        (lambda p: p.update(remote_port=70000), False),
        (lambda p: p.update(remote_tp_size=3), True),  # does not divide the 4 KV heads
        (lambda p: p.update(remote_tp_size=1 << 20), True),  # beyond any TP size
        (lambda p: p.update(remote_num_tokens=71), True),
        (lambda p: p.pop("remote_engine_id"), False),
        (lambda p: p.update(remote_host=""), False),
        # issue #43 item 2: ZMQ refused these only in connect(), leaking a socket per attempt
        (lambda p: p.update(remote_host="127.0.0.1 "), False),
        (lambda p: p.update(remote_host="a b"), False),
        (lambda p: p.update(remote_host="10.0.0.1\n"), False),
        (lambda p: p.update(remote_request_id="t" * (MAX_TRANSFER_ID_CHARS + 1)), False),
    ],
)
def test_decode_ignores_bad_params_computes_locally_and_frees_the_prefill(
    corrupt, names_a_prefill
) -> None:
    """Rejected params that still name a prefill get a release-only pull: prefill frees the
    blocks now, not at its release timeout."""
    d = scheduler("kv_consumer")
    params = prefill_params(70)
    corrupt(params)
    req = request("d-5", 70, params)
    assert d.get_num_new_matched_tokens(req, 0) == (0, False)
    assert req.kv_transfer_params["do_remote_prefill"] is False
    pulls = d.build_step_orders().pulls
    if names_a_prefill:
        (pull,) = pulls
        assert pull.release_only and pull.local_block_ids == ()
        assert (pull.transfer_id, pull.remote_port) == ("p-1", 40000)
    else:
        assert pulls == []
    assert d.request_finished(req, ([],)) == (False, None)
    assert d.build_step_orders().pulls == []  # released once


def output(recving=None, sending=None):
    from vllm.v1.outputs import KVConnectorOutput

    return KVConnectorOutput(finished_sending=sending, finished_recving=recving)


def test_decode_reports_only_loads_vllm_waits_for() -> None:
    """vLLM asserts on a finished id it is not waiting for, and that kills its engine core."""
    d = scheduler("kv_consumer")
    loading = request("d-10", 70, prefill_params(70))
    assert d.get_num_new_matched_tokens(loading, 0) == (70, True)
    d.update_state_after_alloc(loading, blocks([4, 5, 6]), 70)
    # prompt_logprobs make vLLM skip external KV: it allocates and loads nothing.
    skipped = request("d-11", 70, {**prefill_params(70), "remote_request_id": "p-11"})
    assert d.get_num_new_matched_tokens(skipped, 0) == (70, True)
    d.update_state_after_alloc(skipped, blocks([7, 8, 9]), 0)
    aborted = request("d-12", 70, {**prefill_params(70), "remote_request_id": "p-12"})
    assert d.request_finished(aborted, ([],)) == (False, None)
    pulls = d.build_step_orders().pulls
    assert [p.release_only for p in pulls] == [False, True, True]

    reported = output(recving={"d-10", "d-11", "d-12"})
    d.filter_output(reported)
    assert reported.finished_recving == {"d-10"}
    again = output(recving={"d-10"})  # each id reaches vLLM once
    d.filter_output(again)
    assert again.finished_recving is None


def test_prefill_reports_only_blocks_it_delayed_freeing() -> None:
    p = scheduler("kv_producer")
    held = request("p-20", 40, {"do_remote_decode": True})
    held.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert p.request_finished(held, ([1, 2],))[0]
    reported = output(sending={"p-20", "never-held"})
    p.filter_output(reported)
    assert reported.finished_sending == {"p-20"}


def test_sequences_of_one_request_pull_its_transfer_once() -> None:
    """n > 1: every sequence carries the same params, but prefill holds one copy and frees it
    after the first read; the other sequences compute locally instead of failing their pull."""
    d = scheduler("kv_consumer")
    params = prefill_params(70)
    first = request("0_d-20", 70, dict(params))
    second = request("1_d-20", 70, dict(params))
    assert d.get_num_new_matched_tokens(first, 0) == (70, True)
    assert d.get_num_new_matched_tokens(second, 0) == (0, False)
    assert second.kv_transfer_params["do_remote_prefill"] is False
    d.update_state_after_alloc(first, blocks([4, 5, 6]), 70)
    first.status = RequestStatus.FINISHED_LENGTH_CAPPED
    d.request_finished(first, ([4, 5, 6],))
    third = request("2_d-20", 70, dict(params))  # a later request naming it again: its own pull
    assert d.get_num_new_matched_tokens(third, 0) == (70, True)


def test_requests_aborted_while_loading_cancel_their_pull_and_are_still_reported() -> None:
    """vLLM keeps an aborted loading request's blocks until its load is reported: the workers are
    told to stop waiting for prefill, and the report still reaches vLLM exactly once."""
    d = scheduler("kv_consumer")
    leaving = request("d-30", 70, prefill_params(70))
    staying = request("d-31", 70, {**prefill_params(70), "remote_request_id": "p-31"})
    for r, ids in ((leaving, [4, 5, 6]), (staying, [7, 8, 9])):
        assert d.get_num_new_matched_tokens(r, 0) == (70, True)
        d.update_state_after_alloc(r, blocks(ids), 70)
    assert d.build_step_orders().cancels == []
    leaving.status = RequestStatus.FINISHED_ABORTED
    assert d.request_finished(leaving, ([4, 5, 6],)) == (False, None)
    orders = d.build_step_orders()
    assert orders.cancels == ["d-30"] and orders.pulls == []  # its pull is already under way
    reported = output(recving={"d-30", "d-31"})
    d.filter_output(reported)
    assert reported.finished_recving == {"d-30", "d-31"}
    staying.status = RequestStatus.FINISHED_LENGTH_CAPPED  # finished after its load: no cancel
    d.request_finished(staying, ([7, 8, 9],))
    assert d.build_step_orders().cancels == []


def test_timeline_stamps_a_load_from_admission_to_first_step(caplog, monkeypatch) -> None:
    """Decode's scheduler writes one timeline line per loaded request, at its first step, and
    keeps no stamps of requests that finished (no growth while requests come and go)."""
    import logging

    from vllm_ascend_mooncake.connector import scheduler as scheduler_module
    from vllm_ascend_mooncake.timeline import TimelineLog, parse_timeline_line

    logger = logging.getLogger("test.scheduler.timeline")
    logger.setLevel(logging.INFO)
    monkeypatch.setattr(
        scheduler_module, "timeline_log", TimelineLog(logger, environ={"VAM_TIMELINE_LOG": "1"})
    )
    d = scheduler("kv_consumer")
    req = request("d-20", 70, overlapped_params("t-20"))
    assert d.get_num_new_matched_tokens(req, 0) == (70, True)
    d.update_state_after_alloc(req, blocks([4, 5, 6]), 70)
    (pull,) = d.build_step_orders().pulls
    assert pull.arrived_at == req.arrival_time and pull.admitted_at >= pull.arrived_at
    d.filter_output(output(recving={"d-20"}))
    with caplog.at_level(logging.INFO, logger=logger.name):
        d.note_scheduled(["other", "d-20"])
        d.note_scheduled(["d-20"])  # once only
    records = [parse_timeline_line(r.getMessage()) for r in caplog.records]
    (record,) = [r for r in records if r is not None]
    assert (record["source"], record["transfer"], record["request"]) == (
        "decode_scheduler",
        "t-20",
        "d-20",
    )
    stamps = record["stamps"]
    assert stamps["admitted"] <= stamps["load_reported"] <= stamps["first_step"]

    aborted = request("d-21", 70, overlapped_params("t-21"))
    d.get_num_new_matched_tokens(aborted, 0)
    d.update_state_after_alloc(aborted, blocks([7, 8, 9]), 70)
    d.request_finished(aborted, ([7, 8, 9],))
    assert d._load_stamps == {}


def test_prefill_hold_carries_when_the_request_was_first_scheduled() -> None:
    p = scheduler("kv_producer")
    req = request("p-30", 70, {"do_remote_decode": True, "transfer_id": "t-30"})
    assert p.get_num_new_matched_tokens(req, 0) == (0, False)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    p.request_finished(req, ([1, 2, 3],))
    (held,) = p.build_step_orders().holds
    assert held.arrived_at == req.arrival_time
    assert held.arrived_at <= held.scheduled_at <= held.finished_at
    assert p._first_seen == {}


def test_decode_with_a_network_address_warns_once_about_a_prefill_on_loopback(caplog) -> None:
    import logging
    from dataclasses import replace

    d = scheduler("kv_consumer")
    d.config = replace(d.config, side_channel_host="10.0.0.5")
    with caplog.at_level(logging.WARNING):
        for index in range(3):
            req = request(f"d-4{index}", 70, overlapped_params(f"t-4{index}"))
            assert d.get_num_new_matched_tokens(req, 0) == (70, True)
    warnings = [r.getMessage() for r in caplog.records if "loopback address" in r.getMessage()]
    assert len(warnings) == 1 and "VLLM_HOST_IP" in warnings[0] and "10.0.0.5" in warnings[0]

    caplog.clear()
    same_host = scheduler("kv_consumer")  # advertises 127.0.0.1 itself: one host, no warning
    with caplog.at_level(logging.WARNING):
        same_host.get_num_new_matched_tokens(request("d-50", 70, overlapped_params("t-50")), 0)
    assert not [r for r in caplog.records if "loopback address" in r.getMessage()]


def test_decode_with_a_larger_block_takes_the_prefill_block_count() -> None:
    """Prefill at 32 tokens per block, decode at 64: the params name the prefill block size, and
    decode checks the prefill blocks against it while allocating its own (fewer) blocks."""
    params = prefill_params(70)
    assert params["remote_block_size"] == BLOCK
    d = connector_scheduler(
        "kv_consumer", prefill_tp=2, num_kv_heads=4, block_size=64, extra={"side_channel_port": 1}
    )
    req = request("d-8", 70, params)
    assert d.get_num_new_matched_tokens(req, 0) == (70, True)
    d.update_state_after_alloc(req, blocks([4, 5]), 70)
    (pull,) = d.build_step_orders().pulls
    assert pull.local_block_ids == (4, 5) and pull.remote_block_ids == (7, 8, 9)
    assert pull.num_prompt_tokens == 70


@pytest.mark.parametrize("remote_block_size", [48, 0])
def test_decode_refuses_a_prefill_block_size_that_does_not_divide(remote_block_size) -> None:
    params = prefill_params(70)
    params["remote_block_size"] = remote_block_size
    d = scheduler("kv_consumer")
    req = request("d-9", 70, params)
    assert d.get_num_new_matched_tokens(req, 0) == (0, False)
    assert req.kv_transfer_params["do_remote_prefill"] is False


def test_a_prefill_engine_found_unpairable_is_computed_locally_from_then_on() -> None:
    """Issue #44 item 3: a pull that found a prefill engine unpairable (its cache geometry cannot
    be combined with decode's) fails once; every later request that engine prefilled is
    computed on decode, its hold released, instead of failing the same way."""
    d = scheduler("kv_consumer")
    engine = prefill_params(70)["remote_engine_id"]
    before = request("d-20", 70, prefill_params(70))
    assert d.get_num_new_matched_tokens(before, 0) == (70, True)
    d.pairings.note_unpairable(engine, "block size 32 on prefill vs 64 on decode ...")
    after = request("d-21", 70, {**prefill_params(70), "remote_request_id": "p-21"})
    assert d.get_num_new_matched_tokens(after, 0) == (0, False)
    assert after.kv_transfer_params["do_remote_prefill"] is False
    pulls = d.build_step_orders().pulls
    assert [(p.transfer_id, p.release_only) for p in pulls] == [("p-21", True)]
    other = {**prefill_params(70), "remote_request_id": "p-22", "remote_engine_id": "restarted"}
    assert d.get_num_new_matched_tokens(request("d-22", 70, other), 0) == (70, True)


def test_workers_tell_the_scheduler_side_which_prefill_engines_are_unpairable() -> None:
    """The worker's stats carry each unpairable engine to the scheduler process (vLLM hands the
    workers' stats to ``update_connector_output``); nothing else is kept there."""
    from vllm_ascend_mooncake.connector.stats import TransferStats

    stats = TransferStats()
    stats.record_unpairable("prefill-x", "head size differs")
    taken = stats.take()
    assert taken is not None and taken.unpairable_engines() == [("prefill-x", "head size differs")]
    assert taken.reduce()["Num failed pulls"] == 0
