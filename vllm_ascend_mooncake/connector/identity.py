"""What a worker's KV bytes mean: the :class:`~..datapath.wire.ModelIdentity` it advertises to
peers.

Two instances can exchange KV only if the bytes mean the same on both: the same model
configuration (not the same served name or path), dtype, KV-cache dtype, block geometry, attention
backend and the way that backend packs a block (vLLM's CPU backend lays blocks out per ISA kernel:
AMX or not), and the same vLLM version. :mod:`..datapath.compat` refuses a peer that differs in
any of them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

from ..datapath.wire import ModelIdentity

#: Configuration keys that name where or with what a model was saved, not what it computes.
_NOT_MEANING = frozenset({"_name_or_path", "transformers_version", "_commit_hash"})


def model_config_digest(config: Mapping[str, Any]) -> str:
    """A short digest of a model configuration (``PretrainedConfig.to_dict()``), blind to where
    the model lives: one model under two paths or names digests alike."""
    meaning = {key: value for key, value in config.items() if key not in _NOT_MEANING}
    text = json.dumps(meaning, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def attention_backend_label(layers: Iterable[Any]) -> str:
    """The attention backends of these layers, each with its block packing where it has one
    (vLLM CPU: ``CPU_ATTN/amx``), comma-separated; empty when no layer says."""
    labels = set()
    for layer in layers:
        backend = getattr(layer, "attn_backend", None)
        if backend is None:
            continue
        label = backend.get_name()
        packing = getattr(layer, "isa", None)  # set by vLLM's CPU metadata builder
        if packing:
            label = f"{label}/{packing}"
        labels.add(label)
    return ",".join(sorted(labels))


def model_identity(
    vllm_config: Any,
    layer_names: Iterable[str],
    *,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    is_mla: bool,
    kv_cache_groups: Iterable[str] = (),
) -> ModelIdentity:
    """The identity of a worker whose KV cache holds ``layer_names``.

    ``head_size`` is what the attention layers allocated
    (:func:`.attention_layers.attention_geometry`), not the config's nor any one region's width:
    for MLA it is ``kv_lora_rank + qk_rope_head_dim``, the whole per-token latent, which vLLM
    keeps in one region per layer and vllm-ascend splits into a nope and a rope region (their
    widths add up to it). Each region's own width travels in its
    :class:`~..datapath.wire.RegionInfo`, and :mod:`..datapath.compat` pairs regions one by one,
    so a nope region is only ever combined with a nope region of the same width. ``num_layers``
    counts layers, not regions.
    """
    import vllm

    model = vllm_config.model_config
    context = vllm_config.compilation_config.static_forward_context
    names = list(layer_names)
    served = model.served_model_name
    return ModelIdentity(
        model=served if isinstance(served, str) else str(model.model),
        dtype=str(model.dtype),
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        block_size=block_size,
        head_size=head_size,
        num_kv_heads=num_kv_heads,
        num_layers=len(names),
        is_mla=is_mla,
        attention_backend=attention_backend_label(
            context[name] for name in names if name in context
        ),
        model_config=model_config_digest(model.hf_config.to_dict()),
        vllm_version=str(vllm.__version__),
        kv_cache_groups=list(kv_cache_groups),
    )
