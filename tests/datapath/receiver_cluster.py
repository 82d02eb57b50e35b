"""The decode receiver's test cluster: prefill and decode ranks moving bytes in-process.

Prefill ranks (``SendTracker`` + ``PrefillSender`` on loopback ZMQ) and decode ranks (a real
``Receiver`` with its ``PeerDirectory`` and client) live in the test's process; their KV caches are
CPU tensors shaped like vLLM's (or like vllm-ascend's MLA nope and rope caches), and
:class:`InProcessTransport` copies the bytes. The receiver's tests (``test_receiver.py``,
``test_pull_reports.py``, ``test_peer_reads.py``, ``test_peer_lookup.py``) build one through the
``cluster`` fixture (``conftest.py``).
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import torch

from vam_testing.kv_caches import KVCache
from vam_testing.kv_reference import ReferenceKV, ReferencePrompt, owned_heads
from vllm_ascend_mooncake.connector.wiring import (
    DecodeSettings,
    KVCacheMemory,
    PrefillSettings,
    WorkerIdentity,
    build_decode_side,
    build_prefill_side,
)
from vllm_ascend_mooncake.core.layout import ChunkPacking
from vllm_ascend_mooncake.core.packing import chunk_packing
from vllm_ascend_mooncake.core.relayout import LocalMemory
from vllm_ascend_mooncake.core.topology import TransferTopology
from vllm_ascend_mooncake.datapath.fake import InProcessTransport
from vllm_ascend_mooncake.datapath.orders import PullOrder
from vllm_ascend_mooncake.datapath.receiver import ReceiverOptions
from vllm_ascend_mooncake.datapath.wire import ModelIdentity
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


def _offsets(cache: KVCache) -> list[int]:
    """Where each region starts in the cache's one allocation (not an MLA cache)."""
    return [region.base - cache.tensors[0].data_ptr() for region in cache.regions]


#: vLLM CPU's vec kernel packing for this file's caches (float16, K and V of HEAD_SIZE).
CPU_VEC_PACKING = chunk_packing("CPU_ATTN/vec", "auto", HEAD_SIZE, 2)


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
