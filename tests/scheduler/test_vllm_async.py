"""The connector under vLLM's ``AsyncScheduler``: what GPU and NPU engines run by default.

With async scheduling an engine core keeps two batches in flight: it schedules the next step
before the previous one's output is back, so a request whose last token is still being sampled
(an EOS, which the scheduler cannot foresee) is already scheduled once more, and a decode
instance defers freeing blocks past the batch in flight (vLLM 0.30 and later).
``Instance(..., async_scheduling=True)`` steps like ``EngineCore.step_with_batch_queue`` (vLLM's
CPU platform turns async scheduling off, so CPU engines never run this).

The only fake is the worker, as in the other files of this directory: the test writes each
``KVConnectorOutput`` as our worker side reports it, and a report reaches the scheduler with the
next batch output it processes. The tests wait for states, not for step numbers. Every test ends
with the scheduler empty, nothing left in vLLM's deferred frees, and the block pool back to its
initial free count.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from vam_testing.vllm_scheduler import (
    EOS_TOKEN_ID,
    Instance,
    Step,
    decode_accepts,
    prompt_tokens,
    remote_prefill_params,
)
from vllm_ascend_mooncake import handoff
from vllm_ascend_mooncake.proxy import bodies

BLOCK = 16


def hand_off() -> dict:
    """The kv_transfer_params of the proxy's prefill leg (one dict per request, as parsed)."""
    return dict(handoff.PREFILL_KV_TRANSFER_PARAMS)


def instance(kv_role: str, **config) -> Instance:
    created = Instance(kv_role, async_scheduling=True, **config)
    assert isinstance(created.scheduler, AsyncScheduler)
    assert created.batch_queue_size == 2
    return created


def until(
    inst: Instance,
    done: Callable[[list[Step]], bool],
    limit: int = 64,
    tokens: dict[str, int] | None = None,
    **report,
) -> list[Step]:
    """Step until ``done(steps so far)``; the first step carries ``report``, every step samples
    ``tokens``."""
    steps: list[Step] = []
    for _ in range(limit):
        steps.append(inst.step(tokens=tokens, **report))
        report = {}
        if done(steps):
            return steps
    raise AssertionError(f"not done after {limit} steps")


def finished(request_id: str) -> Callable[[list[Step]], bool]:
    return lambda steps: steps[-1].finished(request_id) is not None


def test_decode_pulls_once_and_computes_the_last_token() -> None:
    d = instance("kv_consumer")
    req = d.request("d-1", 40, params=remote_prefill_params(40, [11, 12, 13]), max_tokens=3)
    steps = [d.step()]
    (pull,) = steps[0].orders.pulls
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert pull.local_block_ids == tuple(d.block_ids("d-1")) and len(pull.local_block_ids) == 3
    steps += [d.step() for _ in range(3)]  # the read is under way
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    steps += until(d, lambda s: "d-1" in s[-1].scheduled, finished_recving={"d-1"})
    assert steps[-1].scheduled["d-1"] == 1  # the last prompt token only
    steps += until(d, finished("d-1"))
    assert steps[-1].finished("d-1").finish_reason == FinishReason.LENGTH
    assert [p for s in steps for p in s.orders.pulls] == [pull]
    assert not any(s.orders.cancels for s in steps)
    d.assert_empty()


def test_prefill_holds_only_the_prompt_blocks_of_a_request_scheduled_past_its_end() -> None:
    """A 48-token prompt fills three blocks. Its first token is EOS, but the scheduler did not
    know that when it scheduled the request's next step, which needs a fourth block. The hold
    names the three prompt blocks; all four go back when decode has read."""
    p = instance("kv_producer")
    req = p.request("p-1", 3 * BLOCK, params=hand_off(), max_tokens=4)
    steps = until(p, finished("p-1"), tokens={"p-1": EOS_TOKEN_ID})
    assert sum(s.scheduled.get("p-1", 0) for s in steps) == 3 * BLOCK + 1
    assert req.status == RequestStatus.FINISHED_STOPPED
    blocks = p.block_ids("p-1")
    assert len(blocks) == 4
    params = steps[-1].finished("p-1").kv_transfer_params
    assert decode_accepts(params, 3 * BLOCK).remote_block_ids == blocks[:3]

    steps = until(p, lambda s: bool(s[-1].orders.holds))
    (hold,) = steps[-1].orders.holds
    assert hold.block_ids == tuple(blocks[:3])
    assert p.free_blocks() == p.initial_free_blocks - 4
    until(p, lambda _: "p-1" not in p.scheduler.requests, finished_sending={"p-1"})
    p.assert_empty()


