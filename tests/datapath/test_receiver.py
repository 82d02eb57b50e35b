"""The decode receiver against real prefill side channels, moving bytes in-process.

Prefill ranks (``SendTracker`` + ``PrefillSender`` on loopback ZMQ) and decode ranks (a real
``Receiver`` with its ``PeerDirectory`` and client) live in this process; their KV caches are CPU
tensors shaped like vLLM's (or like vllm-ascend's MLA nope and rope caches), and
:class:`InProcessTransport` copies the bytes. Every pull's blocks
are compared byte for byte with the reference, and every report (vLLM's and prefill's) is checked.
"""

from __future__ import annotations

import dataclasses
import time
import uuid

import numpy as np
import pytest
import torch
import zmq

from vam_testing.kv_caches import KVCache
from vam_testing.kv_reference import ReferenceKV, ReferencePrompt, owned_heads
from vam_testing.waiting import wait_until
from vllm_ascend_mooncake.connector.wiring import (
    DecodeSettings,
    KVCacheMemory,
    PrefillSettings,
    WorkerIdentity,
    build_decode_side,
    build_prefill_side,
)
from vllm_ascend_mooncake.core.layout import BlockOrder, ChunkPacking
from vllm_ascend_mooncake.core.packing import chunk_packing
from vllm_ascend_mooncake.core.relayout import LocalMemory
from vllm_ascend_mooncake.core.topology import TransferTopology
from vllm_ascend_mooncake.datapath.failures import FailureKind
from vllm_ascend_mooncake.datapath.fake import InProcessTransport
from vllm_ascend_mooncake.datapath.orders import PullOrder
from vllm_ascend_mooncake.datapath.receiver import ReceiverOptions
from vllm_ascend_mooncake.datapath.registration import (
    kv_memory_ranges,
)
from vllm_ascend_mooncake.datapath.side_channel import SideChannelError
from vllm_ascend_mooncake.datapath.transport import TransferError
from vllm_ascend_mooncake.datapath.wire import ModelIdentity, WorkerMetadata
from vllm_ascend_mooncake.launch.ports import free_port_range

HOST = "127.0.0.1"
BLOCK_SIZE, HEAD_SIZE, LAYERS = 16, 8, 2
CONTENT = 2 * HEAD_SIZE  # float16 elements per head and token: vLLM fuses K and V
HEAD_TOKEN_BYTES = 2 * CONTENT
PREFILL_BLOCKS, DECODE_BLOCKS = 12, 16
PROMPT_TOKENS = 100
#: vllm-ascend's MLA caches per layer: nope (kv_lora_rank) and rope (qk_rope_head_dim) elements.
ASCEND_MLA_WIDTHS = (512, 64)
FAST = ReceiverOptions(
    claim_wait_s=2.0,
    prefill_wait_s=3.0,
    claim_park_s=0.05,
    retry_backoff_s=0.01,
    notify_backoff_s=0.05,
)


def cache(
    heads: int,
    num_blocks: int,
    token_major: bool,
    seed: int,
    mla_widths: tuple[int, ...] = (),
    block_size: int = BLOCK_SIZE,
    packing: ChunkPacking = (),
) -> KVCache:
    """A CPU KV cache shaped like vLLM's or, with ``mla_widths``, like vllm-ascend's MLA cache."""
    if mla_widths:
        layout = "ascend_mla"
    else:
        layout = "vllm_token_major" if token_major else "vllm_head_major"
    return KVCache(
        layout,
        num_layers=LAYERS,
        heads=heads,
        num_blocks=num_blocks,
        block_size=block_size,
        head_size=CONTENT,
        dtype=torch.float16,
        seed=seed,
        mla_widths=mla_widths,
        packing=packing,
    )


def identity(
    role: str, topo: TransferTopology, rank: int, block_size: int, head_size: int
) -> WorkerIdentity:
    return WorkerIdentity(
        engine_id=role,
        incarnation=uuid.uuid4().hex,
        tp_rank=rank,
        tp_size=topo.prefill_tp if role == "prefill" else topo.decode_tp,
        dp_rank=0,
        dp_size=1,
        model=ModelIdentity(
            "reference",
            "float16",
            "auto",
            block_size,
            head_size,
            topo.num_kv_heads,
            LAYERS,
            topo.is_mla,
        ),
    )


