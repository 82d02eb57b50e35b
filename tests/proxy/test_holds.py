"""The proxy's hold renewal (issue #27 item 4) against a real prefill side channel on loopback:
a transfer nobody claimed is kept past ``release_timeout_s`` while its decode request may be
queued, the renewals end once decode read it, and without them the same hold expires."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx
import pytest
from fake_vllm import FakeVllm
from loopback_server import serve_on_loopback

from vam_testing.datapath_cases import worker_metadata
from vam_testing.waiting import wait_until
from vllm_ascend_mooncake.core.topology import TransferTopology
from vllm_ascend_mooncake.datapath.sender import PrefillSender, SendTracker
from vllm_ascend_mooncake.launch.ports import free_port_range
from vllm_ascend_mooncake.proxy import continued_route, holds, overlapped_route, serial_route
from vllm_ascend_mooncake.proxy.holds import HoldKeeper

HOST = "127.0.0.1"
RELEASE_TIMEOUT_S = 1.0
SLOW_RELEASE_TIMEOUT_S = 2.0


@pytest.fixture
def prefill() -> Iterator[tuple[SendTracker, int]]:
    """One prefill worker (TP 1, one decode reader) holding transfer ``t``."""
    with serving_prefill(RELEASE_TIMEOUT_S) as served:
        yield served


@pytest.fixture
def slow_prefill() -> Iterator[tuple[SendTracker, int]]:
    """The same with a release timeout long enough to renew a few times within one."""
    with serving_prefill(SLOW_RELEASE_TIMEOUT_S) as served:
        yield served


@contextmanager
def serving_prefill(
    release_timeout_s: float, transfer_id: str = "t"
) -> Iterator[tuple[SendTracker, int]]:
    port = free_port_range(1)
    tracker = SendTracker(TransferTopology(4, 1, 1), 0, release_timeout_s)
    metadata = worker_metadata(engine_id="prefill", transport_session="s")
    sender = PrefillSender(metadata, tracker, HOST, port)
    tracker.hold(transfer_id)
    try:
        yield tracker, port
    finally:
        sender.close()


def params(port: int, transfer_id: str = "t", tp_size: int = 1) -> dict:
    """What the prefill answered the proxy (the keys the renewal reads)."""
    return {
        "remote_engine_id": "prefill",
        "remote_request_id": transfer_id,
        "remote_host": HOST,
        "remote_port": port,
        "remote_tp_size": tp_size,
    }


def test_a_queued_transfer_is_kept_until_decode_read_it(prefill) -> None:
    tracker, port = prefill

    async def scenario() -> tuple[set[str], int, bool]:
        keeper = HoldKeeper()
        try:
            task = keeper.keep(params(port))
            assert task is not None
            await asyncio.sleep(3 * RELEASE_TIMEOUT_S)  # decode still queued
            kept = tracker.take_finished()
            renewals = keeper.renewals
            tracker.claim("t", 0)
            tracker.read_done("t", 0, True)  # decode ran and read it
            await asyncio.wait_for(task, 2 * RELEASE_TIMEOUT_S)  # the renewals stop by themselves
            return kept, renewals, task.done()
        finally:
            await keeper.close()

    kept, renewals, stopped = asyncio.run(scenario())
    assert kept == set() and renewals >= 2 and stopped
    assert tracker.take_finished() == {"t"} and tracker.take_expired_count() == 0


def test_without_renewals_the_same_hold_expires(prefill) -> None:
    tracker, _ = prefill
    time.sleep(1.5 * RELEASE_TIMEOUT_S)
    assert tracker.take_finished() == {"t"} and tracker.take_expired_count() == 1


def test_renewals_to_a_prefill_that_does_not_answer_end_by_themselves(monkeypatch) -> None:
    monkeypatch.setattr(holds, "MIN_RENEW_PAUSE_S", 0.0)

    async def scenario() -> None:
        keeper = HoldKeeper(timeout_s=0.3)
        try:
            task = keeper.keep(params(free_port_range(1)))  # nobody listens there
            assert task is not None
            await asyncio.wait_for(task, 5.0)  # ends by itself: it does not retry for ever
            assert keeper.renewals == 0
        finally:
            await keeper.close()

    asyncio.run(scenario())


def test_params_that_name_no_transfer_start_nothing() -> None:
    async def scenario() -> None:
        keeper = HoldKeeper()
        try:
            assert keeper.keep(None) is None
            assert keeper.keep({"remote_host": HOST}) is None
        finally:
            await keeper.close()

    asyncio.run(scenario())


def test_a_dead_prefill_delays_no_other_prefills_renewals(prefill) -> None:
    """Issue #43: a dead TP 4 prefill's 6 kept transfers (24 renewals, each waiting out its
    timeout) once filled the keeper's shared threads, and a healthy prefill's hold expired."""
    tracker, port = prefill

    async def scenario() -> int:
        keeper = HoldKeeper()
        try:
            dead = free_port_range(4)  # nobody listens there
            for index in range(6):
                keeper.keep(params(dead, f"dead-{index}", tp_size=4))
            await asyncio.sleep(0.01)
            keeper.keep(params(port))
            await asyncio.sleep(3 * RELEASE_TIMEOUT_S)  # decode still queued
            return keeper.renewals
        finally:
            await keeper.close()

    renewals = asyncio.run(scenario())
    assert tracker.take_finished() == set() and tracker.take_expired_count() == 0
    assert renewals >= 2


def test_a_late_reply_is_asked_again_within_the_lease(slow_prefill) -> None:
    """A worker that answers one renewal later than one try waits (a busy prefill) is asked
    again while the lease lasts, instead of being left alone until its hold expires."""
    tracker, port = slow_prefill
    keep, calls = tracker.keep, []

    def slow_second_answer(transfer_id: str):
        calls.append(transfer_id)
        if len(calls) == 2:
            time.sleep(0.8)  # the side channel's thread: every reply waits behind this one
        return keep(transfer_id)

    tracker.keep = slow_second_answer

    async def scenario() -> None:
        keeper = HoldKeeper(timeout_s=0.3)
        try:
            keeper.keep(params(port))
            await asyncio.sleep(2.25 * SLOW_RELEASE_TIMEOUT_S)
        finally:
            await keeper.close()

    asyncio.run(scenario())
    assert len(calls) > 3
    assert tracker.take_finished() == set() and tracker.take_expired_count() == 0


def test_a_client_that_leaves_before_decode_read_frees_prefills_hold(start_proxy) -> None:
    """Issue #43: a client that hung up after prefill answered left prefill's blocks held until
    its release timeout, since the aborted decode request never claims. The proxy tells prefill
    (``DropHold``) to free a hold nobody leased."""
    with serving_prefill(60.0) as (tracker, port), ExitStack() as stack:
        prefill, decode = FakeVllm("prefill"), FakeVllm("decode")
        prefill.kv_transfer_params = {**params(port), "remote_block_ids": [1, 2]}
        decode.answer_gate.clear()  # the decode request waits in decode's queue
        stack.callback(decode.answer_gate.set)
        urls = serve(stack, prefill, decode)
        proxy = start_proxy(urls[:1], urls[1:], overlap_legs=False)
        body = {"model": "m", "prompt": "hi", "max_tokens": 4}
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and hangs up
            proxy.post("/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.0))
        assert decode.generation_requests()  # decode had the request, and never read it
        freed = wait_until(tracker.take_finished, "prefill frees the abandoned hold", 10)
        assert freed == {"t"} and tracker.take_expired_count() == 0


def counting_drops(tracker: SendTracker) -> list[str]:
    """The DropHold messages ``tracker``'s side channel gets, as they come."""
    drop_unread, dropped = tracker.drop_unread, []

    def counted(transfer_id: str):
        dropped.append(transfer_id)
        return drop_unread(transfer_id)

    tracker.drop_unread = counted  # type: ignore[method-assign]
    return dropped