def test_a_one_token_prefill_is_not_scheduled_past_its_end() -> None:
    p = instance("kv_producer")
    p.request("p-2", 3 * BLOCK, params=hand_off(), max_tokens=1)
    steps = until(p, finished("p-2"))
    assert sum(s.scheduled.get("p-2", 0) for s in steps) == 3 * BLOCK
    blocks = p.block_ids("p-2")
    params = steps[-1].finished("p-2").kv_transfer_params
    assert decode_accepts(params, 3 * BLOCK).remote_block_ids == blocks and len(blocks) == 3
    until(p, lambda s: bool(s[-1].orders.holds))
    until(p, lambda _: "p-2" not in p.scheduler.requests, finished_sending={"p-2"})
    p.assert_empty()


def test_an_abort_while_the_kv_loads_cancels_the_pull_and_frees_the_blocks_once() -> None:
    d = instance("kv_consumer")
    busy = d.request("busy", 8, max_tokens=12)
    d.request("d-2", 40, params=remote_prefill_params(40, [11, 12, 13]))
    (pull,) = d.step().orders.pulls
    d.abort("d-2")
    steps = until(d, lambda s: bool(s[-1].orders.cancels))
    assert steps[-1].orders.cancels == ["d-2"]
    assert d.block_ids("d-2") == list(pull.local_block_ids)

    until(d, lambda _: "d-2" not in d.scheduler.requests, finished_recving={"d-2"})
    assert d.block_ids("d-2") == []
    d.step(finished_recving={"d-2"})  # a duplicate: dropped, not freed twice
    until(d, lambda _: busy.is_finished())
    d.assert_empty()


def test_a_failed_load_is_recomputed_under_policy_recompute() -> None:
    d = instance("kv_consumer", kv_load_failure_policy="recompute")
    req = d.request("d-3", 40, params=remote_prefill_params(40, [11, 12, 13]), max_tokens=2)
    steps = [d.step()]
    (pull,) = steps[0].orders.pulls
    steps += until(
        d,
        lambda s: "d-3" in s[-1].scheduled,
        finished_recving={"d-3"},
        invalid_block_ids=set(pull.local_block_ids[1:]),
    )
    assert steps[-1].scheduled["d-3"] == 40 - BLOCK  # the first block loaded
    steps += until(d, finished("d-3"))
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert [p for s in steps for p in s.orders.pulls] == [pull]
    d.assert_empty()


def test_a_hand_off_between_two_async_instances() -> None:
    p = instance("kv_producer", tensor_parallel_size=2, decode_tp=1)
    d = instance("kv_consumer", prefill_tp=2, decode_tp=1)
    client = {"model": "tiny", "prompt": "x", "max_tokens": 4}
    prompt = prompt_tokens("async-handoff", 40)

    body = bodies.serial_prefill_body(client)
    p.request("cmpl-p", prompt, params=body["kv_transfer_params"], max_tokens=body["max_tokens"])
    steps = until(p, finished("cmpl-p"))
    params = steps[-1].finished("cmpl-p").kv_transfer_params
    hold = until(p, lambda s: bool(s[-1].orders.holds))[-1].orders.holds[0]

    decode_params = bodies.decode_body(client, params)["kv_transfer_params"]
    d.request("cmpl-d", prompt, params=decode_params, max_tokens=4)
    (pull,) = d.step().orders.pulls
    assert (pull.transfer_id, pull.remote_block_ids) == (hold.transfer_id, hold.block_ids)
    assert pull.remote_tp_size == 2

    until(d, lambda s: "cmpl-d" in s[-1].scheduled, finished_recving={"cmpl-d"})
    until(p, lambda _: not p.scheduler.requests, finished_sending={"cmpl-p"})
    until(d, finished("cmpl-d"))
    p.assert_empty()
    d.assert_empty()
