"""Prefill (kv_producer) in vLLM's real scheduler: delayed frees, holds and the params handed out.

vLLM's ``Scheduler`` runs in process with our connector built by vLLM's factory in the SCHEDULER
role (``vam_testing.vllm_scheduler``). The only fake is the worker: each step's
``ModelRunnerOutput`` is written by the test, with the ``KVConnectorOutput`` our worker side
reports (``connector/worker.py``): a held request in ``finished_sending`` once every decode rank
has read it (or its hold expired). Every test ends with the scheduler empty and its block pool
back to its initial free count.
"""

from __future__ import annotations

import pytest
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from vam_testing.vllm_scheduler import (
    EOS_TOKEN_ID,
    SIDE_CHANNEL_HOST,
    SIDE_CHANNEL_PORT,
    Instance,
    decode_accepts,
    prompt_tokens,
)
from vllm_ascend_mooncake import handoff
from vllm_ascend_mooncake.datapath.orders import HoldOrder

BLOCK = 16


def hand_off() -> dict:
    """The kv_transfer_params of the proxy's prefill leg (one dict per request, as parsed)."""
    return dict(handoff.PREFILL_KV_TRANSFER_PARAMS)


def prefill(**config) -> Instance:
    return Instance("kv_producer", **config)


def test_prefill_holds_the_prompt_blocks_until_decode_has_read_them() -> None:
    p = prefill()
    finished = p.spy("request_finished_all_groups")
    req = p.request("p-1", 40, params=hand_off(), max_tokens=1)

    step = p.step()
    assert step.scheduled == {"p-1": 40}
    done = step.finished("p-1")
    assert done.finish_reason == FinishReason.LENGTH
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    blocks = p.block_ids("p-1")
    assert len(blocks) == 3
    ((_, given_blocks, (delay_free, params)),) = finished
    assert delay_free and given_blocks == (blocks,)
    assert {k: v for k, v in done.kv_transfer_params.items() if k in params} == params

    remote = decode_accepts(done.kv_transfer_params, 40)
    assert remote.remote_block_ids == blocks and remote.remote_num_tokens == 40
    assert (remote.remote_request_id, remote.remote_engine_id) == ("p-1", p.engine_id)
    assert (remote.remote_host, remote.remote_port) == (SIDE_CHANNEL_HOST, SIDE_CHANNEL_PORT)
    assert (remote.remote_tp_size, remote.remote_block_size) == (1, BLOCK)

    # Finished, but its blocks wait for decode: the hold goes to the workers in the next step.
    assert "p-1" in p.scheduler.requests
    assert p.free_blocks() == p.initial_free_blocks - 3
    step = p.step()
    assert step.orders.holds == [HoldOrder("p-1", "p-1", tuple(blocks), 40)]
    assert step.orders.idle and not step.orders.pulls and not step.orders.drops
    for _ in range(3):
        assert not p.step().orders.holds
        assert p.free_blocks() == p.initial_free_blocks - 3

    p.step(finished_sending={"p-1"})
    assert "p-1" not in p.scheduler.requests
    p.assert_empty()


def test_a_prefill_whose_token_is_eos_hands_off_too() -> None:
    p = prefill()
    p.request("p-2", 40, params=hand_off(), max_tokens=4)
    step = p.step(tokens={"p-2": EOS_TOKEN_ID})
    done = step.finished("p-2")
    assert done.finish_reason == FinishReason.STOP
    assert decode_accepts(done.kv_transfer_params, 40).remote_block_ids == p.block_ids("p-2")
    (hold,) = p.step().orders.holds
    assert hold.request_id == "p-2"
    p.step(finished_sending={"p-2"})
    p.assert_empty()


def test_a_prefill_running_past_one_token_holds_only_its_prompt_blocks() -> None:
    p = prefill()
    p.request("p-3", 2 * BLOCK, params=hand_off(), max_tokens=3)
    steps = [p.step() for _ in range(3)]
    done = steps[-1].finished("p-3")
    assert done is not None and done.finish_reason == FinishReason.LENGTH
    blocks = p.block_ids("p-3")
    assert len(blocks) == 3  # 34 computed tokens
    assert decode_accepts(done.kv_transfer_params, 2 * BLOCK).remote_block_ids == blocks[:2]
    (hold,) = p.step().orders.holds
    assert hold.block_ids == tuple(blocks[:2])
    p.step(finished_sending={"p-3"})  # vLLM frees all of them
    p.assert_empty()


def test_a_chunked_prefill_hands_off_after_its_last_chunk() -> None:
    p = prefill(max_num_batched_tokens=32)
    p.request("p-4", 72, params=hand_off(), max_tokens=1)
    scheduled = []
    while (step := p.step()).finished("p-4") is None:
        scheduled.append(step.scheduled["p-4"])
        assert not step.orders.holds
    scheduled.append(step.scheduled["p-4"])
    assert scheduled == [32, 32, 8]
    assert decode_accepts(step.finished("p-4").kv_transfer_params, 72).remote_block_ids == (
        p.block_ids("p-4")
    )
    (hold,) = p.step().orders.holds
    assert len(hold.block_ids) == 5
    p.step(finished_sending={"p-4"})
    p.assert_empty()


