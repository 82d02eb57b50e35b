"""What the engine allocated for each attention layer, read from the layer itself; and the models
whose layers the connector cannot move, refused at start-up by name.

Head count and head size come from each attention layer vLLM built (``Attention.num_kv_heads``,
the heads this rank holds, and ``.head_size``; an MLA layer's ``head_size`` is its whole latent),
never from the model's config: an architecture may compute its own (vLLM's Qwen2 attention uses
``hidden_size // num_attention_heads`` whatever the config's ``head_dim`` says). The config is
the fallback only for a layer that does not say, and is logged as such.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..core.layout import LayoutError
from ..core.topology import TransferTopology
from ..datapath.registration import LayerHeads
from ..log import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class LayerGeometry:
    """One attention layer's KV cache on this rank: KV heads held and elements per head."""

    num_kv_heads: int
    head_size: int


@dataclass(frozen=True)
class DraftLayers:
    """The draft (EAGLE/MTP) model's attention layers, by name, the KV heads each holds on this
    rank (a head group of their own when the draft's total differs from the model's) and their
    head size (the draft's own; None: the model's)."""

    names: frozenset[str]
    num_kv_heads: int
    head_size: int | None = None


@dataclass(frozen=True)
class AttentionGeometry:
    """Every layer's geometry: the model's layers' head size and the heads they hold on this
    rank, and the draft model's layers (None: there are none)."""

    num_kv_heads: int
    head_size: int
    draft: DraftLayers | None = None


def layer_geometry(layer: Any, default: LayerGeometry) -> LayerGeometry | None:
    """What ``layer`` allocated, or None when it does not say."""
    heads, size = getattr(layer, "num_kv_heads", None), getattr(layer, "head_size", None)
    if isinstance(heads, int) and isinstance(size, int) and heads > 0 and size > 0:
        return LayerGeometry(heads, size)
    return None


def draft_layer_names(
    names: Iterable[str], layers: Mapping[str, Any], target_layers: int
) -> set[str]:
    """The attention layers vLLM's speculative decoding added for its draft model: those it
    marks (``is_draft_layer``, set by its GPU model runner's speculators), those of a draft
    model loaded under the ``draft_model`` prefix (``v1/spec_decode/draft_model.py``), and
    those numbered past the target model's ``target_layers`` layers (EAGLE, EAGLE3 and MTP
    heads number theirs from the target's layer count: ``start_layer_id=target_layer_num``,
    ``mtp_start_layer_idx = config.num_hidden_layers``)."""
    return {name for name in names if _is_draft_layer(name, layers.get(name), target_layers)}


def _is_draft_layer(name: str, layer: Any, target_layers: int) -> bool:
    if getattr(layer, "is_draft_layer", False) is True or name.startswith(DRAFT_MODEL_PREFIX):
        return True
    index = layer_index(name)
    return index is not None and index >= target_layers


#: The prefix vLLM's draft-model proposer loads its model's layers under.
DRAFT_MODEL_PREFIX = "draft_model."


def layer_index(name: str) -> int | None:
    """The layer number in a layer's name (``model.layers.12.self_attn.attn``: 12), as vLLM's
    ``extract_layer_index`` reads it; None when the name holds none or several."""
    numbers = [int(part) for part in name.split(".") if part.isdigit()]
    return numbers[0] if len(numbers) == 1 else None


def attention_geometry(
    kv_caches: Mapping[str, Any],
    layers: Mapping[str, Any],
    *,
    default: LayerGeometry,
    is_mla: bool,
    draft_layers: Collection[str] = (),
) -> AttentionGeometry:
    """The head count and head size of the KV caches' layers, as their attention layers
    allocated them (``default``, the model config's, where a layer does not say). The model's
    layers must agree on the head count and head size, and so must the draft model's
    (``draft_layers``), a head group of their own, whose head size may differ from the model's.
    Layers that disagree are refused, naming them. An MLA latent has one head."""
    found: dict[tuple[bool, LayerGeometry], str] = {}
    unsaid = []
    for name in kv_caches:
        geometry = layer_geometry(layers.get(name), default)
        if geometry is None:
            unsaid.append(name)
            geometry = default
        if is_mla:
            geometry = LayerGeometry(1, geometry.head_size)
        found.setdefault((name in draft_layers, geometry), name)
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
    for is_draft in (False, True):
        for what, value in (("numbers of KV heads", _heads), ("head sizes", _size)):
            values = {value(g) for (d, g) in found if d == is_draft}
            if len(values) > 1:
                described = ", ".join(
                    f"{name}: {value(g)}" for (d, g), name in found.items() if d == is_draft
                )
                raise LayoutError(
                    f"the {'draft' if is_draft else 'model'}'s attention layers hold different "
                    f"{what} on this rank ({described}): one geometry per model is planned (a "
                    f"draft layer is one vLLM's speculative decoding added, numbered past the "
                    f"model's layers); serve P/D without speculative decoding"
                )
    by_kind = {d: (g, name) for (d, g), name in found.items()}
    geometry, name = by_kind[False] if False in by_kind else by_kind[True]
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
    draft = None
    if True in by_kind and not is_mla:
        draft_names = frozenset(n for n in kv_caches if n in draft_layers)
        draft_geometry = by_kind[True][0]
        own_size = (
            draft_geometry.head_size if draft_geometry.head_size != geometry.head_size else None
        )
        draft = DraftLayers(draft_names, draft_geometry.num_kv_heads, own_size)
    return AttentionGeometry(geometry.num_kv_heads, geometry.head_size, draft)


def _heads(geometry: LayerGeometry) -> int:
    return geometry.num_kv_heads


def _size(geometry: LayerGeometry) -> int:
    return geometry.head_size


def check_planned_heads(
    geometry: AttentionGeometry,
    topology: TransferTopology,
    is_prefill: bool,
    tp_size: int,
    draft_kv_heads: int = 0,
) -> None:
    """The heads the layers hold on this rank must be those the topology plans with (the
    config's total KV heads over this side's TP; for the draft model's layers the draft
    config's, ``draft_kv_heads``, 0: the model's): the total is the one value still taken from
    the config, since a rank holding one replicated head cannot tell how many there are in
    all."""
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
    draft = geometry.draft
    if draft is None:
        return
    group = topology.group(draft_kv_heads)
    planned = group.prefill_heads_per_rank if is_prefill else group.decode_heads_per_rank
    if draft.num_kv_heads != planned:
        raise LayoutError(
            f"draft layer {min(draft.names)} holds {draft.num_kv_heads} KV head(s) on this "
            f"rank, but the draft model's {group.heads} KV heads over TP {tp_size} give "
            f"{planned}: its config's num_key_value_heads does not describe its attention, "
            f"which this connector cannot plan; serve P/D without speculative decoding or with "
            f"a draft model whose config states its KV heads"
        )


def draft_layer_heads(
    geometry: AttentionGeometry, topology: TransferTopology, draft_kv_heads: int
) -> dict[str, LayerHeads]:
    """The draft layers whose geometry is not the model's, by name: a head group of their own
    (the draft's total KV heads differ from the model's) or a head size of their own; what
    their regions are described and planned with. Empty when there are none or they are
    shaped like the model's layers."""
    draft = geometry.draft
    if draft is None:
        return {}
    own_group = topology.group(draft_kv_heads) is not topology.head_groups[0]
    if not own_group and draft.head_size is None:
        return {}
    total = draft_kv_heads if own_group else topology.num_kv_heads
    heads = LayerHeads(draft.num_kv_heads, total, draft.head_size)
    return {name: heads for name in sorted(draft.names)}


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
