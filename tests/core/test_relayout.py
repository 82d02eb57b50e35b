"""Torch fix-up kernels against the numpy reference executor, and the fast-path hook."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vam_testing.kv_reference import AddressSpace, run_row_copies, run_swap
from vllm_ascend_mooncake.core.plan import RowCopies, SwapAxes
from vllm_ascend_mooncake.core.relayout import (
    LocalMemory,
    SwapFastPath,
    apply_row_copies,
    apply_swaps,
    register_swap_fast_path,
    unregister_swap_fast_path,
)


def _memories(sizes: list[int], seed: int) -> tuple[LocalMemory, AddressSpace, list[torch.Tensor]]:
    rng = np.random.default_rng(seed)
    tensors = [torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8)) for n in sizes]
    reference = AddressSpace()
    for t in tensors:
        reference.add(t.data_ptr(), t.numpy().copy())
    return LocalMemory(tensors), reference, tensors


def _assert_same(tensors: list[torch.Tensor], reference: AddressSpace) -> None:
    for t in tensors:
        np.testing.assert_array_equal(t.numpy(), reference.view(t.data_ptr(), t.numel()))


@pytest.mark.parametrize("seed", range(20))
def test_swaps_match_the_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    memory, reference, tensors = _memories([4096, 8192], seed)
    outer, inner, unit = (int(x) for x in rng.integers(1, 6, 3))
    span = outer * inner * unit
    addrs = [
        tensors[0].data_ptr() + int(rng.integers(0, 4096 - span)),
        tensors[1].data_ptr() + int(rng.integers(0, 8192 - span)),
    ]
    swap = SwapAxes(np.array(addrs, dtype=np.int64), outer, inner, unit)
    apply_swaps(memory, [swap])
    run_swap(reference, swap)
    _assert_same(tensors, reference)


def test_swap_is_the_block_merge_transpose() -> None:
    """[k=2][tokens=3][heads*dim=4] becomes [tokens][k][heads*dim]."""
    data = torch.arange(24, dtype=torch.uint8)
    memory = LocalMemory([data])
    apply_swaps(memory, [SwapAxes(np.array([data.data_ptr()]), outer=2, inner=3, unit=4)])
    expected = torch.arange(24, dtype=torch.uint8).view(2, 3, 4).transpose(0, 1).reshape(-1)
    assert torch.equal(data, expected)


@pytest.mark.parametrize("seed", range(10))
def test_row_copies_match_the_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    memory, reference, (staging, blocks) = _memories([2048, 2048], seed)
    rows, row_bytes = int(rng.integers(1, 16)), int(rng.integers(1, 8))
    src_stride, dst_stride = (
        row_bytes + int(rng.integers(0, 8)),
        row_bytes + int(rng.integers(0, 4)),
    )
    planes = int(rng.integers(1, 4))
    copies = RowCopies(
        src_addrs=np.array([staging.data_ptr() + 3]),
        dst_addrs=np.array([blocks.data_ptr() + 5]),
        src_stride=src_stride,
        dst_stride=dst_stride,
        rows=rows,
        row_bytes=row_bytes,
        planes=planes,
        src_plane_stride=rows * src_stride + int(rng.integers(0, 8)),
        dst_plane_stride=rows * dst_stride + int(rng.integers(0, 8)),
    )
    apply_row_copies(memory, [copies])
    run_row_copies(reference, copies)
    _assert_same([staging, blocks], reference)


def test_memory_from_vllm_style_layer_views_dedupes_storage() -> None:
    raw = torch.zeros(4 * 1024, dtype=torch.int8)
    layers = [
        raw[i * 1024 : (i + 1) * 1024].view(torch.bfloat16).view(2, 2, 4, 32) for i in range(4)
    ]
    memory = LocalMemory.from_tensors(layers)
    assert len(memory.buffers) == 1 and memory.buffers[0].numel() == 4 * 1024
    assert memory.view(layers[2].data_ptr(), 1024).data_ptr() == layers[2].data_ptr()
    with pytest.raises(ValueError, match="not inside one registered local buffer"):
        memory.view(layers[3].data_ptr() + 1000, 100)


def test_fast_path_is_used_where_supported_and_agrees_with_torch() -> None:
    """No NPU here: a second torch implementation stands in for the fused NPU kernel to exercise
    the hook; the real vllm-ascend op is not available on this machine."""
    calls = []

    def cycle_following_swap(memory: LocalMemory, swap: SwapAxes) -> None:
        calls.append(swap)
        for addr in swap.addrs.tolist():
            span = memory.view(addr, swap.span).view(swap.outer * swap.inner, swap.unit)
            order = [o * swap.inner + i for i in range(swap.inner) for o in range(swap.outer)]
            span.copy_(span[order])

    register_swap_fast_path(
        SwapFastPath("test-fast", lambda t: t.device.type == "cpu", cycle_following_swap)
    )
    try:
        memory, reference, tensors = _memories([600], 3)
        swap = SwapAxes(np.array([tensors[0].data_ptr() + 7]), outer=4, inner=5, unit=6)
        apply_swaps(memory, [swap])
        run_swap(reference, swap)
        _assert_same(tensors, reference)
        assert calls == [swap]
    finally:
        unregister_swap_fast_path("test-fast")

    register_swap_fast_path(SwapFastPath("never", lambda t: False, cycle_following_swap))
    try:
        memory, reference, tensors = _memories([600], 4)
        apply_swaps(memory, [SwapAxes(np.array([tensors[0].data_ptr()]), 2, 3, 4)])
        assert len(calls) == 1
    finally:
        unregister_swap_fast_path("never")
