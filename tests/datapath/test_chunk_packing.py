"""core/packing.py against vLLM CPU's own kernel: the packing it states is where the kernel puts
each token's K and V bytes, and cutting a big block's chunk by it gives the small blocks' chunks.

These run vLLM's ``cpu_attn_reshape_and_cache`` (the op that writes the KV cache in every forward)
on random K and V; ``amx`` only where the CPU has AMX tiles.
"""

from __future__ import annotations

import pytest
import torch

from vllm_ascend_mooncake.core.layout import ChunkPacking
from vllm_ascend_mooncake.core.packing import chunk_packing

HEADS = 2


def amx_available() -> bool:
    return bool(torch.cpu._is_amx_tile_supported())


ISAS = [
    ("vec", torch.float32),
    ("vec", torch.bfloat16),
    ("vec16", torch.bfloat16),
    pytest.param(
        "amx",
        torch.bfloat16,
        marks=pytest.mark.skipif(not amx_available(), reason="this CPU has no AMX tiles"),
    ),
]


def kernel_cache(isa: str, key: torch.Tensor, value: torch.Tensor, block_size: int) -> torch.Tensor:
    """The KV cache vLLM CPU writes for tokens ``0..T-1`` in blocks ``0..T/B-1``, as bytes
    ``[blocks, heads, chunk bytes]`` (the per-layer view ``[blocks, heads, B, 2 * head_size]``
    that the connector registers)."""
    from vllm import _custom_ops as ops

    tokens, heads, head_size = key.shape
    blocks = tokens // block_size
    cache = torch.zeros(blocks, heads, block_size, 2 * head_size, dtype=key.dtype)
    key_cache, value_cache = cache.view(blocks, heads, 2 * block_size, head_size).chunk(2, dim=2)
    slots = torch.arange(tokens, dtype=torch.int64)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
    return cache.view(torch.uint8).reshape(blocks, heads, -1)


def token_range(chunk: torch.Tensor, packing: ChunkPacking, block: int, first: int, count: int):
    """The bytes of tokens ``first..first+count-1`` of one chunk, row by row, as the planner
    cuts them."""
    parts, start = [], 0
    for group in packing:
        w = group.token_bytes
        for row in range(group.rows):
            row_start = start + row * block * w
            parts.append(chunk[row_start + first * w : row_start + (first + count) * w])
        start += group.rows * block * w
    return torch.cat(parts)


@pytest.mark.parametrize(("isa", "dtype"), ISAS)
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize(("small", "large"), [(32, 64), (32, 128), (64, 128)])
def test_a_large_blocks_chunk_cut_by_the_packing_is_the_small_blocks_chunks(
    isa, dtype, head_size, small, large
) -> None:
    torch.manual_seed(0)
    tokens = 2 * large
    key = torch.randn(tokens, HEADS, head_size).to(dtype)
    value = torch.randn(tokens, HEADS, head_size).to(dtype)
    packing = chunk_packing(f"CPU_ATTN/{isa}", "auto", head_size, key.element_size())
    assert packing, f"no packing stated for {isa}"
    assert sum(g.bytes_per_token for g in packing) == 2 * head_size * key.element_size()
    small_cache = kernel_cache(isa, key, value, small)
    large_cache = kernel_cache(isa, key, value, large)
    for first in range(0, tokens, small):
        for head in range(HEADS):
            whole_small = small_cache[first // small, head]
            piece_of_large = token_range(
                large_cache[first // large, head], packing, large, first % large, small
            )
            assert torch.equal(token_range(whole_small, packing, small, 0, small), piece_of_large)
            # ... and all of a chunk's tokens, row by row, are every byte of it, in order
            assert torch.equal(token_range(whole_small, packing, small, 0, small), whole_small)


@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_vec_kernels_store_each_tokens_bytes_where_the_packing_says(isa) -> None:
    """Token by token (vec kernels have no token units): K channel ``c`` of token ``t`` in row
    ``c`` at ``t``; V of token ``t`` in the last row at ``t``."""
    head_size, block = 64, 32
    key = torch.randn(block, HEADS, head_size)
    value = torch.randn(block, HEADS, head_size)
    packing = chunk_packing(f"CPU_ATTN/{isa}", "auto", head_size, 4)
    chunk = kernel_cache(isa, key, value, block)[0, 1]
    for t in range(block):
        cut = token_range(chunk, packing, block, t, 1)
        expected = torch.cat([key[t, 1], value[t, 1]]).view(torch.uint8)
        assert torch.equal(cut, expected)


def test_prefill_tp1_chunks_cut_by_the_packing_are_decode_tp2_chunks() -> None:
    """Issue #26 item 2, byte for byte: the kernel writes the same tokens into views carved as
    vLLM 0.32 carves them for a TP 1 prefill (4 heads, 32-token blocks) and a TP 2 decode (2
    heads per rank, 64-token blocks); the packing the worker states for each view cuts prefill's
    heads ``2r, 2r + 1`` into exactly decode rank ``r``'s chunks."""
    from vllm import _custom_ops as ops
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from vllm_ascend_mooncake.connector.worker import _chunk_packing
    from vllm_ascend_mooncake.datapath.wire import ModelIdentity

    head_size, tokens = 64, 128

    def carve(heads: int, block: int) -> torch.Tensor:
        spec = FullAttentionSpec(
            block_size=block, num_kv_heads=heads, head_size=head_size, dtype=torch.float32
        )
        blocks = tokens // block
        raw = torch.zeros(spec.page_size_bytes * blocks, dtype=torch.int8)
        tensor = KVCacheTensor(
            raw.numel(), ["l0"], spec.page_size_bytes * blocks, spec.page_size_bytes
        )
        return create_kv_cache_views(raw, spec, blocks, KVCacheLayout.LBHNC, tensor)[0]

    def write(view: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        blocks, heads, block, _ = view.shape
        key_cache, value_cache = view.view(blocks, heads, 2 * block, -1).chunk(2, dim=2)
        slots = torch.arange(tokens, dtype=torch.int64)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, "vec")

    torch.manual_seed(0)
    key = torch.randn(tokens, 4, head_size)
    value = torch.randn(tokens, 4, head_size)
    prefill = carve(4, 32)
    write(prefill, key, value)
    packings = {}
    for block in (32, 64):
        identity = ModelIdentity(
            "t", "float32", "auto", block, head_size, 4, 1, False, "CPU_ATTN/vec"
        )
        probe = carve(4 if block == 32 else 2, block)
        packings[block] = _chunk_packing(identity, {"l0": probe})
    assert packings[32] == packings[64] == chunk_packing("CPU_ATTN/vec", "auto", head_size, 4)
    packing = packings[64]
    prefill_bytes = prefill.view(torch.uint8).reshape(prefill.shape[0], 4, -1)
    for rank in range(2):
        decode = carve(2, 64)
        write(decode, key[:, 2 * rank : 2 * rank + 2], value[:, 2 * rank : 2 * rank + 2])
        decode_bytes = decode.view(torch.uint8).reshape(decode.shape[0], 2, -1)
        for first in range(0, tokens, 32):
            for local_head in range(2):
                piece = token_range(
                    prefill_bytes[first // 32, 2 * rank + local_head], packing, 32, 0, 32
                )
                expected = token_range(
                    decode_bytes[first // 64, local_head], packing, 64, first % 64, 32
                )
                assert torch.equal(piece, expected)
