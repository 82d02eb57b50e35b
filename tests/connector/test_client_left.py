"""A client that leaves while its decode request is about to pull: the router frees prefill's
hold (``DropHold``) while the request's abort is still on its way to decode's engine, and decode's
claim finds the hold gone. Two clean-clone CI runs counted that race as a failed pull (and logged
it as a warning on both sides), although nothing failed but the client's patience.

The decode worker must still report the blocks as load errors (vLLM has not aborted the request
yet: reporting it loaded would decode from blocks that never got a byte), but count no failed
pull and warn nobody. Wired as :mod:`test_sleep_mode` wires it: the in-process transport, no
engine (the race needs a client hanging up within a millisecond of decode's claim)."""

from __future__ import annotations

import logging

from test_sleep_mode import BLOCK, Pair, _blocks

from vam_testing.waiting import wait_until
from vllm_ascend_mooncake.datapath.orders import PullOrder


def test_a_claim_that_races_its_clients_leaving_is_no_failure_and_loads_nothing(caplog) -> None:
    pair = Pair()
    worker = pair.decode
    try:
        pair.tracker.hold("t-1", request_id="r-1", block_ids=(4, 1), num_prompt_tokens=2 * BLOCK)
        assert pair.tracker.drop_unread("t-1").reason.startswith("freed")  # the client left
        worker.receiver.submit(
            PullOrder(
                request_id="d-1",
                transfer_id="t-1",
                local_block_ids=(0, 5),
                remote_block_ids=(4, 1),
                remote_host="127.0.0.1",
                remote_port=pair.port,
                remote_engine_id=pair.engine_id,
                num_prompt_tokens=2 * BLOCK,
            )
        )
        recving: set[str] = set()
        errors: set[int] = set()

        def reported() -> bool:
            worker.receiver.wait_for_news(0.05)
            recving.update(worker.get_finished(False)[1])
            errors.update(worker.get_block_ids_with_load_errors())
            return "d-1" in recving

        with caplog.at_level(logging.INFO):
            wait_until(reported, "the pull is reported")
        assert errors == {0, 5}  # not loaded: vLLM must not decode from them
        assert worker.stats.data.get("failed_pulls", []) == []  # not a failed pull
        assert bool((_blocks(pair.decode_cache, 0) == -1.0).all())  # nothing landed
        warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert warned == [], [r.getMessage() for r in warned]
        assert any("client left" in r.getMessage() for r in caplog.records)
        refused = pair.tracker.claim("t-1", 0)
        assert refused.status == "dropped"
    finally:
        pair.close()
