"""Decode's lookup of the prefill ranks a pull reads, end to end on the in-process cluster
(``PeerLookup``).

Each rank's metadata fetched and checked once (an incompatible peer refused before any byte
moves, its holds released at once), the ranks named by each request's prefill TP, a peer that
never answers holding one planning thread only, and two pulls of one transfer sending one
read-done notice, from the last of them.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import zmq
from receiver_cluster import (
    BLOCK_SIZE,
    FAST,
    HEAD_TOKEN_BYTES,
    HOST,
    LAYERS,
    PREFILL_BLOCKS,
    Cluster,
    Prefill,
)

from vam_testing.kv_reference import ReferenceKV
from vllm_ascend_mooncake.core.topology import TransferTopology
from vllm_ascend_mooncake.datapath.failures import FailureKind
from vllm_ascend_mooncake.datapath.orders import PullOrder
from vllm_ascend_mooncake.datapath.wire import WorkerMetadata
from vllm_ascend_mooncake.launch.ports import free_port_range


def test_decoded_regions_are_reused_across_requests(cluster, monkeypatch) -> None:
    c = cluster(4, prefill_tp=2, decode_tp=1)
    (decode,) = c.decode
    c.pull("r1", [0], [1])
    decode.wait(["r1"])
    decodes = []
    original = WorkerMetadata.to_regions
    monkeypatch.setattr(
        WorkerMetadata, "to_regions", lambda self: decodes.append(self) or original(self)
    )
    c.pull("r2", [1, 2], [3, 4])
    decode.wait(["r2"])
    assert decode.done == {"r1", "r2"}
    decode.check_blocks(c.ref, [0, 1, 2], [1, 3, 4])
    assert decodes == []  # the peers' regions were decoded at handshake, once


def test_one_decode_instance_reads_prefill_instances_of_two_tp_sizes(cluster) -> None:
    """Configured for prefill TP 2, a decode rank also pulls from a TP 1 prefill: each request's
    params name its prefill's size, and the topology for it is built at handshake."""
    c = cluster(4, prefill_tp=2, decode_tp=1)
    (decode,) = c.decode
    local, remote = [3, 4, 5], [6, 7, 8]
    c.pull("r1", local, remote)
    decode.wait(["r1"])
    decode.check_blocks(c.ref, local, remote)

    other_topo = TransferTopology(4, 1, 1)
    other_ref = ReferenceKV.random(LAYERS, PREFILL_BLOCKS, 4, BLOCK_SIZE, HEAD_TOKEN_BYTES, seed=9)
    other_port = free_port_range(1)
    other = Prefill(other_topo, 0, other_port, other_ref, token_major=False)
    try:
        other.tracker.hold("t-r2", request_id="r2", block_ids=(1, 2), num_prompt_tokens=100)
        decode.snapshot = decode.cache.bytes.copy()
        order = c.order("r2", [10, 11], [1, 2])
        decode.receiver.submit(
            PullOrder(**{**order.__dict__, "remote_port": other_port, "remote_tp_size": 1})
        )
        decode.wait(["r2"])
        assert "r2" in decode.done and not decode.failed
        decode.check_blocks(other_ref, [10, 11], [1, 2])
        assert c.freed(other, "r2") and other.notices == [("t-r2", 0, True)]
        # A request naming the wrong size for that prefill is refused, not read.
        order = c.order("r3", [12], [3])
        other.tracker.hold("t-r3", request_id="r3", block_ids=(3,), num_prompt_tokens=100)
        decode.receiver.submit(
            PullOrder(**{**order.__dict__, "remote_port": other_port, "remote_tp_size": 2})
        )
        decode.wait(["r3"])
        assert "params name TP 2" in decode.failed["r3"].reason
        assert decode.failed["r3"].kind is FailureKind.TP_MISMATCH
    finally:
        other.close()


