"""A prefill -> decode hand-off between two real vLLM schedulers in one process.

Two ``vllm.v1.core.sched.scheduler.Scheduler``s, each with our connector built by vLLM's factory
(prefill: kv_producer, decode: kv_consumer), joined the way the proxy joins them: the proxy's own
``proxy.bodies`` functions build the prefill leg, read ``kv_transfer_params`` from prefill's (JSON)
response and build the decode leg. The only fake is the workers: each step's ``KVConnectorOutput``
is written by the test as our worker sides report (decode: ``finished_recving`` once its pull
landed, with ``invalid_block_ids`` if it failed; prefill: ``finished_sending`` once decode has
read). Every test ends with both schedulers empty and their block pools back to their initial
free counts.
"""

from __future__ import annotations

import json

import pytest
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from vam_testing.vllm_scheduler import (
    EOS_TOKEN_ID,
    SIDE_CHANNEL_PORT,
    Instance,
    decode_accepts,
    prompt_tokens,
    remote_prefill_params,
)
from vllm_ascend_mooncake import handoff
from vllm_ascend_mooncake.connector.params import InvalidTransferParams
from vllm_ascend_mooncake.proxy import bodies
from vllm_ascend_mooncake.proxy.formats import prefill_answer

COMPLETIONS = prefill_answer.COMPLETIONS

CLIENT = {"model": "tiny", "prompt": "ignored: the schedulers take token ids", "max_tokens": 4}


def response(kv_transfer_params: dict | None) -> bytes:
    """Prefill's HTTP response body, as the proxy receives it."""
    return json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": kv_transfer_params})


def run_prefill(p: Instance, request_id: str, prompt: list[int], body: dict) -> dict:
    """Serve the prefill leg ``body`` on ``p``; the kv_transfer_params of its response."""
    p.request(request_id, prompt, params=body["kv_transfer_params"], max_tokens=body["max_tokens"])
    step = p.step()
    done = step.finished(request_id)
    assert done is not None and done.finish_reason == FinishReason.LENGTH
    params = prefill_answer.kv_transfer_params_from_prefill(response(done.kv_transfer_params))
    assert params is not None
    return params


