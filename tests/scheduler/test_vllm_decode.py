"""Decode (kv_consumer) in vLLM's real scheduler: the connector as ``Scheduler`` drives it.

vLLM's ``Scheduler`` runs in process with our connector built by vLLM's factory in the SCHEDULER
role (``vam_testing.vllm_scheduler``). The only fake is the worker: each step's
``ModelRunnerOutput`` is written by the test, with the ``KVConnectorOutput`` our worker side
reports (``connector/worker.py``): a finished pull in ``finished_recving``; a failed one there
too, with its local blocks in ``invalid_block_ids`` (``get_block_ids_with_load_errors``); a
cancelled one in ``finished_recving`` without load errors. Every test ends with the scheduler
empty and its block pool back to its initial free count.
"""

from __future__ import annotations

import pytest
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from vam_testing.vllm_scheduler import (
    SIDE_CHANNEL_HOST,
    SIDE_CHANNEL_PORT,
    Instance,
    Step,
    prompt_tokens,
    remote_prefill_params,
)

BLOCK = 16


def decode(**config) -> Instance:
    return Instance("kv_consumer", **config)


def run_to_end(instance: Instance, request_id: str, limit: int = 64, **report) -> list[Step]:
    """Step until ``request_id`` finishes (the first step gets ``report``)."""
    steps = []
    for _ in range(limit):
        steps.append(instance.step(**report))
        report = {}
        if steps[-1].finished(request_id) is not None:
            return steps
    raise AssertionError(f"{request_id} did not finish in {limit} steps")


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-caching", "no-caching"])
def test_decode_pulls_the_prompt_then_computes_only_its_last_token(prefix_caching: bool) -> None:
    d = decode(enable_prefix_caching=prefix_caching)
    matched = d.spy("get_num_new_matched_tokens")
    req = d.request("d-1", 40, params=remote_prefill_params(40, [11, 12, 13]), max_tokens=3)

    # Admission: the whole prompt loads asynchronously into freshly allocated blocks.
    step = d.step()
    assert matched == [(req, 0, (40, True))]
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert step.scheduled == {} and step.orders.idle
    blocks = d.block_ids("d-1")
    assert len(blocks) == 3 and d.free_blocks() == d.initial_free_blocks - 3
    (pull,) = step.orders.pulls
    assert pull.local_block_ids == tuple(blocks)
    assert pull.remote_block_ids == (11, 12, 13)
    assert (pull.request_id, pull.transfer_id, pull.num_prompt_tokens) == ("d-1", "p-1", 40)
    assert (pull.remote_host, pull.remote_port, pull.remote_engine_id) == (
        SIDE_CHANNEL_HOST,
        SIDE_CHANNEL_PORT,
        "engine-p",
    )
    assert not step.orders.holds and not step.orders.cancels

    # The read is under way: nothing to schedule, nothing new to order.
    step = d.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert step.scheduled == {} and not step.orders.pulls

    # The worker reports the load; vLLM schedules the request in the next step.
    d.step(finished_recving={"d-1"})
    assert "d-1" in d.scheduler.finished_recving_kv_req_ids
    step = d.step()
    assert req.status == RequestStatus.RUNNING
    assert step.new_request_ids == ["d-1"]
    assert step.output.scheduled_new_reqs[0].num_computed_tokens == 39
    assert step.scheduled == {"d-1": 1}  # the last prompt token only, to sample the first
    assert d.block_ids("d-1") == blocks
    assert len(matched) == 1  # never asked again once loaded

    steps = run_to_end(d, "d-1")
    done = steps[-1].finished("d-1")
    assert done.finish_reason == FinishReason.LENGTH and done.kv_transfer_params is None
    assert all(not s.orders.pulls and not s.orders.cancels for s in steps)
    d.assert_empty()


def test_decode_with_a_local_prefix_hit_pulls_only_the_uncached_blocks() -> None:
    d = decode()
    shared = prompt_tokens("shared", 2 * BLOCK)
    warm = d.request("warm", [*shared, *prompt_tokens("warm", 8)], max_tokens=1)
    step = d.step()
    assert step.finished("warm") is not None and warm.is_finished()
    cached = d.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
    assert len(cached) == 2

    matched = d.spy("get_num_new_matched_tokens")
    req = d.request(
        "d-2",
        [*shared, *prompt_tokens("d-2", 8)],
        params=remote_prefill_params(40, [11, 12, 13]),
        max_tokens=2,
    )
    step = d.step()
    assert matched == [(req, 2 * BLOCK, (8, True))]
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    blocks = d.block_ids("d-2")
    (pull,) = step.orders.pulls
    assert len(blocks) == 3 and pull.local_block_ids == (blocks[2],)
    assert pull.remote_block_ids == (11, 12, 13)  # the worker reads their suffix

    d.step(finished_recving={"d-2"})
    step = d.step()
    assert step.scheduled == {"d-2": 1}
    run_to_end(d, "d-2")
    d.assert_empty()


