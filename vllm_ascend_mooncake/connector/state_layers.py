"""A worker's state layers (Gated DeltaNet: Qwen3-Next and its successors) as transfer groups.

With vLLM's hybrid KV cache manager a linear-attention layer's cache is one page per block
holding its conv state and its SSM state, each sharded across TP by Q/K/V columns and value
heads (:mod:`..core.state_layout`). vLLM CPU hands the layer over as an int8 page view
``[num_blocks, 1, 1, state_bytes]``; vllm-ascend as one tensor per component. Both are
described here, checked against the shapes the engine's ``MambaSpec`` reports.
"""

from __future__ import annotations

from typing import Any

from ..core.groups import GroupKind, GroupSpec
from ..core.layout import LayoutError
from ..core.state_layout import (
    ConvLayout,
    GdnSizes,
    GdnStateGeometry,
    StateGroup,
    StateLayout,
    describe_state_page,
    describe_state_tensors,
)
from .kv_groups import transfer_group_ids

#: The model config's Gated DeltaNet sizes, in :class:`GdnSizes` order.
_GDN_KEYS = (
    "linear_num_key_heads",
    "linear_key_head_dim",
    "linear_num_value_heads",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


def describe_state_groups(
    kv_caches: dict[str, Any],
    kv_cache_config: Any,
    groups: tuple[GroupSpec, ...],
    hf_config: Any,
    tp_size: int,
) -> list[StateGroup]:
    """The state groups among ``groups`` (the transfer groups), each layer's cache described."""
    if not any(group.kind is GroupKind.STATE for group in groups):
        return []
    geometry_of = {}
    described = []
    config_groups = kv_cache_config.kv_cache_groups
    for index, gid in enumerate(transfer_group_ids(kv_cache_config)):
        if groups[index].kind is not GroupKind.STATE:
            continue
        spec = config_groups[gid].kv_cache_spec
        names = tuple(n for n in config_groups[gid].layer_names if n in kv_caches)
        geometry = geometry_of.setdefault(index, gdn_geometry(hf_config, spec, names))
        components = geometry.components(tp_size, spec.shapes)
        layouts: set[StateLayout] = set()
        bases = []
        for name in names:
            cache = kv_caches[name]
            if isinstance(cache, (list, tuple)):
                layouts.add(
                    describe_state_tensors(
                        [tuple(t.shape) for t in cache],
                        [tuple(t.stride()) for t in cache],
                        [t.element_size() for t in cache],
                        components,
                        tp_size=tp_size,
                    )
                )
                bases.append(tuple(t.data_ptr() for t in cache))
            else:
                strides = [s * cache.element_size() for s in cache.stride()]
                layouts.add(
                    describe_state_page(tuple(cache.shape), strides, components, tp_size=tp_size)
                )
                bases.append((cache.data_ptr(),) * len(components))
        if len(layouts) != 1:
            raise LayoutError(
                f"the state layers {', '.join(names[:3])} of one KV cache group are laid out "
                f"differently ({len(layouts)} layouts): they cannot share one plan"
            )
        described.append(StateGroup(index, geometry, layouts.pop(), names, tuple(bases)))
    return described


def gdn_geometry(hf_config: Any, spec: Any, names: tuple[str, ...]) -> GdnStateGeometry:
    """The Gated DeltaNet geometry of a state group, from the model config; a state of another
    kind (Mamba, Mamba2, short convolutions) is refused naming a layer."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    values = [getattr(text, key, None) for key in _GDN_KEYS]
    if any(not isinstance(v, int) for v in values) or getattr(spec, "tp_replicated", False):
        raise LayoutError(
            f"the state layers {', '.join(names[:3])} are not Gated DeltaNet layers (the model "
            f"config has no {'/'.join(_GDN_KEYS[:3])}...): this KV connector moves the states of "
            f"Gated DeltaNet models (Qwen3-Next) only; serve this model without P/D"
        )
    return GdnStateGeometry(
        GdnSizes(*values), conv_layout(), tuple(_itemsize(d) for d in spec.dtypes[:2])
    )


def conv_layout() -> ConvLayout:
    """vLLM's conv state layout (``VLLM_SSM_CONV_STATE_LAYOUT``); ``SD`` where vLLM has no such
    setting."""
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    except ImportError:
        return ConvLayout.SD
    return ConvLayout.DS if is_conv_state_dim_first() else ConvLayout.SD


def _itemsize(dtype: Any) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()