class Prefill:
    """One prefill rank: a reference-filled cache served through the production wiring on the
    in-process transport."""

    def __init__(
        self,
        topo,
        rank,
        port,
        ref,
        token_major,
        mla_widths=(),
        block_size=BLOCK_SIZE,
        packing=(),
        session=None,
    ) -> None:
        self.heads = owned_heads(topo.num_kv_heads, topo.prefill_tp, rank, topo.is_mla)
        self.cache = cache(
            len(self.heads), PREFILL_BLOCKS, token_major, rank, mla_widths, block_size, packing
        )
        for index, region in enumerate(self.cache.regions):
            for block in range(PREFILL_BLOCKS):
                self.cache.block(index, block)[:] = ref.expected_block(
                    index, block, self.heads, region.layout.block_order, region.layout.packing
                )
        self.transport = InProcessTransport(session)
        try:
            self.side = build_prefill_side(
                identity("prefill", topo, rank, block_size, sum(mla_widths) or HEAD_SIZE),
                topo,
                self.transport,
                KVCacheMemory(self.cache.tensors, self.cache.regions),
                PrefillSettings(HOST, port, release_timeout_s=30.0),
            )
        except BaseException:
            self.transport.close()  # its session is free for another try
            raise
        self.tracker = self.side.sender.tracker
        self.notices: list[tuple[str, int, bool]] = []  # read-done notices, as prefill saw them
        read_done = self.tracker.read_done

        def record(transfer_id, decode_rank, success, reader="", decode_tp=-1):
            self.notices.append((transfer_id, decode_rank, success))
            return read_done(transfer_id, decode_rank, success, reader, decode_tp)

        self.tracker.read_done = record

    def close(self) -> None:
        self.side.close()
        self.transport.close()


class Decode:
    """One decode rank: the production wiring's receiver reading into a CPU cache through the
    in-process transport."""

    def __init__(
        self,
        topo,
        rank,
        token_major,
        options: ReceiverOptions,
        staging=True,
        staging_bytes=1 << 16,
        memory_type=LocalMemory,
        mla_widths=(),
        block_size=BLOCK_SIZE,
        packing=(),
        client_timeout_s: float = 5.0,
    ) -> None:
        self.heads = owned_heads(topo.num_kv_heads, topo.decode_tp, rank, topo.is_mla)
        self.cache = cache(
            len(self.heads),
            DECODE_BLOCKS,
            token_major,
            100 + rank,
            mla_widths,
            block_size,
            packing,
        )
        self.snapshot = self.cache.bytes
        self.transport = InProcessTransport()
        self.side = build_decode_side(
            identity("decode", topo, rank, block_size, sum(mla_widths) or HEAD_SIZE),
            topo,
            self.transport,
            KVCacheMemory(self.cache.tensors, self.cache.regions),
            DecodeSettings(
                receiver=options,
                staging_bytes=staging_bytes if staging else 0,
                side_channel_timeout_s=client_timeout_s,
            ),
            memory_type=memory_type,
        )
        self.receiver, self.memory = self.side.receiver, self.side.memory
        self.done: set[str] = set()
        self.failed: dict = {}

    def wait(self, request_ids, timeout_s: float = 5.0) -> None:
        """Collect reports until every one of ``request_ids`` is reported (or time runs out)."""
        deadline = time.monotonic() + timeout_s
        while not set(request_ids) <= self.done | set(self.failed):
            assert time.monotonic() < deadline, f"no report for {set(request_ids) - self.done}"
            self.receiver.wait_for_news(0.05)
            done, failed = self.receiver.take_finished()
            assert not (done & self.done) and not (set(failed) & set(self.failed)), "reported twice"
            self.done |= done
            self.failed.update(failed)

    def check_blocks(self, ref: ReferenceKV, local_ids, remote_ids) -> None:
        """The pulled blocks hold the reference bytes of this rank's heads; nothing else moved."""
        expected = self.snapshot.copy()
        for index, region in enumerate(self.cache.regions):
            for local, remote in zip(local_ids, remote_ids, strict=True):
                want = ref.expected_block(index, remote, self.heads, region.layout.block_order)
                got = self.cache.block(index, local)
                assert np.array_equal(got, want), f"region {index} block {local} is wrong"
                start = self.cache.offset(index, local)
                expected[start : start + region.layout.block_len] = want
        assert np.array_equal(self.cache.bytes, expected), "bytes outside the pulled blocks moved"

    def close(self) -> None:
        self.side.close()
        self.transport.close()


