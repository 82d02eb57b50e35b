"""From vllm-ascend's per-layer cache tuples to regions: K/V pairs and MLA (nope, rope) pairs.

vllm-ascend's MLA cache per layer is ``(nope, rope)``: ``[num_blocks, block_size, 1,
kv_lora_rank]`` and ``[num_blocks, block_size, 1, qk_rope_head_dim]`` (see
``datapath/registration.py`` for where in vllm-ascend this was read). Each tensor is its own latent
region, described from its real shape and strides; a pair of different widths is never taken for
K and V.
"""

from __future__ import annotations

import pytest
import torch

from vllm_ascend_mooncake.core.layout import BlockOrder, LayoutError
from vllm_ascend_mooncake.datapath.registration import (
    kv_memory_ranges,
    regions_from_split_caches,
    regions_from_vllm_views,
)

BLOCKS, BLOCK_SIZE = 6, 16
NOPE, ROPE = 512, 64  # DeepSeek's kv_lora_rank and qk_rope_head_dim


def ascend_mla_caches(layers=2, blocks=BLOCKS, block_size=BLOCK_SIZE, dtype=torch.bfloat16):
    """Per layer vllm-ascend's (nope, rope) pair, each its own allocation."""
    return {
        f"model.layers.{i}.self_attn.attn": (
            torch.zeros(blocks, block_size, 1, NOPE, dtype=dtype),
            torch.zeros(blocks, block_size, 1, ROPE, dtype=dtype),
        )
        for i in range(layers)
    }


def mla_regions(caches, block_size=BLOCK_SIZE):
    return regions_from_split_caches(
        caches, num_kv_heads=1, block_size=block_size, head_size=NOPE + ROPE, is_mla=True
    )


def test_each_mla_tensor_is_its_own_latent_region_named_nope_and_rope() -> None:
    caches = ascend_mla_caches()
    regions = mla_regions(caches)
    assert [r.name for r in regions] == [
        "model.layers.0.self_attn.attn.nope",
        "model.layers.0.self_attn.attn.rope",
        "model.layers.1.self_attn.attn.nope",
        "model.layers.1.self_attn.attn.rope",
    ]
    tensors = [t for pair in caches.values() for t in pair]
    for region, tensor in zip(regions, tensors, strict=True):
        width = tensor.shape[-1]
        layout = region.layout
        assert region.base == tensor.data_ptr()
        assert layout.block_order is BlockOrder.LATENT and layout.num_heads == 1
        assert layout.num_blocks == BLOCKS and layout.tokens_per_block == BLOCK_SIZE
        assert layout.head_token_bytes == width * 2
        assert layout.block_stride == layout.block_len == BLOCK_SIZE * width * 2 and layout.dense
        for block in (0, 3, BLOCKS - 1):  # every block starts where torch says it does
            assert region.block_addr(block) == tensor[block].data_ptr()
    # every tensor is its own allocation: each is registered
    assert len(kv_memory_ranges(tensors)) == len(tensors)


def test_the_three_dimensional_form_describes_the_same_bytes() -> None:
    four_d = ascend_mla_caches(layers=1)
    three_d = {
        name: tuple(t.view(BLOCKS, BLOCK_SIZE, -1) for t in pair) for name, pair in four_d.items()
    }
    assert [r.layout for r in mla_regions(three_d)] == [r.layout for r in mla_regions(four_d)]


def test_a_single_latent_keeps_the_layer_name() -> None:
    packed = torch.zeros(BLOCKS, BLOCK_SIZE, 1, 656, dtype=torch.int8)  # e.g. sparse SFA C8
    (region,) = mla_regions({"layer.0": (packed,)})
    assert region.name == "layer.0" and region.layout.head_token_bytes == 656
    assert region.layout.block_order is BlockOrder.LATENT


def test_strides_not_shape_give_the_block_stride() -> None:
    # Blocks padded apart (a tensor carved from a larger allocation): the stride is the truth.
    padded = torch.zeros(BLOCKS, BLOCK_SIZE * NOPE + 256, dtype=torch.float16)
    nope = padded[:, : BLOCK_SIZE * NOPE].view(BLOCKS, BLOCK_SIZE, 1, NOPE)
    rope = torch.zeros(BLOCKS, BLOCK_SIZE, 1, ROPE, dtype=torch.float16)
    regions = mla_regions({"layer.0": (nope, rope)})
    assert regions[0].layout.block_stride == (BLOCK_SIZE * NOPE + 256) * 2
    assert not regions[0].layout.dense and regions[1].layout.dense
    assert regions[0].block_addr(4) == nope[4].data_ptr()


@pytest.mark.parametrize(
    "tensor,message",
    [
        (torch.zeros(BLOCKS, BLOCK_SIZE, 2, ROPE), r"shape \(6, 16, 2, 64\) has 2 there"),
        (torch.zeros(BLOCKS, BLOCK_SIZE * ROPE), r"got shape \(6, 1024\)"),
        (torch.zeros(BLOCKS, BLOCK_SIZE, 1, 1, ROPE), r"got shape \(6, 16, 1, 1, 64\)"),
        (torch.zeros(BLOCKS, 32, 1, ROPE), "32 tokens per block, which does not divide the engine"),
        (  # tokens not contiguous: [blocks, width, 1, tokens] seen through a transpose
            torch.zeros(BLOCKS, ROPE, 1, BLOCK_SIZE).transpose(1, 3),
            "not contiguous within a block",
        ),
    ],
)
def test_latent_tensors_the_planner_cannot_describe_are_refused(tensor, message) -> None:
    nope = torch.zeros(BLOCKS, BLOCK_SIZE, 1, NOPE)
    with pytest.raises(LayoutError, match=message) as refused:
        mla_regions({"layer.0": (nope, tensor)})
    assert str(refused.value).startswith("layer.0.rope: ")


