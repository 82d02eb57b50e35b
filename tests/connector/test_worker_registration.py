"""The worker hands vllm-ascend's per-layer cache tuples over with the config's MLA flag."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_ascend_mooncake.connector.attention_layers import AttentionGeometry
from vllm_ascend_mooncake.connector.worker import ConnectorWorker
from vllm_ascend_mooncake.core.layout import BlockOrder, LayoutError
from vllm_ascend_mooncake.core.packing import chunk_packing
from vllm_ascend_mooncake.datapath.registration import LayerHeads
from vllm_ascend_mooncake.datapath.wire import ModelIdentity

BLOCKS, BLOCK_SIZE = 4, 16


def ascend_mla_caches():
    """vllm-ascend's MLA cache: per layer (nope, rope), ``[blocks, block_size, 1, width]``."""
    return {
        f"model.layers.{i}.self_attn.attn": (
            torch.zeros(BLOCKS, BLOCK_SIZE, 1, 512, dtype=torch.bfloat16),
            torch.zeros(BLOCKS, BLOCK_SIZE, 1, 64, dtype=torch.bfloat16),
        )
        for i in range(2)
    }


def worker(
    is_mla: bool, heads: int, head_size: int, block_size: int = BLOCK_SIZE, layer_heads=None
):
    """A worker's ``_describe`` for layers whose attention allocated ``heads`` of ``head_size``
    (``layer_heads``: draft layers of a head group of their own)."""
    made = object.__new__(ConnectorWorker)  # not started: only what _describe reads
    made.config = SimpleNamespace(is_mla=is_mla, block_size=block_size)
    geometry = AttentionGeometry(heads, head_size)
    return SimpleNamespace(
        _describe=lambda caches, identity: made._describe(caches, identity, geometry, layer_heads)
    )


def test_a_draft_layer_of_its_own_head_group_is_described_with_its_heads() -> None:
    """vLLM CPU views of two model layers holding 2 KV heads and an EAGLE layer holding 1 of its
    draft's 2 (TP 2): the draft's regions hold 1 head and name its group; a draft view holding
    other heads than its group gives is refused, naming the layer."""
    views = {
        f"model.layers.{i}.self_attn.attn": torch.zeros(3, 2, 32, 128, dtype=torch.bfloat16)
        for i in range(2)
    }
    views["model.layers.2.self_attn.attn"] = torch.zeros(3, 1, 32, 128, dtype=torch.bfloat16)
    identity = ModelIdentity("tiny", "bfloat16", "auto", 32, 64, 4, 3, False, "CPU_ATTN/vec")
    draft = {"model.layers.2.self_attn.attn": LayerHeads(num_kv_heads=1, group_kv_heads=2)}
    memory = worker(False, 2, 64, 32, draft)._describe(views, identity)
    assert [(r.layout.num_heads, r.layout.kv_heads) for r in memory.regions] == [
        (2, 0),
        (2, 0),
        (1, 2),
    ]
    wrong = {"model.layers.2.self_attn.attn": LayerHeads(num_kv_heads=2, group_kv_heads=4)}
    with pytest.raises(LayoutError, match=r"layer model\.layers\.2\.self_attn\.attn: .*1 heads"):
        worker(False, 2, 64, 32, wrong)._describe(views, identity)


def test_a_draft_layer_of_its_own_head_size_is_described_with_its_own_packing() -> None:
    """An EAGLE layer of head size 64 (view width 128) after model layers of head size 32
    (width 64), both of the vec kernel: each region carries the packing of its own head size,
    so blocks of every layer can be cut by token; a draft of the model's head count shares its
    group (``kv_heads`` 0) and differs in head size only."""
    views = {
        f"model.layers.{i}.self_attn.attn": torch.zeros(3, 2, 32, 64, dtype=torch.float32)
        for i in range(2)
    }
    views["model.layers.2.self_attn.attn"] = torch.zeros(3, 2, 32, 128, dtype=torch.float32)
    identity = ModelIdentity("tiny", "float32", "auto", 32, 32, 4, 3, False, "CPU_ATTN/vec")
    draft = {
        "model.layers.2.self_attn.attn": LayerHeads(num_kv_heads=2, group_kv_heads=4, head_size=64)
    }
    memory = worker(False, 2, 32, 32, draft)._describe(views, identity)
    packings = [r.layout.packing for r in memory.regions]
    assert packings == [chunk_packing("CPU_ATTN/vec", "auto", 32, 4)] * 2 + [
        chunk_packing("CPU_ATTN/vec", "auto", 64, 4)
    ]
    assert packings[0] != packings[2] and all(packings)


def test_the_worker_describes_tuple_caches_with_the_configs_mla_flag() -> None:
    """``ConnectorWorker._describe`` hands vllm-ascend's tuples over with ``config.is_mla``."""

    caches = ascend_mla_caches()
    identity = ModelIdentity("ds", "bfloat16", "auto", BLOCK_SIZE, 576, 1, 2, True)
    memory = worker(True, 1, 576)._describe(caches, identity)
    assert [r.name.rsplit(".", 1)[1] for r in memory.regions] == ["nope", "rope"] * 2
    tensors = [t for pair in caches.values() for t in pair]
    assert len(memory.tensors) == len(tensors)
    assert all(a is b for a, b in zip(memory.tensors, tensors, strict=True))  # all registered
    with pytest.raises(LayoutError, match="looks like an MLA cache"):
        worker(False, 1, 576)._describe(caches, identity)