def test_decode_drops_reports_vllm_is_not_waiting_for() -> None:
    """vLLM asserts on a finished id it does not wait for (an unknown request, one that loads
    nothing, a load reported twice), and that assert kills its engine core."""
    d = decode()
    req = d.request("d-3", 40, params=remote_prefill_params(40, [11, 12, 13]), max_tokens=4)
    local = d.request("local", 20, max_tokens=4)
    step = d.step()
    assert set(step.scheduled) == {"local"} and len(step.orders.pulls) == 1

    d.step(finished_recving={"d-3", "local", "never-seen"}, finished_sending={"never-seen"})
    assert d.scheduler.finished_recving_kv_req_ids == {"d-3"}
    assert local.status == RequestStatus.RUNNING

    step = d.step(finished_recving={"d-3"})  # a second report of the same load
    assert step.scheduled == {"local": 1, "d-3": 1}
    assert req.status == RequestStatus.RUNNING

    run_to_end(d, "d-3", finished_recving={"d-3"})
    assert local.is_finished()
    d.assert_empty()


@pytest.mark.parametrize("failed_from", [0, 2], ids=["all-blocks", "last-block"])
def test_a_failed_load_is_recomputed_under_policy_recompute(failed_from: int) -> None:
    d = decode(kv_load_failure_policy="recompute")
    matched = d.spy("get_num_new_matched_tokens")
    req = d.request("d-4", 40, params=remote_prefill_params(40, [11, 12, 13]), max_tokens=2)
    (pull,) = d.step().orders.pulls

    # A failed pull: reported finished, its (unwritten) blocks as load errors.
    d.step(finished_recving={"d-4"}, invalid_block_ids=set(pull.local_block_ids[failed_from:]))
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert req.num_computed_tokens == failed_from * BLOCK

    step = d.step()
    assert req.status == RequestStatus.RUNNING
    assert step.scheduled == {"d-4": 40 - failed_from * BLOCK}  # the rest computed locally
    assert not step.orders.pulls  # and never pulled again
    if failed_from == 0:
        # vLLM freed the blocks and admitted the request anew: the connector declines.
        assert matched[1:] == [(req, 0, (0, False))]
    assert len(d.block_ids("d-4")) == 3

    steps = run_to_end(d, "d-4")
    assert all(not s.orders.pulls for s in steps)
    d.assert_empty()


def test_a_failed_load_finishes_the_request_with_an_error_under_policy_fail() -> None:
    d = decode(kv_load_failure_policy="fail")
    req = d.request("d-5", 40, params=remote_prefill_params(40, [11, 12, 13]), max_tokens=2)
    (pull,) = d.step().orders.pulls

    step = d.step(finished_recving={"d-5"}, invalid_block_ids=set(pull.local_block_ids))
    done = step.finished("d-5")
    assert done is not None and done.finish_reason == FinishReason.ERROR
    assert req.status == RequestStatus.FINISHED_ERROR
    assert "d-5" not in d.scheduler.requests  # its blocks are freed at once

    step = d.step(finished_recving={"d-5"})  # a late duplicate is dropped, not asserted on
    assert not step.orders.pulls
    d.assert_empty()


def test_a_load_that_lands_within_its_admission_step_is_scheduled_next() -> None:
    """Orders apply when the worker binds the step's metadata, before the forward: a fast pull
    may be reported in the output of the very step that admitted the request."""
    d = decode()
    req = d.request("d-15", 40, params=remote_prefill_params(40, [11, 12, 13]), max_tokens=2)
    step = d.step(finished_recving={"d-15"})
    assert len(step.orders.pulls) == 1 and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert d.step().scheduled == {"d-15": 1}
    run_to_end(d, "d-15")
    d.assert_empty()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_load_that_fails_on_one_decode_rank_only(policy: str) -> None:
    """Decode TP 2: vLLM's output aggregator passes each rank's load errors on at once but a
    finished load only once every rank reported it. Rank 0's pull fails early, rank 1's lands
    two steps later."""
    d = decode(tensor_parallel_size=2, kv_load_failure_policy=policy)
    req = d.request("d-16", 40, params=remote_prefill_params(40, [11, 12, 13]), max_tokens=2)
    (pull,) = d.step().orders.pulls
    step = d.step(invalid_block_ids=set(pull.local_block_ids))  # rank 0: failed, reported
    if policy == "fail":
        assert step.finished("d-16").finish_reason == FinishReason.ERROR
        # vLLM keeps the blocks while a rank may still be writing them; the pull is cancelled.
        assert d.block_ids("d-16") == list(pull.local_block_ids)
        assert d.step().orders.cancels == ["d-16"]
    else:
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert req.num_computed_tokens == 0
        assert d.step().scheduled == {}
    step = d.step(finished_recving={"d-16"})  # rank 1 done: the load is reported finished
    if policy == "fail":
        assert "d-16" not in d.scheduler.requests
    else:
        step = d.step()
        assert step.scheduled == {"d-16": 40} and not step.orders.pulls
        run_to_end(d, "d-16")
    d.assert_empty()


