"""The integrity check's pieces: the checksum against a plain-Python definition, and what prefill
agrees to checksum (the lessee only, the transfer's blocks only). The check end to end, with
bytes corrupted in flight, is in test_peer_reads.py."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from vam_testing.datapath_cases import worker_metadata
from vllm_ascend_mooncake.core import digest
from vllm_ascend_mooncake.core.layout import BlockOrder, Region, RegionLayout
from vllm_ascend_mooncake.core.relayout import LocalMemory
from vllm_ascend_mooncake.core.topology import TransferTopology
from vllm_ascend_mooncake.datapath import side_channel
from vllm_ascend_mooncake.datapath.sender import PrefillSender, SendTracker
from vllm_ascend_mooncake.datapath.side_channel import (
    Deferred,
    PeerRefused,
    SideChannelClient,
    SideChannelServer,
)
from vllm_ascend_mooncake.datapath.verify import (
    IntegrityError,
    answer,
    check_digest,
    ranges_outside,
    verify_request,
)
from vllm_ascend_mooncake.datapath.wire import (
    Ack,
    ClaimRead,
    ClaimReply,
    GetMetadata,
    ReadDigest,
    ReadDone,
)
from vllm_ascend_mooncake.launch.ports import free_port_range


def reference(chunks: list[bytes]) -> int:
    """The documented definition, word by word."""
    total, position = 0, 0
    for data in chunks:
        data += b"\0" * (-len(data) % 8)
        for start in range(0, len(data), 8):
            word = int.from_bytes(data[start : start + 8], "little")
            total += word * ((position * digest._A + digest._B) % (1 << 64))
            position += 1
    return total % (1 << 64)


@pytest.fixture
def data() -> torch.Tensor:
    return torch.randint(
        0, 256, (8192,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7)
    )


def test_the_checksum_is_the_documented_sum_whatever_the_alignment_and_chunking(
    data, monkeypatch
) -> None:
    views = [data[3:517], data[1024:1032], data[2001:2002], data[4096:8192]]
    expected = reference([bytes(v.tolist()) for v in views])
    assert digest.checksum(views) == expected
    monkeypatch.setattr(digest, "_CHUNK_WORDS", 5)
    monkeypatch.setattr(digest, "_ramps", {})
    assert digest.checksum(views) == expected
    copies = [v.clone() for v in views]  # other addresses, aligned: the same value
    assert digest.checksum(copies) == expected


def test_a_flipped_bit_or_swapped_words_change_the_checksum(data) -> None:
    base = digest.checksum([data])
    for position in (0, 7, 4095, 8191):
        flipped = data.clone()
        flipped[position] ^= 1 << (position % 8)
        assert digest.checksum([flipped]) != base
    swapped = data.clone().view(torch.int64)
    swapped[[3, 9]] = swapped[[9, 3]]
    assert digest.checksum([swapped.view(torch.uint8)]) != base
    # the same bytes split into other ranges are the same stream
    assert digest.checksum([data[:800], data[800:]]) == base


# Two regions of 4 blocks of 256 B, interleaved per block (K then V of each block, as NHD CUDA
# caches are): the V region's base is the K region's + 256.
LAYOUT = RegionLayout(BlockOrder.TOKEN_MAJOR, 4, 512, 2, 16, 8)
BASE = 1 << 20
REGIONS = [Region("k", BASE, LAYOUT), Region("v", BASE + 256, LAYOUT)]


def outside(ranges: list[tuple[int, int]], blocks=(1, 2)) -> str:
    addrs = np.array([a for a, _ in ranges], dtype=np.int64)
    lengths = np.array([n for _, n in ranges], dtype=np.int64)
    return ranges_outside(addrs, lengths, REGIONS, blocks)


def test_prefill_checksums_only_the_blocks_the_transfer_holds() -> None:
    assert LAYOUT.block_len == 256
    assert outside([(BASE + 512, 256), (BASE + 512 + 256 + 8, 64)]) == ""  # K and V of block 1
    assert outside([(BASE + 512, 256 + 512)]) == ""  # K of blocks 1 and 2, with V of 1 between
    assert "two KV regions" in outside([(BASE + 512, 1024)])  # K of block 1 to V of block 2
    assert "this transfer holds" in outside([(BASE + 512, 256 + 1024)])  # into block 3
    assert "this transfer holds" in outside([(BASE, 8)])  # block 0
    assert "outside this worker's KV blocks" in outside([(BASE - 8, 16)])
    assert "outside this worker's KV blocks" in outside([(BASE + 4 * 512, 8)])
    assert "no bytes" in outside([(BASE + 512, 0)])


# Two dense regions (blocks back to back) of one storage, the second right after the first, as
# one vLLM layer's K and V caches may lie.
DENSE = RegionLayout(BlockOrder.TOKEN_MAJOR, 4, 256, 2, 16, 8)
ADJACENT = [Region("k", BASE, DENSE), Region("v", BASE + 4 * 256, DENSE)]


def test_a_range_never_spans_two_regions() -> None:
    def dense_outside(start: int, length: int) -> str:
        return ranges_outside(np.array([start]), np.array([length]), ADJACENT, (1, 2))

    assert dense_outside(BASE + 256, 512) == ""  # a run over K's blocks 1 and 2
    assert dense_outside(BASE + 1024 + 256, 512) == ""  # and over V's
    # From K's block 1 to V's block 2: both ends in held blocks, but the range covers K's block 3
    # and V's block 0, which the transfer does not hold (let through before: their checksum
    # leaked to whoever held a lease on blocks 1 and 2).
    assert "two KV regions" in dense_outside(BASE + 256, 1536)
    assert "two KV regions" in dense_outside(BASE + 3 * 256 + 8, 256)  # K's block 3 into V's 0


def test_only_the_lessee_may_ask_and_what_it_gets_is_the_checksum() -> None:
    tracker = SendTracker(TransferTopology(2, 1, 1), 0, 10.0)
    tracker.hold("t", block_ids=(1,))
    cache = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    memory = LocalMemory([cache])
    regions = [Region("k", cache.data_ptr(), LAYOUT)]
    addrs, lengths = np.array([cache.data_ptr() + 512]), np.array([256])
    question = verify_request("t", 0, "reader-a", addrs, lengths)
    assert "not this reader's" in answer(
        question, memory, regions, tracker.leased_blocks("t", 0, "reader-a")
    )
    assert tracker.claim("t", 0, reader="reader-a").status == "granted"
    reply = answer(question, memory, regions, tracker.leased_blocks("t", 0, "reader-a"))
    assert isinstance(reply, ReadDigest)
    check_digest(reply, digest.checksum([cache[512:768]]), "one range")
    with pytest.raises(IntegrityError, match="differ"):
        check_digest(reply, digest.checksum([cache[0:256]]), "one range")
    other = tracker.leased_blocks("t", 0, "reader-b")
    assert "not this reader's" in answer(question, memory, regions, other)
    assert "not held" in str(tracker.leased_blocks("u", 0, "reader-a"))
    assert "no KV memory" in answer(question, None, regions, (1,))


class SlowMemory(LocalMemory):
    """KV memory whose checksum reads wait for ``go``: a checksum of GBs, at 0.5-1 GB/s."""

    def __init__(self, buffers) -> None:
        super().__init__(buffers)
        self.reading = threading.Event()
        self.go = threading.Event()

    def view(self, addr: int, length: int) -> torch.Tensor:
        self.reading.set()
        assert self.go.wait(30)
        return super().view(addr, length)


def test_a_checksum_under_way_delays_no_claim_or_notice() -> None:
    """Issue #43 item a: prefill computed a checksum on its one side-channel thread, so every
    claim and read-done notice to that worker waited until it was done (here: for ever)."""
    cache = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    memory = SlowMemory([cache])
    region = Region("k", cache.data_ptr(), LAYOUT)
    tracker = SendTracker(TransferTopology(2, 1, 1), 0, 30.0)
    metadata = worker_metadata([region], incarnation="p")
    port = free_port_range(1)
    sender = PrefillSender(metadata, tracker, "127.0.0.1", port, memory=memory)
    verifier, other = SideChannelClient(timeout_s=30), SideChannelClient(timeout_s=2)
    try:
        tracker.hold("t", block_ids=(1,))
        tracker.hold("u", block_ids=(2,))
        assert tracker.claim("t", 0, reader="a").status == "granted"
        question = verify_request("t", 0, "a", np.array([cache.data_ptr() + 512]), np.array([256]))
        replies: list = []
        asking = threading.Thread(
            target=lambda: replies.append(verifier.request("127.0.0.1", port, question))
        )
        asking.start()
        assert memory.reading.wait(10)  # the checksum is under way and cannot end yet

        started = time.monotonic()
        claim = other.request("127.0.0.1", port, ClaimRead("u", 0, "p", reader="b"))
        assert isinstance(claim, ClaimReply) and claim.status == "granted"
        notice = other.request("127.0.0.1", port, ReadDone("u", 0, "p", True, reader="b"))
        assert isinstance(notice, Ack)
        assert time.monotonic() - started < 1.0
        assert not replies  # still computing

        memory.go.set()
        asking.join(10)
        assert isinstance(replies[0], ReadDigest)
        check_digest(replies[0], digest.checksum([cache[512:768]]), "the batch")
    finally:
        memory.go.set()
        verifier.close()
        other.close()
        sender.close()


def test_deferred_work_beyond_its_bound_is_refused_at_once(monkeypatch) -> None:
    monkeypatch.setattr(side_channel, "MAX_DEFERRED", 1)
    go, started = threading.Event(), threading.Event()

    def slow() -> Ack:
        started.set()
        assert go.wait(30)
        return Ack()

    port = free_port_range(1)
    server = SideChannelServer("127.0.0.1", port, lambda message: Deferred(slow))
    first, second = SideChannelClient(timeout_s=30), SideChannelClient(timeout_s=2)
    try:
        replies: list = []
        asking = threading.Thread(
            target=lambda: replies.append(first.request("127.0.0.1", port, GetMetadata()))
        )
        asking.start()
        assert started.wait(10)
        with pytest.raises(PeerRefused, match="busy"):
            second.request("127.0.0.1", port, GetMetadata())
        go.set()
        asking.join(10)
        assert replies == [Ack()]
        assert second.request("127.0.0.1", port, GetMetadata()) == Ack()  # room again
    finally:
        go.set()
        first.close()
        second.close()
        server.close()
