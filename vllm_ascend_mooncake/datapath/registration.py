"""From a worker's KV cache tensors to the regions the planner sees and the memory to register.

vLLM 0.30+ hands the connector one 4-D view per layer, all views sharing one backing allocation
(0.23's other shapes: :func:`regions_from_vllm_views`);
vllm-ascend hands over a tuple of tensors per layer: K and V, or for MLA models the nope and rope
caches (or one packed latent). Either way each tensor becomes one :class:`Region` described from
its real shape and strides, and memory is registered once per distinct storage.

vllm-ascend's MLA layout, as read in the vllm-ascend sources at commit ``182b75ea84``
(2026-08-22); not run on an NPU:

* ``NPUModelRunner._reshape_kv_cache_tensors`` (``vllm_ascend/worker/model_runner_v1.py``) gives an
  ``AscendMLAAttentionSpec`` layer ``kv_caches[layer] = (k_cache, v_cache)``, commented
  "k_cache: nope_cache    v_cache: rope_cache": ``[num_blocks, block_size, 1, kv_lora_rank]`` and
  ``[num_blocks, block_size, 1, qk_rope_head_dim]``, each a contiguous view of its own raw
  int8 allocation (``_allocate_kv_cache_tensors``; hybrid Mamba models carve both from one).
  The widths come from ``_get_attention_kv_cache_dims`` (``MLAAttention.kv_lora_rank`` and
  ``.qk_rope_head_dim``: 512 and 64 for DeepSeek), the 4-D form from
  ``AscendMLABackend.get_kv_cache_shape`` (``vllm_ascend/attention/mla_v1.py``:
  ``(num_blocks, block_size, num_kv_heads, head_size)`` with one KV head).
* With sparse SFA C8 the layer holds one packed tensor, ``(k_cache,)``.
* vllm-ascend's own connector (``kv_p2p/mooncake_connector.py``, ``register_kv_caches``) registers
  every tensor of the tuple on its own, with its own block length and stride, as is done here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..core.layout import (
    ChunkPacking,
    LayoutError,
    Region,
    RegionLayout,
    describe_latent_tensor,
    describe_split_kv_tensor,
    describe_vllm_layer_view,
)
from .transport import MemoryRange, merge_ranges

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class LayerHeads:
    """A layer shaped unlike the model's (a draft layer with a KV-head count or a head size of
    its own): the heads it holds on this rank, its group's total KV heads (what its regions'
    ``kv_heads`` name), and its head size (None: the model's)."""

    num_kv_heads: int
    group_kv_heads: int
    head_size: int | None = None


def _in_group(layout: RegionLayout, own: LayerHeads | None) -> RegionLayout:
    """``layout`` naming its layer's head group (unchanged for the model's layers)."""
    return layout if own is None else replace(layout, kv_heads=own.group_kv_heads)


def regions_from_vllm_views(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    num_kv_heads: int,
    block_size: int,
    is_mla: bool,
    packing: ChunkPacking = (),
    layer_heads: Mapping[str, LayerHeads] | None = None,
    layer_packing: Mapping[str, ChunkPacking] | None = None,
) -> list[Region]:
    """One region per layer view ``[num_blocks, H, N, C]``, in the order vLLM gave them;
    ``packing``: the attention backend's head-major chunk packing (:mod:`..core.packing`);
    ``layer_heads``: the layers of a head group of their own (else ``num_kv_heads``);
    ``layer_packing``: the packing of layers with a head size of their own (else ``packing``).

    vLLM 0.23 hands other shapes, read in its sources (not run: its CPU wheel pins a torch that
    cannot be installed here): CUDA backends a 5-D ``(num_blocks, 2, N, H, D)`` per layer (K and
    V as separate halves of each block, ``flash_attn.py`` ``get_kv_cache_shape``), which become
    two regions ``<layer>.k`` and ``<layer>.v``, and MLA a 3-D latent ``(num_blocks, N, width)``.
    Their chunks' packing is unknown (equal block sizes only)."""
    regions = []
    for name, view in kv_caches.items():
        own = (layer_heads or {}).get(name)
        heads = own.num_kv_heads if own is not None else num_kv_heads
        if view.dim() == 5 and view.shape[1] == 2 and not is_mla:
            for suffix, half in (("k", view[:, 0]), ("v", view[:, 1])):
                heads_first = half.permute(0, 2, 1, 3)  # [blocks, H, N, D], strides kept
                layout = describe_vllm_layer_view(
                    heads_first.shape,
                    heads_first.stride(),
                    view.element_size(),
                    num_kv_heads=heads,
                    block_size=block_size,
                )
                regions.append(
                    Region(f"{name}.{suffix}", heads_first.data_ptr(), _in_group(layout, own))
                )
            continue
        if is_mla and view.dim() == 3:
            layout = describe_latent_tensor(
                view.shape, view.stride(), view.element_size(), block_size=block_size
            )
            regions.append(Region(name, view.data_ptr(), layout))
            continue
        try:
            layout = describe_vllm_layer_view(
                view.shape,
                view.stride(),
                view.element_size(),
                num_kv_heads=heads,
                block_size=block_size,
                is_mla=is_mla,
                packing=(layer_packing or {}).get(name, packing),
            )
        except LayoutError as exc:
            raise LayoutError(f"layer {name}: {exc}") from exc
        regions.append(Region(name, view.data_ptr(), _in_group(layout, own)))
    return regions


def regions_from_split_caches(
    kv_caches: Mapping[str, tuple[torch.Tensor, ...]],
    *,
    num_kv_heads: int,
    block_size: int,
    head_size: int,
    is_mla: bool,
    head_major: bool = False,
    layer_heads: Mapping[str, LayerHeads] | None = None,
) -> list[Region]:
    """Regions for vllm-ascend's per-layer tuples of cache tensors, in layer order
    (``layer_heads``: the layers of a head group or head size of their own, else
    ``num_kv_heads`` and ``head_size``).

    With ``is_mla`` every tensor of a layer's tuple is one :attr:`~..core.layout.BlockOrder.LATENT`
    region, replicated on every rank and described from its own shape (widths may differ): a pair is
    ``(nope, rope)``, named ``<layer>.nope`` and ``<layer>.rope``; a single latent keeps the layer
    name; more parts (DeepSeek V3.2 on vllm-ascend 0.23: nope, rope, the indexer's keys and their
    scales) are named ``<layer>.<position>``. Without it a pair is ``(K, V)``, token- or head-major
    (``head_major``: the layout variable vllm-ascend's backend reads, see
    :func:`~..core.layout.describe_split_kv_tensor`), named ``<layer>.k`` and ``<layer>.v``.
    """
    regions = []
    for name, tensors in kv_caches.items():
        parts = cache_parts(tensors)
        if is_mla:
            regions.extend(_latent_regions(name, parts, block_size))
        else:
            own = (layer_heads or {}).get(name)
            regions.extend(
                Region(r.name, r.base, _in_group(r.layout, own))
                for r in _kv_regions(
                    name,
                    parts,
                    num_kv_heads=own.num_kv_heads if own is not None else num_kv_heads,
                    block_size=block_size,
                    head_size=own.head_size if own is not None and own.head_size else head_size,
                    head_major=head_major,
                )
            )
    return regions


def cache_parts(cache: torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor]) -> tuple:
    """A layer's cache tensors: its tuple, or one tensor alone (DeepSeek V3.2's indexer keys,
    a layer of their own on vllm-ascend 0.30)."""
    return tuple(cache) if isinstance(cache, (tuple, list)) else (cache,)