def serve(stack: ExitStack, *fakes: FakeVllm) -> list[str]:
    """The fakes served on loopback until ``stack`` closes: their URLs."""
    return [stack.enter_context(serve_on_loopback(fake.app())) for fake in fakes]


def connector_fakes(port: int) -> tuple[FakeVllm, FakeVllm]:
    """A prefill and a decode that answer as the connector's engines, prefill's side channel
    on ``port``."""
    prefill, decode = FakeVllm("prefill"), FakeVllm("decode")
    for fake in (prefill, decode):
        fake.generates = fake.hands_off_like_the_connector = True
    prefill.side_channel_port = port
    return prefill, decode


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def after_a_whole_prefill_leg(
    start_proxy, stack: ExitStack, port: int
) -> tuple[FakeVllm, FakeVllm, httpx.Client]:
    """:func:`connector_fakes` behind a proxy on the continued route, after one chat request
    whose whole prefill leg taught the proxy prefill's address (later legs stream)."""
    prefill, decode = connector_fakes(port)
    urls = serve(stack, prefill, decode)
    proxy = start_proxy(urls[:1], urls[1:], first_token="prefill")
    assert proxy.post("/v1/chat/completions", json=CHAT).is_success
    return prefill, decode, proxy


@pytest.mark.parametrize("route", ["serial", "continued"])
def test_a_client_that_leaves_a_streamed_answer_frees_prefills_hold_once(
    start_proxy, route: str
) -> None:
    """Issue #43: a client that hung up once decode's stream had begun (its headers sent while
    the request queued in decode, or its tokens streaming) left prefill's hold renewed until
    4 release timeouts; the relay (serial and overlapped legs) and the continued stream now
    free it with one DropHold."""
    transfer_id = "t" if route == "serial" else "prefill-request"
    with serving_prefill(60.0, transfer_id) as (tracker, port), ExitStack() as stack:
        dropped = counting_drops(tracker)
        if route == "serial":
            prefill, decode = FakeVllm("prefill"), FakeVllm("decode")
            prefill.kv_transfer_params = {**params(port), "remote_block_ids": [1, 2]}
        else:  # the continued route's first request: a whole prefill leg, the connector's params
            prefill, decode = connector_fakes(port)
        decode.stream_gate.clear()  # decode's stream begins, then stalls
        stack.callback(decode.stream_gate.set)
        urls = serve(stack, prefill, decode)
        proxy = start_proxy(
            urls[:1],
            urls[1:],
            overlap_legs=False,
            first_token="decode" if route == "serial" else "prefill",
        )
        body = {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True}
        client = stack.enter_context(httpx.Client(base_url=proxy.base_url, timeout=30))
        with client.stream("POST", "/v1/completions", json=body) as stream:
            assert stream.status_code == 200
            raw = stream.iter_raw()
            next(raw)  # the answer began (prefill's token, on the continued route)
            if route == "continued":
                next(raw)  # and decode's stream
        client.close()
        # the client hung up
        freed = wait_until(tracker.take_finished, "prefill frees the abandoned hold", 10)
        assert freed == {transfer_id} and tracker.take_expired_count() == 0
        time.sleep(1.0)  # no second DropHold comes
        assert dropped == [transfer_id]