class Cluster:
    def __init__(
        self,
        heads,
        prefill_tp,
        decode_tp,
        token_major=False,
        options=FAST,
        mla_widths=(),
        prefill_block=BLOCK_SIZE,
        packing=(),
        **kw,
    ):
        self.topo = TransferTopology(heads, prefill_tp, decode_tp, is_mla=bool(mla_widths))
        if mla_widths:  # one reference region per MLA tensor, each as wide as the tensor
            widths = [2 * w for w in mla_widths] * LAYERS
            self.ref = ReferenceKV.random(len(widths), PREFILL_BLOCKS, 1, BLOCK_SIZE, widths)
        else:
            self.ref = ReferenceKV.random(
                LAYERS, PREFILL_BLOCKS, heads, prefill_block, HEAD_TOKEN_BYTES
            )
        self.port = free_port_range(prefill_tp)
        self.prefill = [
            Prefill(
                self.topo,
                r,
                self.port + r,
                self.ref,
                token_major,
                mla_widths,
                prefill_block,
                packing,
            )
            for r in range(prefill_tp)
        ]
        self.decode = [
            Decode(self.topo, r, token_major, options, mla_widths=mla_widths, packing=packing, **kw)
            for r in range(decode_tp)
        ]

    def order(self, request_id, local, remote, *, early=False) -> PullOrder:
        return PullOrder(
            request_id=request_id,
            transfer_id=f"t-{request_id}",
            local_block_ids=tuple(local),
            remote_block_ids=None if early else tuple(remote),
            remote_host=HOST,
            remote_port=self.port,
            remote_engine_id="prefill",
            num_prompt_tokens=PROMPT_TOKENS,
        )

    def hold(self, request_id, remote) -> None:
        for prefill in self.prefill:
            prefill.tracker.hold(
                f"t-{request_id}",
                request_id=request_id,
                block_ids=tuple(remote),
                num_prompt_tokens=PROMPT_TOKENS,
            )

    def pull(self, request_id, local, remote, ranks=None) -> None:
        self.hold(request_id, remote)
        for decode in self.decode if ranks is None else [self.decode[r] for r in ranks]:
            decode.receiver.submit(self.order(request_id, local, remote))

    def pull_and_check(self, local, remote, request_id="r1") -> None:
        """Pull on every decode rank and check each one's blocks byte for byte against the
        reference: every pull reported done, none failed."""
        self.pull(request_id, local, remote)
        for decode in self.decode:
            decode.wait([request_id])
            assert decode.done == {request_id} and not decode.failed, decode.failed
            decode.check_blocks(self.ref, local, remote)

    def freed(self, prefill: Prefill, request_id: str, timeout_s: float = 5.0) -> bool:
        """Whether prefill frees the request's blocks within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if request_id in prefill.tracker.take_finished():
                return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        for side in self.decode + self.prefill:
            side.close()


@pytest.fixture
def cluster():
    made = []

    def make(*args, **kw) -> Cluster:
        made.append(Cluster(*args, **kw))
        return made[-1]

    yield make
    for c in made:
        c.close()


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


def test_a_release_only_pull_frees_prefill_and_is_never_reported(cluster) -> None:
    c = cluster(4, prefill_tp=2, decode_tp=1)
    (decode,) = c.decode
    c.pull("r1", [], [3, 4])
    assert all(c.freed(p, "r1") for p in c.prefill)
    assert all(p.notices == [("t-r1", 0, True)] for p in c.prefill)
    time.sleep(0.1)
    assert decode.receiver.take_finished() == (set(), {})
    assert decode.transport.num_reads == 0
    assert np.array_equal(decode.cache.bytes, decode.snapshot)


def test_a_pull_cancelled_before_its_grant_is_reported_cancelled(cluster) -> None:
    c = cluster(4, prefill_tp=1, decode_tp=1)
    (decode,) = c.decode
    decode.receiver.submit(c.order("r1", [1, 2], [3, 4], early=True))
    time.sleep(0.1)  # its claim waits: prefill never holds it
    started = time.monotonic()
    decode.receiver.cancel("r1")
    decode.wait(["r1"], timeout_s=2.0)
    assert time.monotonic() - started < 1.0  # the cancel, not prefill_wait_s, ended it
    failure = decode.failed["r1"]
    assert failure.cancelled and failure.local_block_ids == (1, 2)
    assert decode.transport.num_reads == 0
    assert np.array_equal(decode.cache.bytes, decode.snapshot)


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


class QueuedFixupMemory(LocalMemory):
    """A fake asynchronous device (there is no accelerator here): the fix-ups the receiver queues
    run only when it fences, as copies queued on a GPU or NPU stream run later. A fix-up that
    reads staging bytes after the next read overwrote them, or blocks reported before it ran,
    then shows as wrong bytes."""

    def __init__(self, buffers) -> None:
        super().__init__(buffers)
        self.queued: list = []
        self.fences = 0

    def fence(self) -> None:
        self.fences += 1
        queued, self.queued = self.queued, []
        for run in queued:
            run()


@pytest.fixture
def queued_fixups(monkeypatch):
    """The receiver's fix-ups queue on a :class:`QueuedFixupMemory` instead of running."""
    from vllm_ascend_mooncake.datapath import copy_overlap as copy_module
    from vllm_ascend_mooncake.datapath import receiver as receiver_module

    def queueing(run_now):
        def queue(memory, fixups):
            if isinstance(memory, QueuedFixupMemory):
                memory.queued.append(lambda: run_now(memory, fixups))
            else:
                run_now(memory, fixups)

        return queue

    for module, name in ((copy_module, "apply_row_copies"), (receiver_module, "apply_swaps")):
        monkeypatch.setattr(module, name, queueing(getattr(module, name)))


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