def _latent_regions(name: str, tensors: tuple[torch.Tensor, ...], block_size: int) -> list[Region]:
    if len(tensors) == 1:
        names = [name]
    elif len(tensors) == 2:
        names = [f"{name}.nope", f"{name}.rope"]
    else:
        names = [f"{name}.{position}" for position in range(len(tensors))]
    regions = []
    for region_name, tensor in zip(names, tensors, strict=True):
        try:
            layout = describe_latent_tensor(
                tensor.shape, tensor.stride(), tensor.element_size(), block_size=block_size
            )
        except LayoutError as exc:
            raise LayoutError(f"{region_name}: {exc}") from exc
        regions.append(Region(region_name, tensor.data_ptr(), layout))
    return regions


def _kv_regions(
    name: str,
    tensors: tuple[torch.Tensor, ...],
    *,
    num_kv_heads: int,
    block_size: int,
    head_size: int,
    head_major: bool,
) -> list[Region]:
    if len(tensors) != 2:
        raise LayoutError(
            f"layer {name}: expected a (K, V) pair of cache tensors, got {len(tensors)} of shapes "
            f"{[tuple(t.shape) for t in tensors]}; a single tensor per layer is an MLA latent "
            f"cache, but the model config does not say MLA: check the model config"
        )
    k, v = tensors
    if k.shape[-1] != v.shape[-1]:
        raise LayoutError(
            f"layer {name}: its two cache tensors {tuple(k.shape)} and {tuple(v.shape)} differ in "
            f"width ({k.shape[-1]} vs {v.shape[-1]}), which K and V do not: this looks like an MLA "
            f"cache (nope, rope), but the model config does not say MLA: check the model config "
            f"(an MLA model served with MLA disabled, or a config that hides it)"
        )
    regions = []
    for suffix, tensor in zip(("k", "v"), tensors, strict=True):
        try:
            layout = describe_split_kv_tensor(
                tensor.shape,
                tensor.stride(),
                tensor.element_size(),
                num_kv_heads=num_kv_heads,
                block_size=block_size,
                head_size=head_size,
                head_major=head_major,
            )
        except LayoutError as exc:
            raise LayoutError(f"layer {name}.{suffix}: {exc}") from exc
        regions.append(Region(f"{name}.{suffix}", tensor.data_ptr(), layout))
    return regions


def kv_memory_ranges(tensors: Iterable[torch.Tensor]) -> list[MemoryRange]:
    """The memory to register for ``tensors``: the bytes each view spans, merged per storage.

    Registering a view's span rather than its whole storage is what vllm-ascend's allocations
    need: each cache is a 2 MiB-aligned view sliced out of a larger raw allocation
    (``_allocate_int8_cache_tensor``), so the storage starts unaligned and ends wherever the
    padding does. Spans of one storage that overlap or touch (vLLM's layers sharing one
    allocation, vllm-ascend's interleaved K and V views of one allocation) become one range, as
    vllm-ascend's own ``collect_storage_merged_register_regions`` does
    (``distributed/kv_transfer/utils/utils.py``); spans of different storages never merge, even
    when adjacent: a device registration must not cross two allocations."""
    spans: dict[int, list[MemoryRange]] = {}
    for tensor in tensors:
        span = view_span(tensor)
        if span is not None:
            spans.setdefault(tensor.untyped_storage().data_ptr(), []).append(span)
    return [merged for group in spans.values() for merged in merge_ranges(group)]


def view_span(tensor: torch.Tensor) -> MemoryRange | None:
    """The bytes a strided view can touch, from its first element to its last (None: empty)."""
    if tensor.numel() == 0:
        return None
    if any(stride < 0 for stride in tensor.stride()):
        raise LayoutError(f"a KV tensor with negative strides {tensor.stride()} is not supported")
    last = sum(
        (size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
    )
    return MemoryRange(tensor.data_ptr(), (last + 1) * tensor.element_size())
