"""The decode receiver against real prefill side channels, moving bytes in-process.

Prefill ranks (``SendTracker`` + ``PrefillSender`` on loopback ZMQ) and decode ranks (a real
``Receiver`` with its ``PeerDirectory`` and client) live in this process; their KV caches are CPU
tensors shaped like vLLM's (or like vllm-ascend's MLA nope and rope caches), and
:class:`InProcessTransport` copies the bytes (``receiver_cluster.py``). Every pull's blocks
are compared byte for byte with the reference, and every report (vLLM's and prefill's) is checked.

The pipeline as a whole is tested here: byte-exact pulls of every layout and TP pair, staging,
claims, early pulls and the planning threads, fix-ups, shutdown. What one stage decides is tested
with that stage: what is reported to vLLM in ``test_pull_reports.py``, the reads of one peer in
``test_peer_reads.py``, the lookup of the peers in ``test_peer_lookup.py``.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch
from receiver_cluster import (
    ASCEND_MLA_WIDTHS,
    BLOCK_SIZE,
    CPU_VEC_PACKING,
    DECODE_BLOCKS,
    FAST,
    LAYERS,
    PREFILL_BLOCKS,
    PROMPT_TOKENS,
    Cluster,
    Decode,
    QueuedFixupMemory,
    pull_a_prompt_and_check_every_slot,
)

from vllm_ascend_mooncake.core.layout import BlockOrder
from vllm_ascend_mooncake.core.relayout import LocalMemory
from vllm_ascend_mooncake.core.topology import TransferTopology
from vllm_ascend_mooncake.datapath.failures import FailureKind
from vllm_ascend_mooncake.datapath.fake import InProcessTransport
from vllm_ascend_mooncake.datapath.registration import (
    kv_memory_ranges,
)
from vllm_ascend_mooncake.datapath.transport import TransferError


def test_gqa_merge_decode_tp1_reads_two_prefill_ranks_byte_exact(cluster) -> None:
    c = cluster(4, prefill_tp=2, decode_tp=1)
    (decode,) = c.decode
    local, remote = [3, 4, 5, 9], [6, 7, 8, 2]  # a coalesced run (fixed up) and a lone block
    c.pull("r1", local, remote)
    decode.wait(["r1"])
    assert decode.done == {"r1"} and not decode.failed
    decode.check_blocks(c.ref, local, remote)
    assert all(c.freed(p, "r1") for p in c.prefill)  # both ranks got a successful read-done
    assert all(p.notices == [("t-r1", 0, True)] for p in c.prefill)
    assert decode.transport.num_reads >= 2  # one batch per prefill rank at least
    (stats,) = decode.receiver.take_stats()
    assert stats.num_descriptors == decode.transport.num_descriptors
    assert stats.num_bytes == decode.transport.num_bytes > 0


def test_token_major_slice_decode_tp2_reads_head_slices_through_staging(cluster) -> None:
    c = cluster(4, prefill_tp=1, decode_tp=2, token_major=True)
    local, remote = [5, 0, 6], [1, 8, 9]
    c.pull_and_check(local, remote)
    assert c.freed(c.prefill[0], "r1")
    assert sorted(c.prefill[0].notices) == [("t-r1", 0, True), ("t-r1", 1, True)]


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2), (2, 4), (4, 2), (1, 1)])
def test_ascend_mla_nope_and_rope_caches_pull_byte_exact(cluster, prefill_tp, decode_tp) -> None:
    """vllm-ascend MLA: per layer a nope and a rope tensor of different widths, each its own
    replicated latent region; every decode rank reads whole blocks of both from one prefill rank,
    whatever the TP pair, and writes nothing else."""
    c = cluster(1, prefill_tp, decode_tp, mla_widths=ASCEND_MLA_WIDTHS)
    names = [f"layer.{i}.{part}" for i in range(LAYERS) for part in ("nope", "rope")]
    widths = [2 * w for w in ASCEND_MLA_WIDTHS] * LAYERS  # float16
    for side in c.prefill + c.decode:
        assert [r.name for r in side.cache.regions] == names
        assert [r.layout.head_token_bytes for r in side.cache.regions] == widths
        assert {r.layout.block_order for r in side.cache.regions} == {BlockOrder.LATENT}
    local, remote = [3, 4, 5, 9, 0], [6, 7, 8, 2, 11]  # a coalesced run and lone blocks
    c.pull_and_check(local, remote)
    for decode in c.decode:
        (stats,) = decode.receiver.take_stats()
        assert stats.num_bytes == len(local) * BLOCK_SIZE * sum(widths)  # each region once
    assert all(c.freed(p, "r1") for p in c.prefill)
    notices = [notice for p in c.prefill for notice in p.notices]
    assert sorted(notices) == [("t-r1", d, True) for d in range(decode_tp)]  # one source each


def test_a_slice_pull_without_staging_fails_and_releases_prefill(cluster) -> None:
    c = cluster(4, prefill_tp=1, decode_tp=2, token_major=True, staging=False)
    c.pull("r1", [1, 2], [3, 4], ranks=[0])
    decode = c.decode[0]
    decode.wait(["r1"])
    assert "staging" in decode.failed["r1"].reason
    assert decode.failed["r1"].kind is FailureKind.NO_STAGING
    assert decode.transport.num_reads == 0
    assert np.array_equal(decode.cache.bytes, decode.snapshot)


def test_an_early_pull_is_granted_when_prefill_finishes(cluster) -> None:
    c = cluster(4, prefill_tp=2, decode_tp=1)
    (decode,) = c.decode
    local, remote = [1, 2], [5, 6]
    decode.receiver.submit(c.order("r1", local, remote, early=True))
    time.sleep(0.1)  # the claims wait for prefill
    assert decode.receiver.take_finished() == (set(), {})
    c.hold("r1", remote)
    decode.wait(["r1"])
    assert decode.done == {"r1"}
    decode.check_blocks(c.ref, local, remote)


def test_a_pull_of_a_transfer_prefill_dropped_fails_at_once_saying_why(cluster) -> None:
    """Issue #43 item f: a transfer prefill no longer holds is refused at once, with the reason
    it went (a hold the router freed, a prefill aborted before the hand-off, one read already),
    not after the claim's wait; a claim parked for it is answered the moment it goes."""
    options = dataclasses.replace(FAST, claim_wait_s=30.0, prefill_wait_s=30.0)
    c = cluster(4, prefill_tp=1, decode_tp=1, options=options)
    (decode,), (prefill,) = c.decode, c.prefill

    def failure(request_id: str):
        decode.wait([request_id], timeout_s=2.0)
        assert request_id not in decode.done
        return decode.failed[request_id]

    c.hold("r1", [2, 3])
    assert prefill.tracker.drop_unread("t-r1").reason.startswith("freed")  # the client left
    started = time.monotonic()
    decode.receiver.submit(c.order("r1", [1, 2], [2, 3]))
    gone = failure("r1")
    assert gone.kind is FailureKind.CLIENT_LEFT  # its abort is on its way: not a failure
    assert "router" in gone.reason and "client left" in gone.reason, gone.reason

    decode.receiver.submit(c.order("r2", [1, 2], [2, 3], early=True))  # waits for prefill
    time.sleep(0.2)
    prefill.tracker.drop("t-r2")  # prefill aborted it: no hand-off
    aborted = failure("r2")
    assert aborted.kind is FailureKind.REFUSED
    assert "without a hand-off" in aborted.reason, aborted.reason

    c.pull("r3", [4], [5])
    decode.wait(["r3"])
    assert decode.done == {"r3"}
    assert c.freed(prefill, "r3")
    again = dataclasses.replace(c.order("r4", [6], [5]), transfer_id="t-r3")  # read already
    decode.receiver.submit(again)
    assert "every decode rank that reads it was done" in failure("r4").reason
    assert time.monotonic() - started < 5.0  # not claim_wait_s