def test_an_abort_while_the_kv_loads_cancels_the_pull_and_frees_the_blocks_once() -> None:
    d = decode()
    d.request("busy", 8, max_tokens=8)  # keeps the engine stepping
    req = d.request("d-6", 40, params=remote_prefill_params(40, [11, 12, 13]))
    step = d.step()
    (pull,) = step.orders.pulls

    d.abort("d-6")
    assert req.status == RequestStatus.FINISHED_ABORTED
    # vLLM keeps the blocks until the worker says the pull is over: bytes may still land.
    assert d.block_ids("d-6") == list(pull.local_block_ids)
    in_use = d.initial_free_blocks - d.free_blocks()
    step = d.step()
    assert step.orders.cancels == ["d-6"] and not step.orders.pulls
    assert d.block_ids("d-6") == list(pull.local_block_ids)

    # The cancelled pull is reported finished (no load error): vLLM frees the blocks now.
    d.step(finished_recving={"d-6"})
    assert "d-6" not in d.scheduler.requests and d.block_ids("d-6") == []
    assert d.initial_free_blocks - d.free_blocks() == in_use - 3

    step = d.step(finished_recving={"d-6"})  # again: dropped, not freed twice
    assert not step.orders.cancels
    run_to_end(d, "busy")
    d.assert_empty()


def test_an_abort_before_admission_releases_the_prefill_hold() -> None:
    d = decode()
    d.request("d-7", 40, params=remote_prefill_params(40, [11, 12, 13]))
    d.abort("d-7")
    assert "d-7" not in d.scheduler.requests  # nothing allocated, nothing to wait for

    step = d.step()
    (pull,) = step.orders.pulls
    assert pull.release_only and pull.transfer_id == "p-1"
    assert pull.remote_block_ids == (11, 12, 13)
    assert not step.orders.cancels
    d.assert_empty()


def test_an_abort_after_the_load_was_reported_frees_the_blocks_at_once() -> None:
    """Loaded but not yet scheduled: vLLM frees the blocks itself; nothing is left to cancel."""
    d = decode()
    d.request("d-12", 40, params=remote_prefill_params(40, [11, 12, 13]))
    d.step()
    d.step(finished_recving={"d-12"})
    d.abort("d-12")
    assert "d-12" not in d.scheduler.requests
    step = d.step()
    assert not step.orders.cancels and not step.orders.pulls
    d.assert_empty()


def test_params_the_decode_rejects_are_computed_locally_and_release_the_prefill() -> None:
    """Params that do not match the request (here: another prompt length) are not pulled
    with; the prefill they name is told to free its hold at once."""
    d = decode()
    matched = d.spy("get_num_new_matched_tokens")
    req = d.request("d-13", 40, params=remote_prefill_params(41, [11, 12, 13]), max_tokens=1)
    step = d.step()
    assert matched == [(req, 0, (0, False))]
    assert step.scheduled == {"d-13": 40}
    (pull,) = step.orders.pulls
    assert pull.release_only and pull.transfer_id == "p-1"
    assert step.finished("d-13") is not None
    assert not d.step().orders.pulls
    d.assert_empty()


def test_a_request_waiting_for_blocks_loads_once_admitted() -> None:
    """No free blocks for the prompt: vLLM keeps the request waiting and asks again each step;
    the pull is ordered once, when the blocks are allocated."""
    d = decode(num_blocks=6)  # 5 usable blocks
    local = d.request("local", 4 * BLOCK, max_tokens=10)
    req = d.request("d-8", 40, params=remote_prefill_params(40, [11, 12, 13]), max_tokens=2)
    step = d.step()
    assert set(step.scheduled) == {"local"} and not step.orders.pulls
    assert req.status == RequestStatus.WAITING
    while not local.is_finished():
        step = d.step()
        assert not step.orders.pulls
    step = d.step()
    (pull,) = step.orders.pulls
    assert pull.local_block_ids == tuple(d.block_ids("d-8"))
    run_to_end(d, "d-8", finished_recving={"d-8"})
    d.assert_empty()


