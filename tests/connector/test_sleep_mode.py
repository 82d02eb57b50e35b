"""vLLM 0.33+'s sleep mode: ``unregister_kv_caches`` before the KV cache is discarded and
``restore_kv_caches`` after wake-up (``vllm/v1/worker/gpu_worker.py``: ``sleep``/``wake_up``).

The worker's own sides are built by ``connector/wiring.py`` over the in-process transport (no
Mooncake, no vLLM engine: vLLM's CPU platform has no sleep mode, so the hooks are called here as
vLLM's GPU worker calls them). While asleep no byte may be served or read, held blocks are freed
(their bytes are about to be lost) without cutting a granted lease short, and after the wake-up
transfers work again while those released for the sleep stay refused.
"""

from __future__ import annotations

import threading

import torch
from test_wiring import BLOCK, BLOCKS, HEADS, LAYERS, _kv_cache, _who, config

from vam_testing.waiting import wait_until
from vllm_ascend_mooncake.connector.facade import MooncakeHeteroConnector
from vllm_ascend_mooncake.connector.stats import TransferStats
from vllm_ascend_mooncake.connector.wiring import (
    PrefillSettings,
    build_decode_side,
    build_prefill_side,
    decode_settings,
)
from vllm_ascend_mooncake.connector.worker import ASLEEP, ConnectorWorker
from vllm_ascend_mooncake.core.topology import TransferTopology
from vllm_ascend_mooncake.datapath.failures import FailureKind
from vllm_ascend_mooncake.datapath.fake import InProcessTransport
from vllm_ascend_mooncake.datapath.orders import PullOrder
from vllm_ascend_mooncake.launch.ports import free_port_range

PAGE = HEADS * BLOCK * 8  # floats per block and layer (test_wiring's CONTENT is 8)


class Pair:
    """A prefill worker and a decode worker (TP 1 each) wired over the in-process transport."""

    def __init__(self) -> None:
        topology = TransferTopology(HEADS, 1, 1)
        self.port = free_port_range(1)
        self.prefill_cache, self.decode_cache = _kv_cache(None), _kv_cache(-1.0)
        self.prefill = self._worker(InProcessTransport())
        side = build_prefill_side(
            _who("prefill"),
            topology,
            self.prefill.transport,
            self.prefill_cache,
            PrefillSettings("127.0.0.1", self.port, release_timeout_s=30.0),
        )
        self.prefill.sender = side.sender
        self.engine_id = side.metadata.engine_id
        self.decode = self._worker(InProcessTransport())
        decode_side = build_decode_side(
            _who("decode"),
            topology,
            self.decode.transport,
            self.decode_cache,
            decode_settings(config(1, 1)),
        )
        self.decode._decode, self.decode.receiver = decode_side, decode_side.receiver

    @staticmethod
    def _worker(transport: InProcessTransport) -> ConnectorWorker:
        worker = object.__new__(ConnectorWorker)  # its sides are set by the caller
        worker.config = type("Config", (), {"role": "test"})()
        worker.tp_rank, worker.transport = 0, transport
        worker.sender = worker.receiver = worker._decode = None
        worker._unregistered = None
        worker.stats, worker._load_errors = TransferStats(), set()
        return worker

    @property
    def tracker(self):
        return self.prefill.sender.tracker

    def pull(self, request_id: str, transfer_id: str, remote: tuple[int, ...]) -> dict:
        """Submit a pull into decode blocks (0, 5) and return its outcome: done or the failure."""
        self.decode.receiver.submit(
            PullOrder(
                request_id=request_id,
                transfer_id=transfer_id,
                local_block_ids=(0, 5)[: len(remote)],
                remote_block_ids=remote,
                remote_host="127.0.0.1",
                remote_port=self.port,
                remote_engine_id=self.engine_id,
                num_prompt_tokens=len(remote) * BLOCK,
            )
        )

        def ended() -> dict | None:
            self.decode.receiver.wait_for_news(0.05)
            done, failed = self.decode.receiver.take_finished()
            return {"done": done, "failed": failed} if done or failed else None

        return wait_until(ended, f"the pull of {transfer_id} ends")

    def finished_on_prefill(self, wanted: set[str]) -> set[str]:
        seen: set[str] = set()

        def all_seen() -> bool:
            self.tracker.wait_for_news(0.05)
            seen.update(self.tracker.take_finished())
            return wanted <= seen

        wait_until(all_seen, f"prefill's tracker reports {sorted(wanted)} finished")
        return seen

    def close(self) -> None:
        self.decode._decode.close()
        self.prefill.sender.close()
        self.decode.transport.close()
        self.prefill.transport.close()


def _blocks(cache, block: int) -> torch.Tensor:
    return cache.tensors[0].view(LAYERS, BLOCKS, PAGE)[:, block]


def test_the_connector_declares_sleep_mode_and_registered_kv_access() -> None:
    assert MooncakeHeteroConnector.supports_sleep_mode(None) is True
    try:
        from vllm.config.kv_transfer import KVCacheAccess
    except ImportError:  # vLLM < 0.34 never asks
        return
    access = MooncakeHeteroConnector.kv_cache_access(None)
    assert access == KVCacheAccess.REGISTERS and access.needs_single_chunk()