@pytest.mark.parametrize(
    "prefill_tp,decode_tp,prefill_block,decode_block",
    [(1, 1, 16, 16), (2, 1, 16, 16), (1, 2, 16, 16), (2, 1, 32, 16), (1, 1, 16, 32)],
    ids=["tp1-tp1", "tp2-tp1", "tp1-tp2", "tp2-tp1-blocks32-16", "blocks16-32"],
)
def test_prefill_params_drive_the_decode_pull(
    prefill_tp: int, decode_tp: int, prefill_block: int, decode_block: int
) -> None:
    sizes = {"prefill_tp": prefill_tp, "decode_tp": decode_tp}
    p = Instance("kv_producer", tensor_parallel_size=prefill_tp, block_size=prefill_block, **sizes)
    d = Instance("kv_consumer", tensor_parallel_size=decode_tp, block_size=decode_block, **sizes)
    prompt = prompt_tokens("handoff", 72)

    params = run_prefill(p, "cmpl-1-p", prompt, bodies.serial_prefill_body(CLIENT))
    prefill_blocks = p.block_ids("cmpl-1-p")
    (hold,) = p.step().orders.holds
    assert hold.block_ids == tuple(prefill_blocks)

    body = bodies.decode_body(CLIENT, params)
    req = d.request("cmpl-1-d", prompt, params=body["kv_transfer_params"], max_tokens=4)
    step = d.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (pull,) = step.orders.pulls
    assert pull.transfer_id == hold.transfer_id == "cmpl-1-p"
    assert pull.remote_block_ids == hold.block_ids
    assert pull.remote_engine_id == p.engine_id and pull.remote_port == SIDE_CHANNEL_PORT
    assert pull.remote_tp_size == prefill_tp
    assert pull.local_block_ids == tuple(d.block_ids("cmpl-1-d"))
    assert len(pull.local_block_ids) == -(-72 // decode_block)

    # Decode's workers read, tell prefill's, and each side reports.
    d.step(finished_recving={"cmpl-1-d"})
    p.step(finished_sending={"cmpl-1-p"})
    p.assert_empty()
    step = d.step()
    assert step.scheduled == {"cmpl-1-d": 1}
    while step.finished("cmpl-1-d") is None:
        step = d.step()
    d.assert_empty()


def test_overlapped_legs_meet_under_the_proxys_transfer_id() -> None:
    """The proxy knows prefill's address from an earlier answer and sends both legs at once:
    decode is admitted before prefill answered and pulls without block ids; prefill holds the
    KV under the transfer id decode claims."""
    p = Instance("kv_producer")
    d = Instance("kv_consumer")
    earlier = run_prefill(
        p, "cmpl-0-p", prompt_tokens("earlier", 20), bodies.serial_prefill_body(CLIENT)
    )
    p.step(finished_sending={"cmpl-0-p"})
    address = handoff.prefill_address(earlier)
    assert address is not None

    prompt = prompt_tokens("overlapped", 40)
    decode_params = handoff.awaited_prefill_params(address, "xfer-2")
    req = d.request("cmpl-2-d", prompt, params=decode_params, max_tokens=2)
    (pull,) = d.step().orders.pulls
    assert pull.early and pull.transfer_id == "xfer-2"
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    params = run_prefill(p, "cmpl-2-p", prompt, bodies.overlapped_prefill_body(CLIENT, "xfer-2"))
    assert params["remote_request_id"] == "xfer-2"
    (hold,) = p.step().orders.holds
    assert (hold.request_id, hold.transfer_id) == ("cmpl-2-p", "xfer-2")

    d.step(finished_recving={"cmpl-2-d"})
    p.step(finished_sending={"cmpl-2-p"})
    while not req.is_finished():
        d.step()
    p.assert_empty()
    d.assert_empty()


def test_a_prefill_aborted_under_overlapped_legs_makes_decode_recompute() -> None:
    """Prefill's request is aborted after decode was admitted: prefill drops the transfer, the
    decode worker's pull is refused and reported failed, and decode recomputes the prompt."""
    p = Instance("kv_producer", max_num_batched_tokens=32)
    d = Instance("kv_consumer", kv_load_failure_policy="recompute")
    address = {
        "remote_engine_id": p.engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": SIDE_CHANNEL_PORT,
        "remote_tp_size": 1,
    }
    prompt = prompt_tokens("aborted", 64)
    req = d.request("cmpl-3-d", prompt, params=handoff.awaited_prefill_params(address, "xfer-3"))
    (pull,) = d.step().orders.pulls

    body = bodies.overlapped_prefill_body(CLIENT, "xfer-3")
    p.request("cmpl-3-p", prompt, params=body["kv_transfer_params"], max_tokens=1)
    p.step()  # its first chunk
    p.abort("cmpl-3-p")
    assert p.step().orders.drops == ["xfer-3"]
    p.assert_empty()

    d.step(finished_recving={"cmpl-3-d"}, invalid_block_ids=set(pull.local_block_ids))
    step = d.step()
    assert step.scheduled == {"cmpl-3-d": 64} and not step.orders.pulls
    while not req.is_finished():
        d.step()
    d.assert_empty()


@pytest.mark.parametrize(
    "prompt_len,prefill_block,decode_block",
    [(72, 16, 16), (64, 16, 16), (63, 16, 16), (72, 32, 16), (72, 16, 32)],
    ids=["partial-block", "whole-blocks", "one-short", "blocks32-16", "blocks16-32"],
)
def test_decode_continues_from_prefills_token_reading_every_prompt_token(
    prompt_len: int, prefill_block: int, decode_block: int
) -> None:
    """The proxy's continued legs (proxy/bodies.py, proxy/formats/prefill_answer.py): decode's
    prompt is prefill's prompt and the token prefill sampled; decode reads all of prefill's
    prompt tokens (their blocks, the last one partial or not) and computes only that token,
    which may open a block of its own."""
    p = Instance("kv_producer", block_size=prefill_block)
    d = Instance("kv_consumer", block_size=decode_block)
    prompt = prompt_tokens("continued", prompt_len)
    client = {**CLIENT, "max_tokens": 4}
    leg = bodies.continued_prefill_body(client)
    p.request("cmpl-4-p", prompt, params=leg["kv_transfer_params"], max_tokens=leg["max_tokens"])
    done = p.step(tokens={"cmpl-4-p": 77}).finished("cmpl-4-p")
    assert done is not None and done.finish_reason == FinishReason.LENGTH
    params = prefill_answer.kv_transfer_params_from_prefill(response(done.kv_transfer_params))
    assert params["remote_output_token_ids"] == [77]
    assert params["remote_chat_prompt_ids"] is True  # vLLM 0.30+ (this tier runs 0.30-0.34)
    (hold,) = p.step().orders.holds
    assert hold.num_prompt_tokens == prompt_len

    answer = {
        "choices": [{"text": "x", "token_ids": [77], "prompt_token_ids": prompt}],
        "kv_transfer_params": params,
    }
    first = prefill_answer.first_token(COMPLETIONS, json.dumps(answer).encode())
    assert first is not None
    body = bodies.continued_decode_body(client, first)
    assert body["prompt"] == [*prompt, 77] and body["max_tokens"] == 3
    req = d.request("cmpl-4-d", body["prompt"], params=body["kv_transfer_params"], max_tokens=3)
    step = d.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (pull,) = step.orders.pulls
    assert pull.num_prompt_tokens == prompt_len  # what prefill holds, not decode's prompt
    assert pull.remote_block_ids == hold.block_ids
    assert pull.local_block_ids == tuple(d.block_ids("cmpl-4-d")[: -(-prompt_len // decode_block)])

    d.step(finished_recving={"cmpl-4-d"})
    p.step(finished_sending={"cmpl-4-p"})
    step = d.step()
    assert step.scheduled == {"cmpl-4-d": 1}  # only the continued token
    assert req.num_computed_tokens == prompt_len + 1
    while not req.is_finished():
        d.step()
    assert req.output_token_ids and len(req.output_token_ids) == 3
    p.assert_empty()
    d.assert_empty()


@pytest.mark.parametrize(
    "tail", [[78], [77, 77], []], ids=["other-token", "two-tokens", "prefills-prompt-minus-one"]
)
def test_decode_computes_locally_a_prompt_that_does_not_continue_prefills(tail: list[int]) -> None:
    """A prompt that is not prefill's followed by exactly the token prefill sampled: decode
    refuses the hand-off and computes the prompt itself (and tells prefill to free it)."""
    prompt = prompt_tokens("mismatch", 40)
    params = {
        **remote_prefill_params(40, [0, 1, 2], transfer_id="t-6"),
        "remote_output_token_ids": [77],
    }
    decode_prompt = prompt[:-1] if not tail else [*prompt, *tail]
    with pytest.raises(InvalidTransferParams, match="the prompts differ"):
        decode_accepts(params, decode_prompt)
    d = Instance("kv_consumer")
    req = d.request("cmpl-6-d", decode_prompt, params=params, max_tokens=1)
    step = d.step()
    assert step.scheduled == {"cmpl-6-d": len(decode_prompt)}
    (release,) = step.orders.pulls
    assert release.transfer_id == "t-6" and release.local_block_ids == ()
    while not req.is_finished():
        d.step()
    d.assert_empty()


@pytest.mark.parametrize("token", [EOS_TOKEN_ID, 77], ids=["eos", "length"])
def test_a_continued_prefill_holds_nothing_when_its_token_ends_the_answer(token: int) -> None:
    """``hold_if_stopped`` false: an answer that ended with prefill's token (EOS, a stop
    string or token) is complete, nobody reads its KV; one cut at its token limit is held."""
    p = Instance("kv_producer")
    leg = bodies.continued_prefill_body({**CLIENT, "max_tokens": 4})
    p.request("cmpl-7-p", 40, params=leg["kv_transfer_params"], max_tokens=1)
    done = p.step(tokens={"cmpl-7-p": token}).finished("cmpl-7-p")
    holds = p.step().orders.holds
    if token == EOS_TOKEN_ID:
        assert done.finish_reason == FinishReason.STOP
        assert done.kv_transfer_params is None and holds == []
        p.assert_empty()
    else:
        assert done.kv_transfer_params["remote_output_token_ids"] == [77]
        assert [hold.request_id for hold in holds] == ["cmpl-7-p"]
        p.step(finished_sending={"cmpl-7-p"})
        p.assert_empty()