def test_an_abort_while_waiting_for_blocks_releases_the_prefill_hold() -> None:
    """Matched, but never allocated: aborted, it orders only the release of prefill's hold."""
    d = decode(num_blocks=6)
    d.request("local", 4 * BLOCK, max_tokens=10)
    req = d.request("d-14", 40, params=remote_prefill_params(40, [11, 12, 13]))
    assert not d.step().orders.pulls and req.status == RequestStatus.WAITING
    d.abort("d-14")
    (pull,) = d.step().orders.pulls
    assert pull.release_only and pull.transfer_id == "p-1"
    while d.scheduler.requests:
        assert not d.step().orders.pulls
    d.assert_empty()


def test_prompt_logprobs_pull_exactly_what_vllm_decides_to_load() -> None:
    """Prompt logprobs need the prompt computed here. vLLM 0.31 and later skip external KV for
    such requests (the scheduler overrides the connector's count with 0): the pull then only
    releases prefill's hold and the worker reports nothing. vLLM 0.30 loads it like any other
    request. Either way the pull names exactly the blocks vLLM waits for."""
    d = decode()
    req = d.request(
        "d-9",
        40,
        params=remote_prefill_params(40, [11, 12, 13]),
        max_tokens=1,
        prompt_logprobs=1,
    )
    step = d.step()
    (pull,) = step.orders.pulls
    assert pull.transfer_id == "p-1"
    if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:  # vLLM loads it (0.30)
        assert pull.local_block_ids == tuple(d.block_ids("d-9"))
        run_to_end(d, "d-9", finished_recving={"d-9"})
    else:  # vLLM computes the prompt itself
        assert step.scheduled == {"d-9": 40}
        assert pull.release_only
        assert step.finished("d-9") is not None and req.is_finished()
    assert not d.step().orders.pulls
    d.assert_empty()


@pytest.mark.parametrize("shared", [True, False], ids=["one-dict", "copies"])
def test_sequences_sharing_one_transfer_pull_it_once(shared: bool) -> None:
    """n > 1: every sequence carries the same params (vLLM's fan-out shares one dict; a client
    may also send copies); prefill holds one copy of the KV, so one sequence pulls it and the
    others compute the prompt locally."""
    d = decode()
    params = remote_prefill_params(40, [11, 12, 13])
    prompt = prompt_tokens("d-10", 40)
    first = d.request("0_d-10", prompt, params=params, max_tokens=2)
    second = d.request("1_d-10", prompt, params=params if shared else dict(params), max_tokens=2)
    step = d.step()
    (pull,) = step.orders.pulls
    assert pull.request_id == "0_d-10" and not pull.release_only
    assert first.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert step.scheduled == {"1_d-10": 40} and second.status == RequestStatus.RUNNING

    d.step(finished_recving={"0_d-10"})
    run_to_end(d, "0_d-10")
    assert second.is_finished()
    d.assert_empty()


def test_a_preempted_decode_request_recomputes_without_a_second_pull() -> None:
    """A tiny KV cache forces vLLM to preempt the loaded request when it needs one more block;
    its blocks are freed, and when it is admitted again it is computed from its own (now cached)
    prefix, not pulled again."""
    d = decode(num_blocks=8)  # 7 usable blocks: 4 for `other`, 3 for the pulled prompt
    matched = d.spy("get_num_new_matched_tokens")
    other = d.request("other", 4 * BLOCK - 8, max_tokens=8)  # 8 tokens of room in its blocks
    req = d.request("d-11", 3 * BLOCK, params=remote_prefill_params(48, [1, 2, 3]), max_tokens=4)
    step = d.step()
    (pull,) = step.orders.pulls
    assert len(pull.local_block_ids) == 3 and d.free_blocks() == 0
    d.step(finished_recving={"d-11"})
    step = d.step()
    assert step.scheduled == {"other": 1, "d-11": 1}

    # d-11 now holds 49 tokens and needs a fourth block: none is free.
    pulls = []
    while req.num_preemptions == 0:
        step = d.step()
        pulls += step.orders.pulls
    assert req.status in (RequestStatus.PREEMPTED, RequestStatus.WAITING)
    assert d.block_ids("d-11") == []  # freed by the preemption
    assert not d.scheduler.finished_recving_kv_req_ids

    steps = run_to_end(d, "d-11")
    assert other.is_finished()
    pulls += [p for s in steps for p in s.orders.pulls]
    assert pulls == []
    # Asked again on re-admission (its cached prompt is the local hit): no external tokens.
    asked = [(computed, result) for r, computed, result in matched if r is req]
    assert asked[0] == (0, (48, True)) and len(asked) > 1
    assert set(asked[1:]) == {(48, (0, False))}
    d.assert_empty()


