"""A draft (EAGLE/MTP) layer with a KV-head count of its own moves with the model's layers:
the production prefill and decode sides (over the in-process transport) pull each layer with
its head group's pulls, byte for byte, and every prefill rank is released exactly once."""

from __future__ import annotations

import uuid

import pytest
import torch

from vam_testing.kv_reference import owned_heads
from vam_testing.waiting import wait_until
from vllm_ascend_mooncake.connector.wiring import (
    DecodeSettings,
    KVCacheMemory,
    PrefillSettings,
    WorkerIdentity,
    build_decode_side,
    build_prefill_side,
)
from vllm_ascend_mooncake.core.topology import TransferTopology, request_seed
from vllm_ascend_mooncake.datapath.fake import InProcessTransport
from vllm_ascend_mooncake.datapath.orders import PullOrder
from vllm_ascend_mooncake.datapath.registration import LayerHeads, regions_from_vllm_views
from vllm_ascend_mooncake.datapath.wire import ModelIdentity
from vllm_ascend_mooncake.launch.ports import free_port_range

BLOCKS, BLOCK, CONTENT = 6, 4, 8
DRAFT = "model.layers.2.self_attn.attn"  # EAGLE numbers its layer after the model's two
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn", DRAFT)
REMOTE_IDS, LOCAL_IDS = (4, 1, 2), (0, 5, 3)


def reference(heads: int, draft_heads: int) -> dict[str, torch.Tensor]:
    """Every layer's full KV, all heads: ``[blocks, heads, tokens, content]``."""
    gen = torch.Generator().manual_seed(7)
    return {
        name: torch.randn(
            BLOCKS, draft_heads if name == DRAFT else heads, BLOCK, CONTENT, generator=gen
        )
        for name in LAYERS
    }


def rank_cache(
    full: dict[str, torch.Tensor], tp: int, rank: int, draft_heads: int, token_major: bool
) -> tuple[KVCacheMemory, dict[str, list[int]]]:
    """What rank ``rank`` of TP ``tp`` holds of every layer (vLLM's per-layer views, one tensor
    each, head- or token-major inside a block), filled from ``full``; and the heads held."""
    views, held = {}, {}
    for name, kv in full.items():
        heads = owned_heads(kv.shape[1], tp, rank)
        part = kv[:, heads]
        if token_major:  # [blocks, tokens, heads, content] in memory, viewed [b, h, n, c]
            view = part.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
        else:
            view = part.contiguous()
        views[name], held[name] = view, heads
    draft = LayerHeads(len(held[DRAFT]), draft_heads)
    regions = regions_from_vllm_views(
        views,
        num_kv_heads=len(held[LAYERS[0]]),
        block_size=BLOCK,
        is_mla=False,
        layer_heads={DRAFT: draft},
    )
    return KVCacheMemory(list(views.values()), regions), held


def identity(role: str, tp: int, rank: int, heads: int) -> WorkerIdentity:
    return WorkerIdentity(
        engine_id=f"groups-{role}",
        incarnation=uuid.uuid4().hex,
        tp_rank=rank,
        tp_size=tp,
        dp_rank=0,
        dp_size=1,
        model=ModelIdentity("tiny", "float32", "auto", BLOCK, CONTENT // 2, heads, 3, False),
    )


def transfer_reading_across(topology: TransferTopology) -> str:
    """A transfer id for which some decode rank reads a prefill rank for its draft layers
    that the model's layers do not read (the draft's replica is elsewhere), when there is one."""
    model, draft = topology.head_groups
    for i in range(64):
        tid = f"t-{i}"
        seed = request_seed(tid)
        for d in range(topology.decode_tp):
            ranks = {p.prefill_rank for p in model.pulls_for(d, seed)}
            if any(p.prefill_rank not in ranks for p in draft.pulls_for(d, seed)):
                return tid
    return "t-0"


@pytest.mark.parametrize("token_major", [False, True], ids=["head_major", "token_major"])
@pytest.mark.parametrize(
    ("heads", "draft_heads", "prefill_tp", "decode_tp"),
    [(2, 1, 2, 2), (4, 2, 2, 1), (8, 2, 4, 2), (2, 4, 2, 4)],
    ids=["replicated-draft", "merge", "8-vs-2", "replicated-model"],
)
def test_mixed_head_groups_move_byte_exact(
    heads: int, draft_heads: int, prefill_tp: int, decode_tp: int, token_major: bool
) -> None:
    topology = TransferTopology(heads, prefill_tp, decode_tp, extra_kv_heads=(draft_heads,))
    full = reference(heads, draft_heads)
    port = free_port_range(prefill_tp)
    transports: list[InProcessTransport] = []
    prefills, decodes = [], []
    tid = transfer_reading_across(topology)
    assert tid != "t-0" or (heads, draft_heads) != (2, 1), "the case must read across"
    try:
        for p in range(prefill_tp):
            transport = InProcessTransport()
            transports.append(transport)
            cache, _ = rank_cache(full, prefill_tp, p, draft_heads, token_major)
            side = build_prefill_side(
                identity("prefill", prefill_tp, p, heads),
                topology,
                transport,
                cache,
                PrefillSettings("127.0.0.1", port + p, release_timeout_s=30.0),
            )
            prefills.append(side)
            side.sender.tracker.hold(
                tid, request_id="r", block_ids=REMOTE_IDS, num_prompt_tokens=3 * BLOCK
            )
        targets = []
        for d in range(decode_tp):
            transport = InProcessTransport()
            transports.append(transport)
            blank = {n: torch.full_like(t, -1.0) for n, t in full.items()}
            cache, held = rank_cache(blank, decode_tp, d, draft_heads, token_major)
            side = build_decode_side(
                identity("decode", decode_tp, d, heads),
                topology,
                transport,
                cache,
                DecodeSettings(staging_bytes=1 << 16),
            )
            decodes.append(side)
            targets.append((cache, held))
            side.receiver.submit(
                PullOrder(
                    request_id="r",
                    transfer_id=tid,
                    local_block_ids=LOCAL_IDS,
                    remote_block_ids=REMOTE_IDS,
                    remote_host="127.0.0.1",
                    remote_port=port,
                    remote_engine_id=prefills[0].metadata.engine_id,
                    num_prompt_tokens=3 * BLOCK,
                )
            )
        for side in decodes:

            def pulled(side=side) -> set[str]:
                side.receiver.wait_for_news(0.05)
                done, failed = side.receiver.take_finished()
                assert not failed, failed
                return done

            assert wait_until(pulled, "decode pulls r") == {"r"}
        for cache, held in targets:
            for name, view in zip(LAYERS, cache.tensors, strict=True):
                want = full[name][:, held[name]]
                for local, remote in zip(LOCAL_IDS, REMOTE_IDS, strict=True):
                    assert torch.equal(view[local], want[remote]), (name, local)
                untouched = [b for b in range(BLOCKS) if b not in LOCAL_IDS]
                assert bool((view[untouched] == -1.0).all())
        for side in prefills:  # every prefill rank is released, once: all its readers told it

            def released(side=side) -> set[str]:
                side.sender.tracker.wait_for_news(0.05)
                return side.sender.tracker.take_finished()

            assert wait_until(released, "prefill releases r") == {"r"}
            assert side.sender.tracker.num_expired == 0
    finally:
        for side in decodes + prefills:
            side.close()
        for transport in transports:
            transport.close()