def test_prefill_asleep_frees_its_holds_refuses_claims_and_serves_again_after_wake_up() -> None:
    pair = Pair()
    try:
        registered = list(pair.prefill.transport.registered)
        pair.tracker.hold("t-old", request_id="r-old", block_ids=(4,), num_prompt_tokens=BLOCK)

        pair.prefill.unregister_kv_caches()
        pair.prefill.unregister_kv_caches()  # idempotent
        assert pair.prefill.transport.registered == ()
        assert pair.finished_on_prefill({"r-old"}) == {"r-old"}  # vLLM may free its blocks
        refused = pair.tracker.claim("t-old", 0)
        assert refused.status == "refused" and refused.reason == ASLEEP
        pair.tracker.hold("t-late", request_id="r-late", block_ids=(2,), num_prompt_tokens=BLOCK)
        assert pair.finished_on_prefill({"r-late"}) == {"r-late"}  # not held while asleep
        outcome = pair.pull("d-asleep", "t-late", (2,))
        assert "asleep" in outcome["failed"]["d-asleep"].reason
        assert outcome["failed"]["d-asleep"].kind is FailureKind.REFUSED

        pair.prefill.restore_kv_caches()
        pair.prefill.restore_kv_caches()  # idempotent
        assert list(pair.prefill.transport.registered) == registered
        # A transfer released for the sleep stays refused: its blocks hold other bytes now.
        stale = pair.pull("d-old", "t-old", (4,))
        assert "already released" in stale["failed"]["d-old"].reason
        assert stale["failed"]["d-old"].kind is FailureKind.REFUSED
        pair.tracker.hold(
            "t-new", request_id="r-new", block_ids=(4, 1), num_prompt_tokens=2 * BLOCK
        )
        fresh = pair.pull("d-new", "t-new", (4, 1))
        assert fresh["done"] == {"d-new"} and not fresh["failed"]
        assert torch.equal(_blocks(pair.decode_cache, 0), _blocks(pair.prefill_cache, 4))
        assert torch.equal(_blocks(pair.decode_cache, 5), _blocks(pair.prefill_cache, 1))
        assert pair.finished_on_prefill({"r-new"}) == {"r-new"}
    finally:
        pair.close()


def test_prefill_sleep_waits_for_a_granted_lease_to_end() -> None:
    """A decode holding a lease may be reading: unregistering then would hand it bytes that the
    wake-up gives to other requests, so the sleep waits for its read-done notice."""
    pair = Pair()
    try:
        pair.tracker.hold("t-1", request_id="r-1", block_ids=(3,), num_prompt_tokens=BLOCK)
        assert pair.tracker.claim("t-1", 0, reader="decode-a").status == "granted"
        sleeping = threading.Thread(target=pair.prefill.unregister_kv_caches)
        sleeping.start()
        sleeping.join(0.3)
        assert sleeping.is_alive(), "unregistered while a decode still held a lease"
        assert pair.prefill.transport.registered != ()
        assert pair.tracker.read_done("t-1", 0, True, reader="decode-a")
        sleeping.join(10)
        assert not sleeping.is_alive()
        assert pair.prefill.transport.registered == ()
        assert pair.finished_on_prefill({"r-1"}) == {"r-1"}
    finally:
        pair.prefill.restore_kv_caches()
        pair.close()


def test_decode_asleep_fails_pulls_at_once_and_pulls_again_after_wake_up() -> None:
    pair = Pair()
    try:
        pair.decode.unregister_kv_caches()
        assert pair.decode.transport.registered == ()
        pair.tracker.hold("t-1", request_id="r-1", block_ids=(4,), num_prompt_tokens=BLOCK)
        asleep = pair.pull("d-1", "t-1", (4,))
        assert asleep["failed"]["d-1"].reason == ASLEEP
        assert asleep["failed"]["d-1"].kind is FailureKind.UNAVAILABLE_HERE
        assert asleep["failed"]["d-1"].local_block_ids == (0,)  # reported as load errors
        assert bool((_blocks(pair.decode_cache, 0) == -1.0).all())  # nothing landed

        pair.decode.restore_kv_caches()
        awake = pair.pull("d-1", "t-1", (4,))
        assert awake["done"] == {"d-1"} and not awake["failed"]
        assert torch.equal(_blocks(pair.decode_cache, 0), _blocks(pair.prefill_cache, 4))
    finally:
        pair.close()


def test_a_pull_interrupted_by_sleep_reports_its_blocks_as_load_errors() -> None:
    """Issue #43 item 3: a pull still waiting for prefill's grant when decode went to sleep
    ended as cancelled, which the worker reports as finished with no load errors (the kind is
    meant for requests vLLM aborted): vLLM, which still wanted the request, then decoded from
    blocks that never got a byte. Interrupted, it fails like a pull submitted while asleep."""
    pair = Pair()
    worker = pair.decode
    try:
        worker.receiver.submit(  # overlapped legs: prefill has not computed it yet
            PullOrder(
                request_id="d-1",
                transfer_id="t-1",
                local_block_ids=(0, 5),
                remote_block_ids=None,
                remote_host="127.0.0.1",
                remote_port=pair.port,
                remote_engine_id=pair.engine_id,
                num_prompt_tokens=2 * BLOCK,
            )
        )
        wait_until(lambda: worker.receiver._claims.num_waiting == 1, "the claim awaits a grant")
        worker.unregister_kv_caches()
        worker.restore_kv_caches()
        recving: set[str] = set()
        errors: set[int] = set()

        def reported() -> bool:
            worker.receiver.wait_for_news(0.05)
            recving.update(worker.get_finished(False)[1])
            errors.update(worker.get_block_ids_with_load_errors())
            return "d-1" in recving

        wait_until(reported, "the interrupted pull is reported")
        assert errors == {0, 5}  # vLLM recomputes them instead of decoding from them
        assert worker.stats.data["failed_pulls"] == [FailureKind.UNAVAILABLE_HERE.value]
        assert bool((_blocks(pair.decode_cache, 0) == -1.0).all())  # nothing landed
    finally:
        pair.close()