def test_a_prompt_that_leaves_room_for_one_token_frees_prefills_hold(start_proxy) -> None:
    """Issue #43 (e): prefill's token is the whole answer of a prompt one token short of
    max_model_len (test_continuation.py), so the KV prefill held for decode is freed at once."""
    with serving_prefill(60.0, "prefill-request") as (tracker, port), ExitStack() as stack:
        dropped = counting_drops(tracker)
        prefill, decode = connector_fakes(port)
        prefill.max_model_len = decode.max_model_len = 16
        urls = serve(stack, prefill, decode)
        proxy = start_proxy(urls[:1], urls[1:], first_token="prefill")
        body = {"model": "m", "prompt": "x" * 14, "max_tokens": 4}  # BOS and 14: 15 tokens
        answer = proxy.post("/v1/completions", json=body).json()
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == 1
        assert decode.generation_requests() == []
        freed = wait_until(tracker.take_finished, "prefill frees the unread hold", 10)
        assert freed == {"prefill-request"} and dropped == ["prefill-request"]


def test_a_streamed_prefill_leg_cut_short_frees_what_prefill_holds(
    start_proxy, monkeypatch
) -> None:
    """Issue #43 (f): a streamed prefill leg that ends without its token names no transfer
    decode may read (test_continuation.py); whatever prefill holds under the proxy's transfer
    id is freed at once."""
    monkeypatch.setattr(continued_route, "new_transfer_id", lambda request_id: "t")
    with serving_prefill(60.0) as (tracker, port), ExitStack() as stack:
        dropped = counting_drops(tracker)
        prefill, decode, proxy = after_a_whole_prefill_leg(start_proxy, stack, port)
        prefill.stream_ends_early = "cut"  # after the role chunk, before the token
        streamed = proxy.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
        assert "kv_transfer_params" not in decode.generation_requests()[-1].body
        freed = wait_until(tracker.take_finished, "prefill frees what it held", 10)
        assert freed == {"t"} and dropped == ["t"]