def test_each_way_prefill_can_turn_a_claim_down_is_a_failure_of_its_own_kind(cluster) -> None:
    """Never held within claim_wait_s (not ready), held for another prompt (refused), held in
    other blocks than the params name (grant mismatch): each fails its pull with its kind, and
    nothing is read."""
    c = cluster(4, prefill_tp=1, decode_tp=1)
    (decode,) = c.decode
    (prefill,) = c.prefill
    prefill.tracker.hold("t-other-prompt", request_id="p1", block_ids=(3,), num_prompt_tokens=1)
    prefill.tracker.hold(
        "t-other-blocks", request_id="p2", block_ids=(5, 6), num_prompt_tokens=PROMPT_TOKENS
    )
    orders = {
        "never-held": c.order("never-held", [1], [2]),
        "other-prompt": dataclasses.replace(
            c.order("x", [2], [3]), request_id="other-prompt", transfer_id="t-other-prompt"
        ),
        "other-blocks": dataclasses.replace(
            c.order("x", [3, 4], [7, 8]), request_id="other-blocks", transfer_id="t-other-blocks"
        ),
    }
    for order in orders.values():
        decode.receiver.submit(order)
    decode.wait(list(orders), timeout_s=FAST.claim_wait_s + 10)
    assert {r: f.kind for r, f in decode.failed.items()} == {
        "never-held": FailureKind.NOT_READY,
        "other-prompt": FailureKind.REFUSED,
        "other-blocks": FailureKind.GRANT_MISMATCH,
    }
    assert "the prompts differ" in decode.failed["other-prompt"].reason
    assert decode.transport.num_reads == 0
    assert np.array_equal(decode.cache.bytes, decode.snapshot)


