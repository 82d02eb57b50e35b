"""Decode's reads of one prefill peer, end to end on the in-process cluster (``PeerReader``).

Retries of a transient failure, a read that never settles (never reported, the peer's circuit
opened for a cool-down doubled per such read in a row), reads that do not start once their pull
is stopped, row copies out of staging overlapped with the next read, and the end-to-end
integrity check (``verify_reads``). Every pull's blocks are compared byte for byte with the
reference, and every report (vLLM's and prefill's) is checked.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
from receiver_cluster import (
    CPU_VEC_PACKING,
    FAST,
    HEAD_TOKEN_BYTES,
    LAYERS,
    Prefill,
    QueuedFixupMemory,
    pull_a_prompt_and_check_every_slot,
)

from vam_testing.waiting import wait_until
from vllm_ascend_mooncake.datapath.failures import FailureKind
from vllm_ascend_mooncake.datapath.side_channel import SideChannelError


def test_a_failed_read_fails_the_pull_and_prefill_frees_the_hold(cluster) -> None:
    c = cluster(4, prefill_tp=1, decode_tp=1)
    (decode,), (prefill,) = c.decode, c.prefill
    decode.transport.fail_reads(count=None, peer=prefill.transport.session)
    c.pull("r1", [4, 5, 6], [0, 1, 2])
    decode.wait(["r1"])
    assert not decode.done
    failure = decode.failed["r1"]
    assert failure.local_block_ids == (4, 5, 6) and not failure.cancelled
    assert "injected" in failure.reason and failure.kind is FailureKind.TRANSFER
    assert decode.transport.num_failed_reads == FAST.read_retries + 1  # retried, then gave up
    assert c.freed(prefill, "r1")
    assert prefill.notices == [("t-r1", 0, False)]
    assert np.array_equal(decode.cache.bytes, decode.snapshot)  # nothing copied
    assert decode.receiver.take_stats() == []


def test_a_transient_read_failure_is_retried_and_the_pull_succeeds(cluster) -> None:
    c = cluster(4, prefill_tp=1, decode_tp=1)
    (decode,) = c.decode
    decode.transport.fail_reads(1)
    c.pull("r1", [7, 8], [10, 11])
    decode.wait(["r1"])
    assert decode.done == {"r1"} and not decode.failed
    decode.check_blocks(c.ref, [7, 8], [10, 11])
    assert decode.transport.num_failed_reads == 1
    assert decode.transport.num_reads >= 2
    assert c.freed(c.prefill[0], "r1")
    assert c.prefill[0].notices == [("t-r1", 0, True)]


def test_an_unsettled_read_is_never_reported_nor_retried(cluster) -> None:
    """...and, the peer looking frozen, its next reads fail at once for peer_cooldown_s (they
    would hang as long and be quarantined too); then it is read again."""
    c = cluster(4, prefill_tp=1, decode_tp=1, options=dataclasses.replace(FAST, peer_cooldown_s=1))
    (decode,), (prefill,) = c.decode, c.prefill
    decode.transport.fail_reads(1, unsettled=True)
    c.pull("r1", [1], [2])
    deadline = time.monotonic() + 5
    while not prefill.notices:  # the read ended: prefill hears of it
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert prefill.notices == [("t-r1", 0, False)]
    time.sleep(0.2)
    assert decode.receiver.take_finished() == (set(), {})  # vLLM keeps its blocks
    assert decode.transport.num_reads == 1 and decode.transport.num_failed_reads == 1
    c.pull("r2", [5], [6])  # within the cool-down: failed at once, reported, not read
    decode.wait(["r2"])
    assert "circuit is open" in decode.failed["r2"].reason
    assert decode.failed["r2"].kind is FailureKind.PEER_UNAVAILABLE
    assert decode.transport.num_reads == 1
    time.sleep(1.0)
    c.pull("r3", [3], [4])  # the receiver goes on with other requests
    decode.wait(["r3"])
    assert decode.done == {"r3"}
    decode.check_blocks(c.ref, [3], [4])


def test_a_peer_whose_reads_keep_hanging_is_tried_ever_less_often_until_replaced(cluster) -> None:
    """Issue #43 item c: a prefill whose data path stays frozen while its side channel answers
    cost one quarantined read (its decode blocks, a staging area) per cool-down, for ever: each
    further unsettled read in a row now doubles the cool-down (up to peer_cooldown_max_s), and a
    new incarnation behind the same transport session starts afresh."""
    cooldown = 0.5
    options = dataclasses.replace(FAST, peer_cooldown_s=cooldown, peer_cooldown_max_s=2 * cooldown)
    c = cluster(4, prefill_tp=1, decode_tp=1, options=options)
    (decode,), (prefill,) = c.decode, c.prefill
    session = prefill.transport.session
    decode.transport.fail_reads(None, peer=session, unsettled=True)  # frozen data path

    def pull(request_id: str) -> str:
        """Whether the pull was read (and, never settling, quarantined: never reported) or
        failed at once, its circuit open."""
        reads = decode.transport.num_reads
        c.pull(request_id, [1], [2])
        deadline = time.monotonic() + 5
        while not any(n[0] == f"t-{request_id}" for n in prefill.notices):  # the read ended
            assert time.monotonic() < deadline
            time.sleep(0.01)
        if decode.transport.num_reads > reads:
            return "quarantined"
        decode.wait([request_id])
        return "failed at once"

    assert pull("r1") == "quarantined"  # strike 1: closed for 0.5 s
    time.sleep(1.5 * cooldown)
    assert pull("r2") == "quarantined"  # the probe after the cool-down hangs too: 1 s now
    time.sleep(1.5 * cooldown)
    assert pull("r3") == "failed at once"  # was: read, and quarantined, every 0.5 s
    assert "circuit is open" in decode.failed["r3"].reason
    assert decode.transport.num_reads == 2
    time.sleep(cooldown)
    assert pull("r4") == "quarantined"  # strike 3: capped at 1 s
    time.sleep(1.5 * cooldown)
    assert pull("r5") == "failed at once"
    time.sleep(cooldown)
    assert pull("r6") == "quarantined"
    assert decode.transport.num_reads == 4

    # The prefill restarts behind the same transport session, its data path sound: read at once.
    prefill.close()
    deadline = time.monotonic() + 5
    while True:  # ZMQ frees the old side channel's port in its own time
        try:
            c.prefill[0] = prefill = Prefill(c.topo, 0, c.port, c.ref, False, session=session)
            break
        except SideChannelError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    decode.transport.clear_faults()
    c.pull("r7", [3], [4])
    decode.wait(["r7"])
    assert decode.done == {"r7"}, decode.failed.get("r7")
    decode.check_blocks(c.ref, [3], [4])


@pytest.mark.parametrize("stop", ["suspend", "cancel"])
def test_a_read_queued_on_a_peers_lane_does_not_start_once_its_pull_is_stopped(
    cluster, stop
) -> None:
    """Issue #43 item 6: reads queued on a peer's lane behind another pull's ran although sleep
    mode (or vLLM's cancel) had stopped their pull; after a sleep they land in memory that the
    worker unregistered once suspend returned. They must not start: the pull fails (asleep: its
    blocks are load errors) or ends cancelled."""
    c = cluster(4, prefill_tp=1, decode_tp=1)
    (d,) = c.decode
    started: list[float] = []
    read = d.transport.read

    def recorded(*args) -> None:
        started.append(time.monotonic())
        return read(*args)

    d.transport.read = recorded
    d.transport.delay_s = 0.5  # a's read is under way while b's waits behind it
    c.pull("a", [1, 2], [3, 4])
    wait_until(lambda: started, "a's read starts")
    c.pull("b", [5, 6], [7, 8])
    session = c.prefill[0].transport.session
    wait_until(lambda: d.receiver._lanes.queued(session), "b's read waits on the peer's lane")
    if stop == "suspend":
        d.receiver.suspend("asleep", timeout_s=0.0)  # the worker unregisters its memory now
    else:
        d.receiver.cancel("b")
    stopped_at = time.monotonic()
    d.wait(["a", "b"], timeout_s=10)
    assert all(t < stopped_at for t in started), "a read started after its pull was stopped"
    failure = d.failed["b"]
    if stop == "suspend":
        assert failure.kind is FailureKind.UNAVAILABLE_HERE and failure.local_block_ids == (5, 6)
    else:
        assert failure.cancelled
    for index in range(len(d.cache.regions)):
        for block in (5, 6):
            start = d.cache.offset(index, block)
            length = d.cache.regions[index].layout.block_len
            assert np.array_equal(
                d.cache.bytes[start : start + length], d.snapshot[start : start + length]
            )


def test_staged_row_copies_run_before_the_next_read_reuses_the_staging_area(
    cluster, queued_fixups
) -> None:
    # 2 KiB of staging holds two prefill blocks (2 heads x 16 tokens x 32 B): the 6 staged blocks
    # (3 per layer) take three reads into the same bytes.
    c = cluster(
        4,
        prefill_tp=2,
        decode_tp=4,
        token_major=True,
        staging_bytes=2048,
        memory_type=QueuedFixupMemory,
    )
    local, remote = [5, 0, 6], [1, 8, 9]
    c.pull("r1", local, remote)
    for decode in c.decode:
        decode.wait(["r1"])
        assert decode.done == {"r1"} and not decode.failed
        assert decode.transport.num_reads >= 3  # the staging area was reused
        assert decode.memory.queued == []  # nothing left queued when reported
        decode.check_blocks(c.ref, local, remote)


#: One prefill block of the mixed-size test's pulls: 4 heads x 16 tokens x HEAD_TOKEN_BYTES.
MIXED_PREFILL_BLOCK_BYTES = 4 * 16 * HEAD_TOKEN_BYTES


@pytest.mark.parametrize(
    "staging_bytes,overlapped",
    [(2 * MIXED_PREFILL_BLOCK_BYTES, True), (MIXED_PREFILL_BLOCK_BYTES, False)],
)
def test_copies_out_of_staging_run_while_the_next_batch_is_read_where_it_lands_apart(
    cluster, monkeypatch, staging_bytes, overlapped
) -> None:
    """Head-major blocks of another size are cut by token through staging. Two prefill blocks of
    staging: batches land in its halves in turn, and a batch's copies run while the next one is
    read. One block: every read lands on the bytes the previous copies read, so it waits for
    them (slow copies would otherwise see the next block's bytes)."""
    from vllm_ascend_mooncake.datapath import copy_overlap as copy_module

    spans: dict[str, list[tuple[float, float]]] = {"copy": [], "read": []}

    def timed(kind, run, delay_s):
        def wrapper(*args, **kwargs):
            started = time.monotonic()
            time.sleep(delay_s)  # before the bytes move: a read that did not wait lands first
            run(*args, **kwargs)
            spans[kind].append((started, time.monotonic()))

        return wrapper

    monkeypatch.setattr(
        copy_module, "apply_row_copies", timed("copy", copy_module.apply_row_copies, 0.05)
    )
    c = cluster(
        4,
        1,
        1,
        prefill_block=16,
        block_size=32,
        packing=CPU_VEC_PACKING,
        staging_bytes=staging_bytes,
    )
    (decode,) = c.decode
    decode.transport.read = timed("read", decode.transport.read, 0.01)
    pull_a_prompt_and_check_every_slot(c, 16, 32)
    assert len(spans["read"]) >= 7 * LAYERS  # one prefill block per batch at most
    concurrent = any(
        c_start < r_end and r_start < c_end
        for c_start, c_end in spans["copy"]
        for r_start, r_end in spans["read"]
    )
    assert concurrent == overlapped, spans


def test_head_slices_reuse_the_whole_staging_area(cluster) -> None:
    """Token-major head slices are not double-buffered (long rows, half of what is read:
    halving the batches cost more than the overlap saved): every batch uses the whole area."""
    c = cluster(4, prefill_tp=1, decode_tp=2, token_major=True, staging_bytes=4096)
    batches = []
    read = c.decode[0].transport.read

    def recording(session, local, remote, lengths):
        batches.append(int(local.min()))
        return read(session, local, remote, lengths)

    c.decode[0].transport.read = recording
    local, remote = [5, 0, 6], [1, 8, 9]
    c.pull_and_check(local, remote)
    assert len(batches) >= 2 and len(set(batches)) == 1, batches


# -- the end-to-end integrity check (verify_reads), issue #27 item 3 ---------------------------

VERIFIED = dataclasses.replace(FAST, verify_reads=True)


@pytest.mark.parametrize(
    "heads, prefill_tp, decode_tp, token_major",
    [(4, 2, 1, False), (4, 1, 2, True), (2, 4, 2, False), (4, 2, 4, False)],
)
def test_verified_pulls_of_every_topology_are_byte_exact(
    cluster, heads, prefill_tp, decode_tp, token_major
) -> None:
    """Merges, slices through staging, replicated heads: no verified pull fails falsely."""
    c = cluster(heads, prefill_tp, decode_tp, token_major=token_major, options=VERIFIED)
    local, remote = [3, 4, 5, 9], [6, 7, 8, 2]
    c.pull_and_check(local, remote)


@pytest.mark.parametrize("verify", [True, False])
def test_bytes_corrupted_in_flight_fail_the_verified_pull(cluster, verify) -> None:
    """The transport reports success while one bit of the bytes it landed flipped. Verified,
    the pull fails (vLLM recomputes or errors the request) and prefill frees its hold; without
    the check the same pull is reported loaded with the wrong byte: the negative control."""
    c = cluster(4, prefill_tp=1, decode_tp=1, options=VERIFIED if verify else FAST)
    (decode,), (prefill,) = c.decode, c.prefill
    decode.transport.corrupt_reads(1)
    local, remote = [4, 5, 6], [0, 1, 2]
    c.pull("r1", local, remote)
    decode.wait(["r1"])
    if verify:
        assert not decode.done
        assert "the bytes that landed differ from prefill's" in decode.failed["r1"].reason
        assert decode.failed["r1"].kind is FailureKind.INTEGRITY
        assert c.freed(prefill, "r1") and prefill.notices == [("t-r1", 0, False)]
    else:
        assert decode.done == {"r1"}
        with pytest.raises(AssertionError, match="is wrong"):
            decode.check_blocks(c.ref, local, remote)