def test_an_mla_layer_with_more_parts_is_one_latent_region_per_part() -> None:
    """DeepSeek V3.2 on vllm-ascend 0.23: (nope, rope, indexer keys[, their scales])."""
    parts = tuple(torch.zeros(BLOCKS, BLOCK_SIZE, 1, w) for w in (NOPE, ROPE, 128, 1))
    regions = mla_regions({"layer.0": parts})
    assert [r.name for r in regions] == [f"layer.0.{i}" for i in range(4)]
    assert [r.layout.head_token_bytes for r in regions] == [4 * w for w in (NOPE, ROPE, 128, 1)]
    assert all(r.layout.block_order is BlockOrder.LATENT for r in regions)


def test_without_mla_a_pair_is_k_and_v_as_before() -> None:
    k, v = (torch.zeros(BLOCKS, BLOCK_SIZE, 2, 64, dtype=torch.float16) for _ in range(2))
    regions = regions_from_split_caches(
        {"layer.0": (k, v)}, num_kv_heads=2, block_size=BLOCK_SIZE, head_size=64, is_mla=False
    )
    assert [r.name for r in regions] == ["layer.0.k", "layer.0.v"]
    assert [r.base for r in regions] == [k.data_ptr(), v.data_ptr()]
    assert {r.layout.block_order for r in regions} == {BlockOrder.TOKEN_MAJOR}
    assert {r.layout.num_heads for r in regions} == {2}


def test_without_mla_a_pair_of_different_widths_is_refused_as_looking_like_mla() -> None:
    caches = ascend_mla_caches(layers=1)
    with pytest.raises(LayoutError) as refused:
        regions_from_split_caches(
            caches, num_kv_heads=1, block_size=BLOCK_SIZE, head_size=NOPE + ROPE, is_mla=False
        )
    message = str(refused.value)
    assert "model.layers.0.self_attn.attn" in message and "(512 vs 64)" in message
    assert "looks like an MLA cache (nope, rope)" in message and "check the model config" in message


def test_without_mla_a_single_tensor_is_refused() -> None:
    latent = torch.zeros(BLOCKS, BLOCK_SIZE, 1, NOPE + ROPE)
    with pytest.raises(LayoutError, match=r"MLA latent cache.*check the model config"):
        regions_from_split_caches(
            {"layer.0": (latent,)},
            num_kv_heads=1,
            block_size=BLOCK_SIZE,
            head_size=NOPE + ROPE,
            is_mla=False,
        )


# --- vLLM 0.23's per-layer shapes (read in its sources; its CPU wheel cannot be installed here) --


def _vllm_023_cuda_layer(stride_order: tuple[int, ...]) -> torch.Tensor:
    """A layer as vLLM 0.23's CUDA backends allocate it: logical ``(blocks, 2, N, H, D)``
    (``FlashAttentionBackend.get_kv_cache_shape``), physical order ``stride_order``
    (``get_kv_cache_stride_order``: HND ``(0, 1, 3, 2, 4)``, NHD the identity)."""
    logical = (5, 2, 16, 3, 8)
    physical = torch.arange(torch.Size(logical).numel(), dtype=torch.float16)
    physical = physical.view(*(logical[i] for i in stride_order))
    inverse = [stride_order.index(i) for i in range(5)]
    return physical.permute(*inverse)


@pytest.mark.parametrize(
    "stride_order,order",
    [((0, 1, 3, 2, 4), BlockOrder.HEAD_MAJOR), ((0, 1, 2, 3, 4), BlockOrder.TOKEN_MAJOR)],
    ids=["HND", "NHD"],
)
def test_a_five_dimensional_layer_becomes_k_and_v_regions_at_the_right_bytes(
    stride_order, order
) -> None:
    layer = _vllm_023_cuda_layer(stride_order)
    regions = regions_from_vllm_views(
        {"layers.0.attn": layer}, num_kv_heads=3, block_size=16, is_mla=False
    )
    assert [r.name for r in regions] == ["layers.0.attn.k", "layers.0.attn.v"]
    size = layer.element_size()
    for kv, region in enumerate(regions):
        layout = region.layout
        assert layout.block_order is order and layout.num_heads == 3
        assert layout.head_token_bytes == 8 * size and layout.packing == ()
        for block, token, head in [(0, 0, 0), (4, 15, 2), (2, 7, 1)]:
            if order is BlockOrder.HEAD_MAJOR:
                offset = head * layout.head_chunk_bytes + token * layout.head_token_bytes
            else:
                offset = token * layout.token_bytes + head * layout.head_token_bytes
            address = region.base + block * layout.block_stride + offset
            assert address == layer[block, kv, token, head].data_ptr()


def test_a_three_dimensional_mla_layer_is_one_latent_region() -> None:
    latent = torch.zeros(4, 16, 576, dtype=torch.bfloat16)  # vLLM 0.23 MLA: (blocks, N, width)
    (region,) = regions_from_vllm_views(
        {"layers.0.attn": latent}, num_kv_heads=1, block_size=16, is_mla=True
    )
    assert region.layout.block_order is BlockOrder.LATENT
    assert region.layout.block_stride == 16 * 576 * 2