def test_the_fake_transport_refuses_reads_outside_registered_memory() -> None:
    prefill, decode = InProcessTransport(), InProcessTransport()
    source = torch.arange(64, dtype=torch.uint8)
    target = torch.zeros(64, dtype=torch.uint8)
    prefill.register(kv_memory_ranges([source]))
    decode.register(kv_memory_ranges([target]))
    src, dst = source.data_ptr(), target.data_ptr()
    try:
        for local, remote, length in ((dst, src + 32, 33), (dst + 32, src, 33)):
            with pytest.raises(TransferError, match="outside"):
                # a valid first descriptor: nothing is copied before the whole read is checked
                decode.read(prefill.session, [dst, local], [src, remote], [8, length])
        assert not target.any()
        decode.read(prefill.session, [dst + 8], [src + 16], [4])
        assert target[8:12].tolist() == [16, 17, 18, 19] and int(target.sum()) == 70
        prefill.close()
        with pytest.raises(TransferError, match="closed"):
            decode.read(prefill.session, [dst], [src], [1])
    finally:
        prefill.close()
        decode.close()


def test_swaps_have_run_when_a_merged_pull_is_reported(cluster, queued_fixups) -> None:
    c = cluster(4, prefill_tp=2, decode_tp=1, memory_type=QueuedFixupMemory)
    (decode,) = c.decode
    local, remote = [3, 4, 5, 9], [6, 7, 8, 2]  # a coalesced run: fixed up by swaps
    c.pull("r1", local, remote)
    decode.wait(["r1"])
    assert decode.done == {"r1"} and not decode.failed
    assert decode.memory.fences >= 1 and decode.memory.queued == []
    decode.check_blocks(c.ref, local, remote)  # before anyone else fences


def test_fence_waits_for_nothing_on_cpu() -> None:
    memory = LocalMemory.from_tensors([torch.zeros(64, dtype=torch.uint8)])
    memory.fence()  # CPU ops have finished when they return: nothing to wait for
    assert memory._devices == []


def test_fence_waits_for_the_threads_current_stream_of_the_device(monkeypatch) -> None:
    # No accelerator here: torch.cuda's stream lookup is replaced, the device object is real.
    from vllm_ascend_mooncake.core.relayout import wait_for_device

    synchronized = []

    class Stream:
        def __init__(self, device) -> None:
            self.device = device

        def synchronize(self) -> None:
            synchronized.append(self.device)

    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("device-wide sync"))
    wait_for_device(torch.device("cuda", 1))
    assert synchronized == [torch.device("cuda", 1)]


def test_a_prefill_configured_for_decode_tp_2_serves_a_tp_1_decode(cluster) -> None:
    """The prefill learns its readers from the first claim: a TP 1 decode reads it whole, and
    it frees the blocks when that one reader is done (not at its timeout)."""
    c = cluster(4, prefill_tp=1, decode_tp=2)  # the prefill rank expects decode ranks 0 and 1
    (prefill,) = c.prefill
    decode = Decode(TransferTopology(4, 1, 1), 0, False, FAST)
    try:
        local, remote = [2, 3], [4, 5]
        c.hold("r1", remote)
        decode.receiver.submit(c.order("r1", local, remote))
        decode.wait(["r1"])
        assert decode.done == {"r1"} and not decode.failed
        decode.check_blocks(c.ref, local, remote)
        assert c.freed(prefill, "r1", timeout_s=3.0)
        assert prefill.notices == [("t-r1", 0, True)]
    finally:
        decode.close()


@pytest.mark.parametrize("blocks", [(16, 32), (32, 16)])
@pytest.mark.parametrize("tps", [(2, 1), (1, 2), (1, 1), (4, 2)])
@pytest.mark.parametrize("cached_blocks", [0, 1])
@pytest.mark.parametrize("cache", ["token_major", "cpu_vec_head_major"])
def test_blocks_of_different_sizes_land_token_by_token(
    cluster, blocks, tps, cached_blocks, cache
) -> None:
    """Prefill and decode block sizes differ (one divides the other): the real receiver plans with
    the prompt length and every decode slot holds its token, checked against ReferencePrompt.
    Head-major blocks packed like vLLM CPU's are cut row by row through the staging buffer."""
    prefill_block, decode_block = blocks
    token_major = cache == "token_major"
    c = cluster(
        4,
        *tps,
        token_major=token_major,
        prefill_block=prefill_block,
        block_size=decode_block,
        packing=() if token_major else CPU_VEC_PACKING,
    )
    pull_a_prompt_and_check_every_slot(c, prefill_block, decode_block, cached_blocks)


