"""From a worker's KV cache tensors to the regions the planner sees and the memory to register.

vLLM 0.32 hands the connector one 4-D view per layer, all views sharing one backing allocation;
vllm-ascend-style caches are separate K and V tensors per layer. Either way each tensor becomes one
:class:`Region` described from its real shape and strides, and memory is registered once per
distinct storage.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from ..core.layout import (
    Region,
    describe_latent_tensor,
    describe_split_kv_tensor,
    describe_vllm_layer_view,
)
from .transport import MemoryRange

if TYPE_CHECKING:
    import torch


def regions_from_vllm_views(
    kv_caches: Mapping[str, torch.Tensor], *, num_kv_heads: int, block_size: int, is_mla: bool
) -> list[Region]:
    """One region per layer view ``[num_blocks, H, N, C]``, in the order vLLM gave them."""
    regions = []
    for name, view in kv_caches.items():
        layout = describe_vllm_layer_view(
            view.shape,
            view.stride(),
            view.element_size(),
            num_kv_heads=num_kv_heads,
            block_size=block_size,
            is_mla=is_mla,
        )
        regions.append(Region(name, view.data_ptr(), layout))
    return regions


def regions_from_split_caches(
    kv_caches: Mapping[str, tuple[torch.Tensor, ...]],
    *,
    num_kv_heads: int,
    block_size: int,
    head_size: int,
) -> list[Region]:
    """Regions for per-layer ``(K, V)`` token-major tensors, or ``(latent,)`` for MLA."""
    regions = []
    for name, tensors in kv_caches.items():
        if len(tensors) == 1:
            (latent,) = tensors
            layout = describe_latent_tensor(
                latent.shape, latent.stride(), latent.element_size(), block_size=block_size
            )
            regions.append(Region(name, latent.data_ptr(), layout))
            continue
        for suffix, tensor in zip(("k", "v"), tensors, strict=True):
            layout = describe_split_kv_tensor(
                tensor.shape,
                tensor.stride(),
                tensor.element_size(),
                num_kv_heads=num_kv_heads,
                block_size=block_size,
                head_size=head_size,
            )
            regions.append(Region(f"{name}.{suffix}", tensor.data_ptr(), layout))
    return regions


def storage_ranges(tensors: Iterable[torch.Tensor]) -> list[MemoryRange]:
    """The distinct backing storages of ``tensors`` (vLLM layers share one)."""
    seen: dict[int, MemoryRange] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen.setdefault(storage.data_ptr(), MemoryRange(storage.data_ptr(), storage.nbytes()))
    return list(seen.values())