@pytest.mark.parametrize("prefill_tp", [1, 2])
def test_head_major_blocks_of_different_sizes_are_refused_before_any_byte_moves(
    cluster, prefill_tp
) -> None:
    """Refused at the handshake, and every prefill rank the pull names is still told to release
    its hold at once (not left to its release timeout)."""
    c = cluster(4, prefill_tp, 1, prefill_block=16, block_size=32)
    (decode,) = c.decode
    c.pull("r1", [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7])
    decode.wait(["r1"])
    assert "with head-major blocks whose packing is unknown" in str(decode.failed["r1"])
    assert decode.failed["r1"].kind is FailureKind.INCOMPATIBLE_PEER
    assert decode.failed["r1"].prefill_engine_id == "prefill"  # what the scheduler is told
    assert np.array_equal(decode.cache.bytes, decode.snapshot)
    assert all(c.freed(p, "r1") for p in c.prefill)
    assert sorted(n for p in c.prefill for n in p.notices) == [("t-r1", 0, False)] * prefill_tp


def test_two_pulls_of_one_transfer_on_one_worker_never_read_released_blocks(cluster) -> None:
    """A router retrying the decode leg sends one transfer twice to one worker (#27 row 2): both
    pulls share the worker's lease, so prefill must hear the read-done notice only from the last
    of them; else it frees (and vLLM reuses) the blocks while the other still reads, and that one
    is reported loaded with another request's bytes."""
    c = cluster(4, prefill_tp=1, decode_tp=1)
    (p,), (d,) = c.prefill, c.decode
    remote, first_local, second_local = [1, 2, 3], [4, 5, 6], [10, 11, 12]
    read_done = p.tracker.read_done

    def reuse_when_released(transfer_id, decode_rank, success, reader="", decode_tp=-1):
        answer = read_done(transfer_id, decode_rank, success, reader, decode_tp)
        if not p.tracker.is_held(transfer_id):  # released: vLLM reuses the blocks at once
            for index in range(len(p.cache.regions)):
                for block in remote:
                    p.cache.block(index, block)[:] = 0xEE
        return answer

    p.tracker.read_done = reuse_when_released
    c.hold("a", remote)
    d.transport.delay_s = 0.3  # the second read starts after the first one's notice
    first = c.order("a", first_local, remote)
    d.receiver.submit(first)
    d.receiver.submit(dataclasses.replace(first, request_id="b", local_block_ids=(10, 11, 12)))
    d.wait(["a", "b"], timeout_s=20)
    assert d.done == {"a", "b"} and not d.failed
    for index, region in enumerate(d.cache.regions):
        for local_ids in (first_local, second_local):
            for local, block in zip(local_ids, remote, strict=True):
                want = c.ref.expected_block(index, block, d.heads, region.layout.block_order)
                assert np.array_equal(d.cache.block(index, local), want)
    assert c.freed(p, "a")  # notices travel off the read path: wait for the release first
    assert [notice[0] for notice in p.notices] == ["t-a"]  # one notice, from the last reader


def test_a_prefill_that_never_answers_its_metadata_holds_one_planning_thread_not_all() -> None:
    """Eight pulls naming a prefill that accepts connections but never answers (frozen before
    decode first met it) each looked it up on a planning thread of their own, for three metadata
    timeouts (7.2 s here); a healthy prefill's pull then waited behind them (#27 item 2). The
    bound is two metadata timeouts, not a measurement."""
    options = dataclasses.replace(FAST, num_threads=1)  # four planning threads
    c = Cluster(4, prefill_tp=1, decode_tp=1, options=options, client_timeout_s=2.0)
    (d,) = c.decode
    frozen_port = free_port_range(1)
    frozen = zmq.Context.instance().socket(zmq.ROUTER)  # takes messages, answers none
    frozen.setsockopt(zmq.LINGER, 0)
    frozen.bind(f"tcp://{HOST}:{frozen_port}")
    try:
        for i in range(8):
            order = dataclasses.replace(c.order(f"frozen{i}", [i], [i]), remote_port=frozen_port)
            d.receiver.submit(order)
        time.sleep(0.2)
        started = time.monotonic()
        c.pull("healthy", [10, 11], [9, 10])
        d.wait(["healthy"], timeout_s=30)
        assert "healthy" in d.done
        assert time.monotonic() - started < 2 * d.side.client.timeout_s
        d.check_blocks(c.ref, [10, 11], [9, 10])
    finally:
        c.close()
        frozen.close()
