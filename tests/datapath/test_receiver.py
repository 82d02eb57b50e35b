"""The decode receiver against real prefill side channels, moving bytes in-process.

Prefill ranks (``SendTracker`` + ``PrefillSender`` on loopback ZMQ) and decode ranks (a real
``Receiver`` with its ``PeerDirectory`` and client) live in this process; their KV caches are CPU
tensors shaped like vLLM's, and :class:`InProcessTransport` copies the bytes. Every pull's blocks
are compared byte for byte with the reference, and every report (vLLM's and prefill's) is checked.
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
import torch

from vllm_ascend_mooncake.core.plan import StagingArea
from vllm_ascend_mooncake.core.relayout import LocalMemory
from vllm_ascend_mooncake.core.topology import TransferTopology
from vllm_ascend_mooncake.datapath.fake import InProcessTransport
from vllm_ascend_mooncake.datapath.orders import PullOrder
from vllm_ascend_mooncake.datapath.peers import PeerDirectory
from vllm_ascend_mooncake.datapath.receiver import Receiver, ReceiverOptions, StagingPool
from vllm_ascend_mooncake.datapath.registration import regions_from_vllm_views, storage_ranges
from vllm_ascend_mooncake.datapath.sender import PrefillSender, SendTracker
from vllm_ascend_mooncake.datapath.side_channel import SideChannelClient
from vllm_ascend_mooncake.datapath.transport import TransferError
from vllm_ascend_mooncake.datapath.wire import ModelIdentity, RegionInfo, WorkerMetadata
from vllm_ascend_mooncake.launch.ports import free_port_range
from vllm_ascend_mooncake.testing.kv_reference import ReferenceKV, ReferencePrompt, owned_heads

HOST = "127.0.0.1"
BLOCK_SIZE, HEAD_SIZE, LAYERS = 16, 8, 2
CONTENT = 2 * HEAD_SIZE  # float16 elements per head and token: vLLM fuses K and V
HEAD_TOKEN_BYTES = 2 * CONTENT
PREFILL_BLOCKS, DECODE_BLOCKS = 12, 16
PROMPT_TOKENS = 100
FAST = ReceiverOptions(
    claim_wait_s=2.0,
    prefill_wait_s=3.0,
    claim_park_s=0.05,
    retry_backoff_s=0.01,
    notify_backoff_s=0.05,
)


class Cache:
    """A vLLM-shaped CPU KV cache: one allocation, one ``[blocks, H, N, C]`` view per layer."""

    def __init__(
        self,
        heads: int,
        num_blocks: int,
        token_major: bool,
        seed: int,
        block_size: int = BLOCK_SIZE,
    ) -> None:
        page = heads * block_size * CONTENT
        self.raw = torch.empty(LAYERS * num_blocks * page, dtype=torch.float16)
        if token_major:
            strides = (page, CONTENT, heads * CONTENT, 1)
        else:
            strides = (page, block_size * CONTENT, CONTENT, 1)
        views = {
            f"layer.{i}": self.raw.as_strided(
                (num_blocks, heads, block_size, CONTENT), strides, i * num_blocks * page
            )
            for i in range(LAYERS)
        }
        self.regions = regions_from_vllm_views(
            views, num_kv_heads=heads, block_size=block_size, is_mla=False
        )
        self.bytes = self.raw.view(torch.uint8).numpy()
        self.bytes[:] = np.random.default_rng(seed).integers(0, 256, self.bytes.size, np.uint8)

    def block(self, region: int, block: int) -> np.ndarray:
        layout = self.regions[region].layout
        start = self.regions[region].base - self.raw.data_ptr() + block * layout.block_stride
        return self.bytes[start : start + layout.block_len]


def metadata(
    role: str, topo: TransferTopology, rank: int, session: str, cache: Cache, block_size: int
) -> WorkerMetadata:
    return WorkerMetadata(
        engine_id=role,
        incarnation=uuid.uuid4().hex,
        tp_rank=rank,
        tp_size=topo.prefill_tp if role == "prefill" else topo.decode_tp,
        dp_rank=0,
        dp_size=1,
        pp_size=1,
        transport_session=session,
        identity=ModelIdentity(
            "reference", "float16", "auto", block_size, HEAD_SIZE, topo.num_kv_heads, LAYERS, False
        ),
        regions=[RegionInfo.of(r) for r in cache.regions],
    )


class Prefill:
    """One prefill rank: a reference-filled cache, its transport and its side channel."""

    def __init__(self, topo, rank, port, ref, token_major, block_size=BLOCK_SIZE) -> None:
        self.heads = owned_heads(topo.num_kv_heads, topo.prefill_tp, rank)
        self.cache = Cache(len(self.heads), PREFILL_BLOCKS, token_major, rank, block_size)
        for index, region in enumerate(self.cache.regions):
            for block in range(PREFILL_BLOCKS):
                self.cache.block(index, block)[:] = ref.expected_block(
                    index, block, self.heads, region.layout.block_order
                )
        self.transport = InProcessTransport()
        self.transport.register(storage_ranges([self.cache.raw]))
        self.tracker = SendTracker(topo, rank, release_timeout_s=30.0)
        self.notices: list[tuple[str, int, bool]] = []  # read-done notices, as prefill saw them
        read_done = self.tracker.read_done

        def record(transfer_id, decode_rank, success, reader=""):
            self.notices.append((transfer_id, decode_rank, success))
            return read_done(transfer_id, decode_rank, success, reader)

        self.tracker.read_done = record
        meta = metadata("prefill", topo, rank, self.transport.session, self.cache, block_size)
        self.sender = PrefillSender(meta, self.tracker, HOST, port)

    def close(self) -> None:
        self.sender.close()
        self.transport.close()


class Decode:
    """One decode rank: a real Receiver reading into a CPU cache through its own transport."""

    def __init__(
        self, topo, rank, token_major, options: ReceiverOptions, staging=True, block_size=BLOCK_SIZE
    ) -> None:
        self.heads = owned_heads(topo.num_kv_heads, topo.decode_tp, rank)
        self.cache = Cache(len(self.heads), DECODE_BLOCKS, token_major, 100 + rank, block_size)
        self.staging = torch.zeros(1 << 16, dtype=torch.uint8)
        self.transport = InProcessTransport()
        self.transport.register(storage_ranges([self.cache.raw, self.staging]))
        self.snapshot = self.cache.bytes.copy()
        self.client = SideChannelClient(timeout_s=5)
        meta = metadata("decode", topo, rank, self.transport.session, self.cache, block_size)
        self.peers = PeerDirectory(self.client, meta, topo)
        pool = StagingPool([StagingArea(self.staging.data_ptr(), self.staging.numel())])
        self.receiver = Receiver(
            self.transport,
            topo,
            rank,
            self.cache.regions,
            LocalMemory.from_tensors([self.cache.raw, self.staging]),
            self.peers,
            self.client,
            options,
            pool if staging else None,
        )
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
                start = region.base - self.cache.raw.data_ptr() + local * region.layout.block_stride
                expected[start : start + region.layout.block_len] = want
        assert np.array_equal(self.cache.bytes, expected), "bytes outside the pulled blocks moved"

    def close(self) -> None:
        self.receiver.shutdown()
        self.client.close()
        self.transport.close()


class Cluster:
    def __init__(
        self,
        heads,
        prefill_tp,
        decode_tp,
        token_major=False,
        options=FAST,
        prefill_block=BLOCK_SIZE,
        **kw,
    ):
        self.topo = TransferTopology(heads, prefill_tp, decode_tp)
        self.ref = ReferenceKV.random(
            LAYERS, PREFILL_BLOCKS, heads, prefill_block, HEAD_TOKEN_BYTES
        )
        self.port = free_port_range(prefill_tp)
        self.prefill = [
            Prefill(self.topo, r, self.port + r, self.ref, token_major, prefill_block)
            for r in range(prefill_tp)
        ]
        self.decode = [Decode(self.topo, r, token_major, options, **kw) for r in range(decode_tp)]

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
    c.pull("r1", local, remote)
    for decode in c.decode:
        decode.wait(["r1"])
        assert decode.done == {"r1"} and not decode.failed
        decode.check_blocks(c.ref, local, remote)
    assert c.freed(c.prefill[0], "r1")
    assert sorted(c.prefill[0].notices) == [("t-r1", 0, True), ("t-r1", 1, True)]


def test_a_slice_pull_without_staging_fails_and_releases_prefill(cluster) -> None:
    c = cluster(4, prefill_tp=1, decode_tp=2, token_major=True, staging=False)
    c.pull("r1", [1, 2], [3, 4], ranks=[0])
    decode = c.decode[0]
    decode.wait(["r1"])
    assert "staging" in decode.failed["r1"].reason
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
    assert "injected" in failure.reason
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
    c = cluster(4, prefill_tp=1, decode_tp=1)
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
    c.pull("r2", [3], [4])  # the receiver goes on with other requests
    decode.wait(["r2"])
    assert decode.done == {"r2"} and not decode.failed
    decode.check_blocks(c.ref, [3], [4])


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
    prefill.register(storage_ranges([source]))
    decode.register(storage_ranges([target]))
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


def _offsets(cache: Cache) -> list[int]:
    return [region.base - cache.raw.data_ptr() for region in cache.regions]


@pytest.mark.parametrize("blocks", [(16, 32), (32, 16)])
@pytest.mark.parametrize("tps", [(2, 1), (1, 2), (1, 1)])
@pytest.mark.parametrize("cached_blocks", [0, 1])
def test_token_major_blocks_of_different_sizes_land_token_by_token(
    cluster, blocks, tps, cached_blocks
) -> None:
    """Prefill and decode block sizes differ (one divides the other): the real receiver plans with
    the prompt length and every decode slot holds its token, checked against ReferencePrompt."""
    prefill_block, decode_block = blocks
    c = cluster(4, *tps, token_major=True, prefill_block=prefill_block, block_size=decode_block)
    prompt = ReferencePrompt.random(
        LAYERS, -(-PROMPT_TOKENS // prefill_block) * prefill_block, 4, HEAD_TOKEN_BYTES, seed=3
    )
    remote = [11, 3, 4, 5, 0, 9, 10, 2][: -(-PROMPT_TOKENS // prefill_block)]
    decode_count = -(-PROMPT_TOKENS // decode_block)
    local = [8, 9, 10, 1, 5, 6, 13][:decode_count][cached_blocks:]
    for prefill in c.prefill:
        layouts = [region.layout for region in prefill.cache.regions]
        prompt.place(prefill.cache.bytes, layouts, _offsets(prefill.cache), prefill.heads, remote)
    c.pull("r1", local, remote)
    for decode in c.decode:
        decode.wait(["r1"])
        assert decode.done == {"r1"} and not decode.failed
        expected = decode.snapshot.copy()
        layouts = [region.layout for region in decode.cache.regions]
        prompt.place(expected, layouts, _offsets(decode.cache), decode.heads, local, cached_blocks)
        assert np.array_equal(decode.cache.bytes, expected)
    assert all(c.freed(p, "r1") for p in c.prefill)


def test_head_major_blocks_of_different_sizes_are_refused_before_any_byte_moves(cluster) -> None:
    c = cluster(4, 1, 1, prefill_block=16, block_size=32)
    (decode,) = c.decode
    c.pull("r1", [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7])
    decode.wait(["r1"])
    assert "with head-major blocks" in str(decode.failed["r1"])
    assert np.array_equal(decode.cache.bytes, decode.snapshot)
    # (prefill frees the hold at its release timeout, as for any peer refused at the handshake)
