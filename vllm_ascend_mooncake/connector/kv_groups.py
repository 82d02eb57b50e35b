"""The engine's KV cache groups as the transfer sees them (vLLM's ``KVCacheConfig``).

With vLLM's hybrid KV cache manager on (the connector implements ``SupportsHMA``), a model whose
layers differ in kind gets one KV cache group per kind, each with block ids of its own: a
sliding-window group beside a full-attention one (Gemma 2/3, gpt-oss, Ministral). A model of one
kind keeps one group, as before. Each transfer group is described by a
:class:`~..core.groups.GroupSpec`, on prefill and decode alike, and each layer belongs to one.

A Gated DeltaNet state group (Qwen3-Next) in vLLM's ``align`` cache mode is a state group
(:mod:`.state_layers` describes its pages). Kinds the transfer cannot move are refused here, at
start-up, naming the kind and a layer: states in other cache modes or with speculative blocks,
chunked local attention, cross-attention.
"""

from __future__ import annotations

from typing import Any

from ..core.groups import GroupKind, GroupSpec
from ..core.layout import LayoutError


def transfer_group_ids(kv_cache_config: Any) -> tuple[int, ...]:
    """The groups a request's KV moves in, and a pull restores: every group that takes part in
    transfers (vLLM 0.30+'s ``KVCacheConfig.transfer_group_ids``; not only the prefix-cacheable
    ones ``get_loaded_kv_cache_group_ids`` defaults to), else every group; without a config
    (vLLM < 0.30), the one group."""
    if kv_cache_config is None:
        return (0,)
    ids = getattr(kv_cache_config, "transfer_group_ids", None)
    if ids is not None:
        return tuple(ids)
    return tuple(range(len(kv_cache_config.kv_cache_groups)))


def transfer_group_specs(kv_cache_config: Any, block_size: int) -> tuple[GroupSpec, ...]:
    """One :class:`GroupSpec` per transfer group, in :func:`transfer_group_ids` order; no
    config (vLLM < 0.30 builds connectors without one): one full-attention group of
    ``block_size``. Refuses the kinds the transfer cannot move."""
    if kv_cache_config is None:
        return (GroupSpec(GroupKind.FULL, block_size),)
    groups = kv_cache_config.kv_cache_groups
    return tuple(
        _group_spec(groups[g].kv_cache_spec, groups[g].layer_names, block_size)
        for g in transfer_group_ids(kv_cache_config)
    )


def group_of_layer(kv_cache_config: Any) -> dict[str, int]:
    """Each transferred layer's index among the transfer groups (:func:`transfer_group_ids`)."""
    if kv_cache_config is None:
        return {}
    groups = kv_cache_config.kv_cache_groups
    return {
        name: index
        for index, g in enumerate(transfer_group_ids(kv_cache_config))
        for name in groups[g].layer_names
    }


def region_groups(region_names: list[str], layer_groups: dict[str, int]) -> tuple[int, ...]:
    """Each region's group: its layer's (a region is named after its layer, or the layer and a
    part, ``<layer>.k``); -1 for a layer no transfer group holds, which is never moved."""

    def group(name: str) -> int:
        if name in layer_groups:
            return layer_groups[name]
        return layer_groups.get(name.rpartition(".")[0], -1)

    return tuple(group(name) for name in region_names)


def _group_spec(spec: Any, layer_names: list[str], block_size: int) -> GroupSpec:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: one kind of layers
    first = next(iter(inner.values())) if inner else spec
    size = getattr(spec, "block_size", None) or block_size
    kind = type(first).__name__
    if kind in ("SlidingWindowSpec", "SlidingWindowMLASpec") or isinstance(
        first, SlidingWindowSpec
    ):
        window = first.sliding_window + getattr(first, "extra_retained_tokens", 0)
        if getattr(first, "prefix_replay_tokens", 0):
            _refuse(kind, layer_names, "a bounded prefix replay (DeepSeek-V4 style)")
        return GroupSpec(GroupKind.SLIDING, size, window)
    if isinstance(first, FullAttentionSpec) and kind not in _UNSUPPORTED:
        return GroupSpec(GroupKind.FULL, size)
    if kind == "MambaSpec":
        if getattr(first, "mamba_cache_mode", "none") != "align":
            _refuse(
                kind,
                layer_names,
                f"a Mamba / linear-attention state in cache mode "
                f"{getattr(first, 'mamba_cache_mode', 'none')!r}; the connector moves states "
                f"in 'align' mode, which vLLM picks with prefix caching on: drop "
                f"--no-enable-prefix-caching (or set --mamba-cache-mode align)",
            )
        if getattr(first, "num_speculative_blocks", 0):
            _refuse(kind, layer_names, "a state with speculative-decoding blocks")
        return GroupSpec(GroupKind.STATE, size)
    _refuse(kind, layer_names, _UNSUPPORTED.get(kind, "a KV cache kind it does not know"))
    raise AssertionError("unreachable")


#: KV cache kinds the transfer cannot move, and why, by vLLM's spec class name.
_UNSUPPORTED = {
    "ChunkedLocalAttentionSpec": "chunked local attention (Llama 4)",
    "CrossAttentionSpec": "cross-attention (encoder-decoder models)",
    "EncoderOnlyAttentionSpec": "encoder-only attention",
    "CircularBufferSpec": "a circular-buffer KV cache",
    "RSWASpec": "a ring sliding window",
    "SinkFullAttentionSpec": "attention sinks held apart from the blocks",
    "HiSparseHotSpec": "a HiSparse hot cache",
    "HiSparseResidentSpec": "a HiSparse resident cache",
}


def _refuse(kind: str, layer_names: list[str], what: str) -> None:
    layers = ", ".join(layer_names[:3]) + (" ..." if len(layer_names) > 3 else "")
    raise LayoutError(
        f"the model's KV cache group of layers {layers} is {kind} ({what}): this KV connector "
        f"moves full-attention, MLA, sliding-window and Gated DeltaNet state groups only; "
        f"serve this model without P/D disaggregation"
    )