@pytest.mark.parametrize("isa", ["vec", "vec16", "amx"])
def test_vllm_cpu_views_carry_their_isa_packing(isa) -> None:
    """vLLM CPU's per-layer views ``[blocks, heads, tokens, 2 * head_size]`` are described with
    the chunk packing of the ISA the backend label names (what lets prefill and decode use
    different block sizes); a backend without a known packing leaves it unknown."""
    views = {
        f"model.layers.{i}.self_attn.attn": torch.zeros(3, 2, 32, 128, dtype=torch.bfloat16)
        for i in range(2)
    }
    identity = ModelIdentity("tiny", "bfloat16", "auto", 32, 64, 2, 2, False, f"CPU_ATTN/{isa}")
    memory = worker(False, 2, 64, 32)._describe(views, identity)
    layout = memory.regions[0].layout
    assert layout.block_order is BlockOrder.HEAD_MAJOR
    assert layout.packing == chunk_packing(f"CPU_ATTN/{isa}", "auto", 64, 2) != ()
    for label, dtype in (("CPU_ATTN/neon", "auto"), ("CPU_ATTN/vec", "fp8"), ("OTHER", "auto")):
        other = ModelIdentity("tiny", "bfloat16", dtype, 32, 64, 2, 2, False, label)
        assert worker(False, 2, 64, 32)._describe(views, other).regions[0].layout.packing == ()


def test_a_packing_that_does_not_account_for_the_bytes_is_dropped() -> None:
    """Views wider than K and V of the head size (a backend changed under us): unknown packing
    and a warning, never a failed start."""
    views = {"model.layers.0.self_attn.attn": torch.zeros(3, 2, 32, 256, dtype=torch.bfloat16)}
    identity = ModelIdentity("tiny", "bfloat16", "auto", 32, 64, 2, 1, False, "CPU_ATTN/vec")
    memory = worker(False, 2, 64, 32)._describe(views, identity)
    assert memory.regions[0].layout.packing == ()


def carved_views(heads: int, block_size: int, dtype, layout_name: str = "LBHNC"):
    """Two layers' views carved from one allocation exactly as vLLM 0.32's allocator does
    (``create_kv_cache_views``), for a rank holding ``heads`` KV heads of size 64."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[layout_name]
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=64, dtype=dtype)
    page, blocks, layers = spec.page_size_bytes, 4, 2
    strides = (page * blocks, page) if layout.is_layer_compact else (page, page * layers)
    raw = torch.zeros(page * blocks * layers, dtype=torch.int8)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    tensor = KVCacheTensor(raw.numel(), names, *strides)
    return dict(zip(names, create_kv_cache_views(raw, spec, blocks, layout, tensor), strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout_name", ["LBHNC", "BLHNC"])
@pytest.mark.parametrize(
    ("tp", "block_size"), [(1, 32), (2, 64), (4, 32), (1, 128)], ids=["tp1", "tp2", "tp4", "big"]
)
def test_views_vllm_carves_at_every_tp_keep_the_vec_packing(tp, block_size, layout_name, dtype):
    """Issue #26 item 2: the tiny model's 4 KV heads at TP 1, 2 and 4 (4, 2 and 1 per rank), as
    vLLM 0.32 carves them (``[blocks, heads, tokens, 128]``, any block stride): the vec packing
    accounts for every byte of each chunk, so blocks can be cut by token at every TP."""
    heads = 4 // tp
    views = carved_views(heads, block_size, dtype, layout_name)
    element = torch.empty((), dtype=dtype).element_size()
    label = "float32" if dtype == torch.float32 else "bfloat16"
    identity = ModelIdentity("tiny", label, "auto", block_size, 64, 4, 2, False, "CPU_ATTN/vec")
    memory = worker(False, heads, 64, block_size)._describe(views, identity)
    packing = chunk_packing("CPU_ATTN/vec", "auto", 64, element)
    for region in memory.regions:
        assert region.layout.block_order is BlockOrder.HEAD_MAJOR
        assert region.layout.packing == packing != ()
        assert region.layout.head_token_bytes == 2 * 64 * element


def test_token_major_views_and_mismatched_layers_leave_the_packing_unknown(caplog) -> None:
    """A packing only applies to head-major chunks: token-major views describe fine without one;
    layers whose chunks differ leave it unknown, with a warning naming the geometry."""
    identity = ModelIdentity("tiny", "float32", "auto", 64, 64, 4, 2, False, "CPU_ATTN/vec")
    token_major = carved_views(2, 64, torch.float32, "LBNHC")
    memory = worker(False, 2, 64, 64)._describe(token_major, identity)
    assert memory.regions[0].layout.block_order is BlockOrder.TOKEN_MAJOR
    assert memory.regions[0].layout.packing == ()
    mixed = carved_views(2, 64, torch.float32)
    wide = torch.zeros(4, 2, 64, 256)
    mixed["model.layers.1.self_attn.attn"] = wide
    with caplog.at_level("WARNING"):
        from vllm_ascend_mooncake.connector.worker import _chunk_packing

        assert _chunk_packing(identity, mixed) == ()
    assert "512 B / 1024 B per head and token" in caplog.text
    assert "treating its blocks as unsplittable" in caplog.text
