"""The proxy's hold renewal (issue #27 item 4) against a real prefill side channel on loopback:
a transfer nobody claimed is kept past ``release_timeout_s`` while its decode request may be
queued, the renewals end once decode read it, and without them the same hold expires."""

from __future__ import annotations

import asyncio
import time

import pytest

from vllm_ascend_mooncake.core.topology import TransferTopology
from vllm_ascend_mooncake.datapath.sender import PrefillSender, SendTracker
from vllm_ascend_mooncake.datapath.wire import ModelIdentity, WorkerMetadata
from vllm_ascend_mooncake.launch.ports import free_port_range
from vllm_ascend_mooncake.proxy import holds
from vllm_ascend_mooncake.proxy.holds import HoldKeeper

HOST = "127.0.0.1"
RELEASE_TIMEOUT_S = 1.0


@pytest.fixture
def prefill():
    """One prefill worker (TP 1, one decode reader) holding transfer ``t``."""
    port = free_port_range(1)
    tracker = SendTracker(TransferTopology(4, 1, 1), 0, RELEASE_TIMEOUT_S)
    metadata = WorkerMetadata(
        engine_id="prefill",
        incarnation="i",
        tp_rank=0,
        tp_size=1,
        dp_rank=0,
        dp_size=1,
        pp_size=1,
        transport_session="s",
        identity=ModelIdentity("m", "float32", "auto", 32, 64, 4, 2, False),
        regions=[],
    )
    sender = PrefillSender(metadata, tracker, HOST, port)
    tracker.hold("t")
    yield tracker, port
    sender.close()


def params(port: int) -> dict:
    """What the prefill answered the proxy (the keys the renewal reads)."""
    return {
        "remote_engine_id": "prefill",
        "remote_request_id": "t",
        "remote_host": HOST,
        "remote_port": port,
        "remote_tp_size": 1,
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


def test_renewals_to_a_prefill_that_does_not_answer_end_after_one_timeout(monkeypatch) -> None:
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
