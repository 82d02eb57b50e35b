"""What the engine allocated for each attention layer, read from the layer itself; and the models
whose layers the connector cannot move, refused at start-up by name.

Head count and head size come from each attention layer vLLM built (``Attention.num_kv_heads``,
the heads this rank holds, and ``.head_size``; an MLA layer's ``head_size`` is its whole latent),
never from the model's config: an architecture may compute its own (vLLM's Qwen2 attention uses
``hidden_size // num_attention_heads`` whatever the config's ``head_dim`` says). The config is
the fallback only for a layer that does not say, and is logged as such.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.layout import LayoutError
from ..core.topology import TransferTopology
from ..log import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class LayerGeometry:
    """One attention layer's KV cache on this rank: KV heads held and elements per head."""

    num_kv_heads: int
    head_size: int


@dataclass(frozen=True)
class AttentionGeometry:
    """Every layer's geometry, which must agree: one transfer topology plans them all."""

    num_kv_heads: int
    head_size: int


def layer_geometry(layer: Any, default: LayerGeometry) -> LayerGeometry | None:
    """What ``layer`` allocated, or None when it does not say."""
    heads, size = getattr(layer, "num_kv_heads", None), getattr(layer, "head_size", None)
    if isinstance(heads, int) and isinstance(size, int) and heads > 0 and size > 0:
        return LayerGeometry(heads, size)
    return None


def attention_geometry(
    kv_caches: Mapping[str, Any],
    layers: Mapping[str, Any],
    *,
    default: LayerGeometry,
    is_mla: bool,
) -> AttentionGeometry:
    """The head count and head size of the KV caches' layers, as their attention layers
    allocated them (``default``, the model config's, where a layer does not say). Layers that
    disagree on the head count are refused, naming one: a draft (MTP/EAGLE) layer with a
    KV-head count of its own would be planned with the wrong heads. An MLA latent has one head."""
    found: dict[LayerGeometry, str] = {}
    unsaid = []
    for name in kv_caches:
        geometry = layer_geometry(layers.get(name), default)
        if geometry is None:
            unsaid.append(name)
            geometry = default
        if is_mla:
            geometry = LayerGeometry(1, geometry.head_size)
        found.setdefault(geometry, name)
    if unsaid:
        logger.debug(
            "%d KV cache layer(s) (%s ...) have no attention layer that says its heads: the model "
            "config's %s is assumed",
            len(unsaid),
            unsaid[0],
            default,
        )
    if not found:
        return AttentionGeometry(default.num_kv_heads, default.head_size)
    heads = {g.num_kv_heads for g in found}
    if len(heads) > 1:
        described = ", ".join(f"{name}: {g.num_kv_heads}" for g, name in found.items())
        raise LayoutError(
            f"the model's attention layers hold different numbers of KV heads on this rank "
            f"({described}): a layer with a KV-head count of its own (an MTP or EAGLE draft "
            f"layer) is not supported yet; serve P/D without speculative decoding"
        )
    sizes = {g.head_size for g in found}
    if len(sizes) > 1:
        described = ", ".join(f"{name}: {g.head_size}" for g, name in found.items())
        raise LayoutError(
            f"the model's attention layers differ in head size ({described}): one transfer "
            f"plan cannot describe them all yet"
        )
    ((geometry, name),) = list(found.items())[:1]
    if geometry != default and not is_mla:
        logger.info(
            "attention layer %s holds %d KV head(s) of size %d on this rank, where the model "
            "config says %d of size %d: the layers' values are used",
            name,
            geometry.num_kv_heads,
            geometry.head_size,
            default.num_kv_heads,
            default.head_size,
        )
    return AttentionGeometry(geometry.num_kv_heads, geometry.head_size)


def check_planned_heads(
    geometry: AttentionGeometry, topology: TransferTopology, is_prefill: bool, tp_size: int
) -> None:
    """The heads the layers hold on this rank must be those the topology plans with (the config's
    total KV heads over this side's TP): the total is the one value still taken from the config,
    since a rank holding one replicated head cannot tell how many there are in all."""
    if topology.is_mla:
        return
    planned = topology.prefill_heads_per_rank if is_prefill else topology.decode_heads_per_rank
    if geometry.num_kv_heads != planned:
        raise LayoutError(
            f"the attention layers hold {geometry.num_kv_heads} KV head(s) on this rank, but "
            f"{topology.heads} KV heads over TP {tp_size} give {planned}: the model config's "
            f"num_key_value_heads does not describe this model's attention, which this connector "
            f"cannot plan"
        )


def refuse_unsupported_parallelism(parallel_config: Any) -> None:
    """Refuse decode or prefill context parallelism (DCP/PCP): their ranks hold a share of each
    block's tokens, which the transfer topology does not plan (it would be mis-planned, not
    merely slow)."""
    for attribute, name in (
        ("decode_context_parallel_size", "decode context parallelism (DCP)"),
        ("prefill_context_parallel_size", "prefill context parallelism (PCP)"),
    ):
        size = getattr(parallel_config, attribute, 1) or 1
        if size > 1:
            raise LayoutError(
                f"{name} of size {size} is not supported by this KV connector: its ranks hold "
                f"interleaved shares of each block's tokens, which the transfer plan does not "
                f"describe; serve P/D with --{attribute.replace('_', '-')} 1"
            )


def refuse_hybrid_layers(kv_caches: dict[str, Any], layers: dict[str, Any]) -> None:
    """Refuse a model with Mamba or linear-attention (state) layers, naming one: their caches are
    states, not blocks of tokens, and vLLM turns its hybrid KV cache manager off for this
    connector, so they cannot be held and pulled as a prompt's blocks."""
    for name, cache in kv_caches.items():
        layer = layers.get(name)
        kinds = {cls.__name__ for cls in type(layer).__mro__} if layer is not None else set()
        if "MambaBase" in kinds or (isinstance(cache, list) and "AttentionLayerBase" not in kinds):
            what = type(layer).__name__ if layer is not None else "a list of state tensors"
            raise LayoutError(
                f"layer {name} ({what}) is a Mamba / linear-attention state layer: hybrid models "
                f"(Qwen3-Next, Jamba, Bamba, Gated DeltaNet) are not served by this KV connector "
                f"yet; serve the model without P/D, or with a connector that implements SupportsHMA"
            )