def test_shutdown_does_not_wait_out_an_early_pull() -> None:
    """An early pull waits up to prefill_wait_s for prefill (#27 row 9); shutting down gives it
    up at its next ask instead (a bound far below prefill_wait_s, not a measurement)."""
    c = Cluster(4, prefill_tp=1, decode_tp=1, options=dataclasses.replace(FAST, prefill_wait_s=60))
    try:
        (d,) = c.decode
        d.receiver.submit(c.order("early", [1], [1], early=True))
        time.sleep(0.2)  # the pull is asking prefill by now (nothing holds it)
        started = time.monotonic()
        d.receiver.shutdown()
        assert time.monotonic() - started < 20
        _, failed = d.receiver.take_finished()
        assert failed["early"].cancelled
    finally:
        for side in c.prefill:
            side.close()
        c.decode[0].side.client.close()
        c.decode[0].transport.close()


def test_a_quarantined_staging_area_fails_later_pulls_instead_of_hanging_them() -> None:
    """A read that never settles keeps its staging area for ever (#27 row 5): the pulls that
    need it next must fail after claim_wait_s, or when vLLM cancels them, and shutdown must
    return; none may wait for ever (the worker would never report anything again)."""
    c = Cluster(4, prefill_tp=1, decode_tp=2, token_major=True, options=FAST)  # slices stage
    d = c.decode[0]
    try:
        d.transport.fail_reads(1, unsettled=True)
        c.pull("quarantined", [1], [1], ranks=[0])
        deadline = time.monotonic() + 10
        while d.receiver._staging.num_quarantined < 1:
            assert time.monotonic() < deadline, "the unsettled read was never quarantined"
            time.sleep(0.01)
        c.pull("waits", [2], [2], ranks=[0])
        c.pull("cancelled", [3], [3], ranks=[0])
        time.sleep(0.2)
        d.receiver.cancel("cancelled")
        d.wait(["waits", "cancelled"], timeout_s=FAST.claim_wait_s + 10)
        assert "no staging area became free" in d.failed["waits"].reason
        assert "1 of 1 held by reads that never settled" in d.failed["waits"].reason
        assert d.failed["waits"].kind is FailureKind.NO_STAGING
        assert d.failed["cancelled"].cancelled
        assert "quarantined" not in d.done | set(d.failed)  # never reported: bytes may land
    finally:
        c.close()  # returns: no planning thread is left waiting for an area


def test_a_pull_whose_kv_is_held_never_waits_behind_early_pulls() -> None:
    """Early pulls wait for prefill up to prefill_wait_s (#27 row 4); when they filled every
    planning thread, a pull whose KV was held already waited behind them (2.8 s of a 3 s
    prefill_wait_s in the repro). The bound is half of prefill_wait_s, not a measurement."""
    options = dataclasses.replace(FAST, num_threads=1, prefill_wait_s=6.0)  # 4 planning threads
    c = Cluster(4, prefill_tp=1, decode_tp=1, options=options)
    (d,) = c.decode
    try:
        for i in range(8):  # prefill is still computing these
            d.receiver.submit(c.order(f"long{i}", [i], [i], early=True))
        time.sleep(0.2)
        started = time.monotonic()
        c.pull("ready", [10, 11], [9, 10])
        d.wait(["ready"], timeout_s=10)
        assert "ready" in d.done
        assert time.monotonic() - started < options.prefill_wait_s / 2
        d.check_blocks(c.ref, [10, 11], [9, 10])
    finally:
        c.close()


def test_every_early_pull_waits_for_prefill_at_once_on_no_thread_of_its_own() -> None:
    """Sixteen early pulls on a worker with four planning threads (#27 item 2): every claim must
    be waiting at prefill at once (a thread per waiting claim let four wait and queued the
    rest), and every pull lands once prefill holds its blocks."""
    options = dataclasses.replace(FAST, num_threads=1, prefill_wait_s=30.0)
    c = Cluster(4, prefill_tp=1, decode_tp=1, options=options)
    (d,) = c.decode
    (p,) = c.prefill
    claimed: set[str] = set()
    claim = p.tracker.claim

    def record(transfer_id, *args, **kw):
        claimed.add(transfer_id)
        return claim(transfer_id, *args, **kw)

    p.tracker.claim = record
    try:
        names = [f"early{i}" for i in range(DECODE_BLOCKS)]
        for i, name in enumerate(names):
            d.receiver.submit(c.order(name, [i], [i % PREFILL_BLOCKS], early=True))
        deadline = time.monotonic() + 10
        while len(claimed) < len(names):
            assert time.monotonic() < deadline, f"only {len(claimed)} claims reached prefill"
            time.sleep(0.01)
        assert not d.receiver.take_finished()[0], "granted before prefill held anything"
        for i, name in enumerate(names):
            c.hold(name, [i % PREFILL_BLOCKS])
        d.wait(names, timeout_s=10)
        assert set(names) == d.done
        d.check_blocks(c.ref, range(len(names)), [i % PREFILL_BLOCKS for i in range(len(names))])
    finally:
        c.close()