def test_a_client_that_leaves_before_prefills_token_frees_what_prefill_holds(
    start_proxy, monkeypatch
) -> None:
    """A clean-clone CI run (test_abandoned_clients: a prefill block not freed within 30 s):
    prefill had ended its one-token request and held the KV under the proxy's transfer id, the
    proxy had not read its token yet, and the client hung up then; nobody told prefill, so the
    hold waited out release_timeout_s. The proxy now drops it as the client leaves."""
    monkeypatch.setattr(continued_route, "new_transfer_id", lambda request_id: "t")
    with serving_prefill(60.0) as (tracker, port), ExitStack() as stack:
        dropped = counting_drops(tracker)
        prefill, _, proxy = after_a_whole_prefill_leg(start_proxy, stack, port)
        prefill.stream_gate.clear()  # the streamed leg stalls after its role chunk
        stack.callback(prefill.stream_gate.set)
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and hangs up
            proxy.post(
                "/v1/chat/completions",
                json={**CHAT, "stream": True},
                timeout=httpx.Timeout(30, read=1.0),
            )
        freed = wait_until(tracker.take_finished, "prefill frees the abandoned hold", 10)
        assert freed == {"t"} and dropped == ["t"] and tracker.take_expired_count() == 0


@pytest.mark.parametrize("route", ["overlapped", "serial"])
def test_a_client_that_leaves_before_prefills_answer_is_read_frees_what_prefill_holds(
    start_proxy, monkeypatch, route: str
) -> None:
    """The same window on the routes where decode samples the first token: prefill ended its
    one-token request and held the KV under the proxy's transfer id, the proxy had not read its
    answer yet, and the client hung up then. The proxy drops the hold as the client leaves
    (where it knows the engine's address: a first answer taught it)."""
    serial_ids = iter(["taught", "t"])  # the first request (serial) teaches the address
    monkeypatch.setattr(serial_route, "new_transfer_id", lambda request_id: next(serial_ids))
    monkeypatch.setattr(overlapped_route, "new_transfer_id", lambda request_id: "t")
    with serving_prefill(60.0) as (tracker, port), ExitStack() as stack:
        dropped = counting_drops(tracker)
        prefill, decode = FakeVllm("prefill"), FakeVllm("decode")
        prefill.hands_off_like_the_connector = True
        prefill.side_channel_port = port
        urls = serve(stack, prefill, decode)
        proxy = start_proxy(urls[:1], urls[1:], overlap_legs=route == "overlapped")
        body = {"model": "m", "prompt": "hi", "max_tokens": 4}
        assert proxy.post("/v1/completions", json=body).is_success  # a serial request
        prefill.answer_gate.clear()  # prefill's answer does not reach the proxy
        stack.callback(prefill.answer_gate.set)
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and hangs up
            proxy.post("/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.0))
        assert prefill.generation_requests()[-1].body["kv_transfer_params"]["transfer_id"] == "t"
        later = [r.body["kv_transfer_params"] for r in decode.generation_requests()[1:]]
        # overlapped: decode's leg went out before prefill answered (then closed); serial: none
        assert [p["remote_request_id"] for p in later] == (["t"] if route == "overlapped" else [])
        freed = wait_until(tracker.take_finished, "prefill frees the abandoned hold", 10)
        assert freed == {"t"} and dropped == ["t"] and tracker.take_expired_count() == 0


def test_a_transfer_decode_reads_at_once_costs_one_renewal_per_worker(prefill) -> None:
    """The cost docs/proxy.md gives (issue #43 item g): renewals are not batched, and a request
    decode reads at once costs one KeepHold per prefill worker, which ends its renewals."""
    tracker, port = prefill
    keep, asked = tracker.keep, []

    def counted(transfer_id: str):
        asked.append(transfer_id)
        return keep(transfer_id)

    tracker.keep = counted  # type: ignore[method-assign]
    tracker.claim("t", 0)
    tracker.read_done("t", 0, True)  # decode read it before the first renewal was due

    async def scenario() -> None:
        keeper = HoldKeeper()
        try:
            task = keeper.keep(params(port))
            assert task is not None
            await asyncio.wait_for(task, 3.0)  # ends by itself
        finally:
            await keeper.close()

    asyncio.run(scenario())
    assert asked == ["t"]