def _offsets(cache: KVCache) -> list[int]:
    """Where each region starts in the cache's one allocation (not an MLA cache)."""
    return [region.base - cache.tensors[0].data_ptr() for region in cache.regions]


#: vLLM CPU's vec kernel packing for this file's caches (float16, K and V of HEAD_SIZE).
CPU_VEC_PACKING = chunk_packing("CPU_ATTN/vec", "auto", HEAD_SIZE, 2)


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


def pull_a_prompt_and_check_every_slot(c, prefill_block, decode_block, cached_blocks=0) -> None:
    """Place a prompt's tokens in the prefill caches, pull it, and check every decode byte
    against :class:`ReferencePrompt`; prefill freed the blocks."""
    prompt = ReferencePrompt.random(
        LAYERS, -(-PROMPT_TOKENS // prefill_block) * prefill_block, 4, HEAD_TOKEN_BYTES, seed=3
    )
    remote = [11, 3, 4, 5, 0, 9, 10, 2][: -(-PROMPT_TOKENS // prefill_block)]
    decode_count = -(-PROMPT_TOKENS // decode_block)
    local = [8, 9, 10, 1, 5, 6, 13][:decode_count][cached_blocks:]
    for prefill in c.prefill:
        layouts = [region.layout for region in prefill.cache.regions]
        prompt.place(
            prefill.cache.arrays[0], layouts, _offsets(prefill.cache), prefill.heads, remote
        )
    c.pull("r1", local, remote)
    for decode in c.decode:
        decode.wait(["r1"])
        assert decode.done == {"r1"} and not decode.failed
        expected = decode.snapshot.copy()
        layouts = [region.layout for region in decode.cache.regions]
        prompt.place(expected, layouts, _offsets(decode.cache), decode.heads, local, cached_blocks)
        assert np.array_equal(decode.cache.bytes, expected)
    assert all(c.freed(p, "r1") for p in c.prefill)


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
        if transfer_id not in p.tracker._held:  # released: vLLM reuses the blocks at once
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
