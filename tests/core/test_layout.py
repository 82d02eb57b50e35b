"""Region descriptions derived from real tensors must address exactly the tensor's bytes."""

from __future__ import annotations

import pytest
import torch

from vllm_ascend_mooncake.core.layout import (
    BlockOrder,
    LayoutError,
    Region,
    describe_latent_tensor,
    describe_split_kv_tensor,
    describe_vllm_layer_view,
    head_chunk_token_bytes,
    kernel_block_ids,
)

NUM_BLOCKS, HEADS, BLOCK, HEAD_SIZE = 5, 2, 32, 64


def vllm_views(layout_name: str, num_layers: int = 3, dtype=torch.bfloat16) -> list[torch.Tensor]:
    """Per-layer views exactly as vLLM 0.32's allocator builds them."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layer_kv_cache_shape_bytes,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[layout_name]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=dtype)
    page = 1
    for dim in compute_layer_kv_cache_shape_bytes(spec, 1)[1:]:
        page *= dim
    if layout is KVCacheLayout.LHBNC:  # heads outside blocks: a block is one head's page
        layer_stride, block_stride = page * NUM_BLOCKS, page // HEADS
    elif layout.is_layer_compact:
        layer_stride, block_stride = page * NUM_BLOCKS, page
    else:
        layer_stride, block_stride = page, page * num_layers
    raw = torch.zeros(page * NUM_BLOCKS * num_layers, dtype=torch.int8)
    tensor = KVCacheTensor(
        size=raw.numel(),
        layers=[f"layer.{i}" for i in range(num_layers)],
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    return create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor)


def element_addr(region: Region, block: int, head: int, token: int) -> int:
    """Where the planner believes (block, head, token) starts."""
    layout = region.layout
    base = region.block_addr(block)
    if layout.block_order is BlockOrder.TOKEN_MAJOR:
        return base + token * layout.token_bytes + head * layout.head_token_bytes
    return base + head * layout.head_chunk_bytes + token * layout.head_token_bytes


@pytest.mark.parametrize(
    "layout_name,order,dense",
    [
        ("LBHNC", BlockOrder.HEAD_MAJOR, True),
        ("LBNHC", BlockOrder.TOKEN_MAJOR, True),
        ("BLHNC", BlockOrder.HEAD_MAJOR, False),
        ("BLNHC", BlockOrder.TOKEN_MAJOR, False),
    ],
)
def test_vllm_views_are_described_exactly(layout_name, order, dense) -> None:
    for view in vllm_views(layout_name):
        layout = describe_vllm_layer_view(
            view.shape, view.stride(), view.element_size(), num_kv_heads=HEADS, block_size=BLOCK
        )
        assert layout.block_order is order
        assert layout.dense is dense
        assert layout.head_token_bytes == 2 * HEAD_SIZE * view.element_size()  # K and V fused
        region = Region("layer", view.data_ptr(), layout)
        for block in range(NUM_BLOCKS):
            for head in range(HEADS):
                for token in (0, 1, BLOCK - 1):
                    assert (
                        element_addr(region, block, head, token)
                        == view[block, head, token].data_ptr()
                    )
        if dense:  # the registered span ends exactly at the last element
            last = view[NUM_BLOCKS - 1, HEADS - 1, BLOCK - 1, -1]
            assert region.base + layout.span_bytes == last.data_ptr() + view.element_size()


def test_head_outside_block_layout_is_refused() -> None:
    (view, *_) = vllm_views("LHBNC")
    with pytest.raises(LayoutError, match="VLLM_KV_CACHE_LAYOUT"):
        describe_vllm_layer_view(
            view.shape, view.stride(), view.element_size(), num_kv_heads=HEADS, block_size=BLOCK
        )


def test_config_mismatches_are_refused() -> None:
    (view, *_) = vllm_views("LBHNC")
    args = (view.shape, view.stride(), view.element_size())
    with pytest.raises(LayoutError, match="has 2 heads but this rank should hold 4"):
        describe_vllm_layer_view(*args, num_kv_heads=4, block_size=BLOCK)
    with pytest.raises(LayoutError, match="does not divide the engine block size 16"):
        describe_vllm_layer_view(*args, num_kv_heads=HEADS, block_size=16)
    # a kernel block that divides the engine's: each engine block is that many of the view's
    layout = describe_vllm_layer_view(*args, num_kv_heads=HEADS, block_size=3 * BLOCK)
    assert layout.kernel_blocks == 3 and layout.tokens_per_block == BLOCK
    with pytest.raises(LayoutError, match="4-D"):
        describe_vllm_layer_view(
            view.shape[1:], view.stride()[1:], 2, num_kv_heads=2, block_size=32
        )


@pytest.mark.parametrize("flattened", [False, True])
def test_split_kv_tensors_token_major(flattened) -> None:
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE, dtype=torch.float16)
    tensor = k_cache.view(NUM_BLOCKS, BLOCK, HEADS * HEAD_SIZE) if flattened else k_cache
    layout = describe_split_kv_tensor(
        tensor.shape,
        tensor.stride(),
        tensor.element_size(),
        num_kv_heads=HEADS,
        block_size=BLOCK,
        head_size=HEAD_SIZE,
    )
    assert layout.block_order is BlockOrder.TOKEN_MAJOR and layout.dense
    region = Region("k", k_cache.data_ptr(), layout)
    for block in range(NUM_BLOCKS):
        for head in range(HEADS):
            for token in (0, 7, BLOCK - 1):
                assert (
                    element_addr(region, block, head, token)
                    == k_cache[block, token, head].data_ptr()
                )


def test_split_kv_with_wrong_heads_is_refused() -> None:
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE)
    with pytest.raises(LayoutError, match="does not hold 4 heads of size 64"):
        describe_split_kv_tensor(
            k_cache.shape, k_cache.stride(), 4, num_kv_heads=4, block_size=BLOCK, head_size=64
        )
    transposed = k_cache.transpose(1, 2)  # [B, H, N, D]: not token-major
    with pytest.raises(LayoutError):
        describe_split_kv_tensor(
            transposed.shape,
            transposed.stride(),
            4,
            num_kv_heads=HEADS,
            block_size=BLOCK,
            head_size=HEAD_SIZE,
        )


def test_mla_latent_forms() -> None:
    latent = torch.zeros(NUM_BLOCKS, BLOCK, 576, dtype=torch.bfloat16)
    layout = describe_latent_tensor(latent.shape, latent.stride(), 2, block_size=BLOCK)
    assert layout.block_order is BlockOrder.LATENT and layout.block_len == BLOCK * 576 * 2
    vllm_mla = latent.view(NUM_BLOCKS, 1, BLOCK, 576)
    same = describe_vllm_layer_view(
        vllm_mla.shape, vllm_mla.stride(), 2, num_kv_heads=1, block_size=BLOCK, is_mla=True
    )
    assert same == layout


def test_overlapping_blocks_are_refused() -> None:
    from vllm_ascend_mooncake.core.layout import RegionLayout

    with pytest.raises(LayoutError, match="blocks overlap"):
        RegionLayout(BlockOrder.HEAD_MAJOR, 4, 100, 2, 4, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("layout_name", "expected"), [("LBHNC", True), ("BLHNC", True), ("LBNHC", False)]
)
def test_chunk_bytes_per_token_come_from_shape_and_strides(layout_name, expected, dtype) -> None:
    """What a (block, head) chunk holds per token, from vLLM's own views: K and V of the head
    size for head-major chunks at any block stride (layer-compact or block-outermost), none for
    token-major views (a head's bytes are not one chunk)."""
    for view in vllm_views(layout_name, dtype=dtype):
        held = head_chunk_token_bytes(
            view.shape, view.stride(), view.element_size(), block_size=BLOCK
        )
        assert held == (2 * HEAD_SIZE * view.element_size() if expected else None)


def test_chunk_bytes_per_token_follow_the_geometry_not_the_last_dimension() -> None:
    """The same chunk seen as ``[heads, tokens, 2 * D]`` or ``[heads, 2 * tokens, D]`` holds the
    same bytes per token; a single head needs no head stride; anything that is not one
    contiguous run per (block, head) has no chunk."""
    cache = torch.zeros(3, 2, 32, 128)
    fused = head_chunk_token_bytes(cache.shape, cache.stride(), 4, block_size=32)
    rows = cache.view(3, 2, 64, 64)
    assert fused == head_chunk_token_bytes(rows.shape, rows.stride(), 4, block_size=32) == 512
    one = cache[:, :1]
    assert head_chunk_token_bytes(one.shape, one.stride(), 4, block_size=32) == 512
    padded = torch.zeros(3, 2, 32, 256)[..., :128]  # strided rows
    assert head_chunk_token_bytes(padded.shape, padded.stride(), 4, block_size=32) is None
    halves = cache[..., ::2]  # strided content
    assert head_chunk_token_bytes(halves.shape, halves.stride(), 4, block_size=32) is None
    assert head_chunk_token_bytes(cache.shape, cache.stride(), 4, block_size=64) is None
    five = torch.zeros(3, 2, 32, 2, 64)
    assert head_chunk_token_bytes(five.shape, five.stride(), 4, block_size=32) is None


def test_kernel_block_ids_drop_the_last_engine_blocks_unused_kernel_blocks() -> None:
    """Engine blocks of 4 kernel blocks of 32 tokens: a 300-token prompt fills engine blocks
    5 and 9 (128 tokens each) and 44 tokens of engine block 2, i.e. two of its kernel blocks."""
    assert kernel_block_ids([5, 9, 2], 4, 32, 300) == [20, 21, 22, 23, 36, 37, 38, 39, 8, 9]
    assert kernel_block_ids([2], 4, 32, 300) == [8, 9]  # a suffix (decode's uncached blocks)
    assert kernel_block_ids([5, 9, 2], 4, 32, 384) == [*range(20, 24), *range(36, 40), 8, 9, 10, 11]
    assert kernel_block_ids([5, 2], 4, 32, None) == [20, 21, 22, 23, 8, 9, 10, 11]
    assert kernel_block_ids([5, 2], 1, 32, 7) == [5, 2]