@pytest.mark.parametrize("transfer_id", [None, "t-5"], ids=["request-id", "proxy-transfer-id"])
def test_an_aborted_prefill_frees_its_blocks_at_once(transfer_id: str | None) -> None:
    """Nobody will read an aborted prompt: its blocks go back at once; a decode admitted early
    under the proxy's transfer id is told (a drop) instead of waiting for its timeout."""
    p = prefill(max_num_batched_tokens=32)
    finished = p.spy("request_finished_all_groups")
    params = hand_off() if transfer_id is None else {**hand_off(), "transfer_id": transfer_id}
    req = p.request("p-5", 64, params=params, max_tokens=1)
    step = p.step()
    assert step.scheduled == {"p-5": 32} and len(p.block_ids("p-5")) == 2

    p.abort("p-5")
    assert req.status == RequestStatus.FINISHED_ABORTED
    assert [result for *_, result in finished] == [(False, None)]
    assert "p-5" not in p.scheduler.requests
    step = p.step()
    assert not step.orders.holds
    assert step.orders.drops == ([] if transfer_id is None else [transfer_id])
    p.assert_empty()


def test_identical_prompts_share_cached_blocks_and_are_released_one_by_one() -> None:
    """vLLM's prefix cache gives the second prompt the first one's blocks: both holds name them,
    and they go back to the pool only once both decodes have read."""
    p = prefill()
    prompt = prompt_tokens("same", 2 * BLOCK + 8)
    p.request("p-a", prompt, params=hand_off(), max_tokens=1)
    p.step()
    p.request("p-b", prompt, params=hand_off(), max_tokens=1)
    step = p.step()
    assert step.scheduled == {"p-b": 8}  # the two full blocks were a prefix-cache hit
    a, b = p.block_ids("p-a"), p.block_ids("p-b")
    assert a[:2] == b[:2] and a[2] != b[2]
    (hold_a,) = step.orders.holds
    (hold_b,) = p.step().orders.holds
    assert (hold_a.block_ids, hold_b.block_ids) == (tuple(a), tuple(b))

    p.step(finished_sending={"p-a"})
    assert p.free_blocks() == p.initial_free_blocks - 3  # b still holds the shared two
    p.step(finished_sending={"p-b"})
    p.assert_empty()


def test_an_abort_after_the_hand_off_keeps_the_blocks_for_decode() -> None:
    """The client leaving after prefill answered changes nothing: vLLM ignores aborts of
    finished requests, so decode can still read and the blocks go back when it is done."""
    p = prefill()
    p.request("p-6", 40, params=hand_off(), max_tokens=1)
    p.step()
    p.abort("p-6")
    assert len(p.step().orders.holds) == 1
    assert p.free_blocks() == p.initial_free_blocks - 3
    p.step(finished_sending={"p-6"})
    p.assert_empty()


def test_prefill_drops_reports_vllm_is_not_waiting_for() -> None:
    """A report for a request vLLM does not hold (unknown, running, already freed) would make
    vLLM free blocks it still uses, or assert and kill the engine core."""
    p = prefill()
    p.request("p-7", 40, params=hand_off(), max_tokens=1)
    running = p.request("running", 40, max_tokens=6)
    p.step()
    p.step(finished_sending={"running", "never-seen"}, finished_recving={"p-7", "never-seen"})
    assert running.status == RequestStatus.RUNNING and len(p.block_ids("running")) == 3
    assert "p-7" in p.scheduler.requests  # still held

    p.step(finished_sending={"p-7"})
    assert "p-7" not in p.scheduler.requests
    p.step(finished_sending={"p-7"})  # reported twice: dropped, not freed again
    while not running.is_finished():
        p.step()
    p.assert_empty()


def test_a_request_without_do_remote_decode_is_served_and_freed_as_usual() -> None:
    p = prefill()
    finished = p.spy("request_finished_all_groups")
    p.request("plain", 40, max_tokens=1)
    step = p.step()
    assert step.finished("plain").kv_transfer_params is None
    assert [result for *_, result in finished] == [(False, None)]
    assert not p.step().orders.holds
    p.assert_empty()


def test_a_prefill_instance_computes_a_pull_request_locally() -> None:
    """Params meant for a decode instance sent to prefill: computed here, nothing pulled."""
    p = prefill()
    params = {
        "do_remote_prefill": True,
        "remote_request_id": "t-8",
        "remote_engine_id": "engine-x",
        "remote_host": SIDE_CHANNEL_HOST,
        "remote_port": SIDE_CHANNEL_PORT,
        "remote_tp_size": 1,
    }
    p.request("p-8", 40, params=params, max_tokens=1)
    step = p.step()
    assert step.scheduled == {"p-8": 40} and not step.orders.pulls
    assert step.finished("p-8") is not None
    assert not p.step().orders.pulls
    p.assert_empty()