def pairing_verdict(engine_id: str, outcome: str, reason: str = ""):
    """The workers' stats carrying one pairing probe's verdict, as decode's TP rank 0 reports it
    (``connector/worker.py``, ``datapath/pairing.py``)."""
    from vllm_ascend_mooncake.connector.stats import TransferStats
    from vllm_ascend_mooncake.datapath.pairing import PairingOutcome, PairingVerdict

    stats = TransferStats()
    stats.record_pairing(PairingVerdict(engine_id, PairingOutcome(outcome), reason))
    return stats.take()


def test_the_first_request_of_a_prefill_engine_waits_for_pairing_then_pulls() -> None:
    """Issue #44 item 3: decode holds a prefill engine's first request (vLLM's scheduler skips
    it: no blocks allocated, nothing scheduled) until its workers paired with that engine;
    then it pulls as usual, and later requests of that engine pull at once."""
    d = decode(extra={"pair_before_pull": True})
    req = d.request("d-1", 40, params=remote_prefill_params(40, [11, 12, 13]), max_tokens=2)

    step = d.step()
    (pairing,) = step.orders.pairings
    assert (pairing.engine_id, pairing.remote_host, pairing.remote_port) == (
        "engine-p",
        SIDE_CHANNEL_HOST,
        SIDE_CHANNEL_PORT,
    )
    assert req.status == RequestStatus.WAITING and not step.orders.pulls
    assert d.free_blocks() == d.initial_free_blocks
    step = d.step()  # still pairing: asked again, no second probe
    assert not step.orders.pairings and not step.orders.pulls

    d.step(stats=pairing_verdict("engine-p", "paired"))
    step = d.step()
    (pull,) = step.orders.pulls
    assert pull.request_id == "d-1" and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    later = d.request(
        "d-2", 40, params={**remote_prefill_params(40, [21, 22, 23]), "remote_request_id": "p-2"}
    )
    step = d.step()
    assert [p.request_id for p in step.orders.pulls] == ["d-2"] and not step.orders.pairings
    d.step(finished_recving={"d-1", "d-2"})
    run_to_end(d, "d-1")
    d.abort("d-2")
    d.assert_empty()
    assert later.is_finished()


def test_a_prefill_engine_the_probe_refuses_costs_its_first_request_nothing() -> None:
    """Issue #44 item 3: a prefill engine decode cannot read (another dtype, say) used to fail
    its first request (HTTP 500 under vLLM's default ``kv_load_failure_policy``). The probe
    refuses it before any pull: that request and every later one of that engine are computed
    here, prefill told to release its holds."""
    d = decode(extra={"pair_before_pull": True})
    req = d.request("d-1", 40, params=remote_prefill_params(40, [11, 12, 13]), max_tokens=2)
    assert d.step().orders.pairings

    d.step(stats=pairing_verdict("engine-p", "refused", "dtype bf16 on prefill vs f32 here"))
    step = d.step()
    assert step.scheduled == {"d-1": 40}  # the whole prompt computed here
    assert [(p.transfer_id, p.release_only) for p in step.orders.pulls] == [("p-1", True)]
    assert req.kv_transfer_params["do_remote_prefill"] is False
    run_to_end(d, "d-1")
    params = {**remote_prefill_params(40, [1, 2, 3]), "remote_request_id": "p-2"}
    d.request("d-2", 40, params=params)
    step = d.step()
    assert step.scheduled == {"d-2": 40} and not step.orders.pairings
    assert [(p.transfer_id, p.release_only) for p in step.orders.pulls] == [("p-2", True)]
    run_to_end(d, "d-2")
    d.assert_empty()


def test_a_request_aborted_while_its_prefill_is_paired_releases_prefills_hold() -> None:
    """A client that leaves while decode pairs with its prefill: the request never got blocks,
    and prefill is told to release what it holds for it."""
    d = decode(extra={"pair_before_pull": True})
    d.request("d-1", 40, params=remote_prefill_params(40, [11, 12, 13]), max_tokens=2)
    assert d.step().orders.pairings
    d.abort("d-1")
    step = d.step(stats=pairing_verdict("engine-p", "paired"))
    assert [(p.transfer_id, p.release_only) for p in step.orders.pulls] == [("p-1", True)]
    d.assert_empty()
