"""Head count and head size come from the attention layers the engine built, not the config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_ascend_mooncake.connector.attention_layers import (
    AttentionGeometry,
    LayerGeometry,
    attention_geometry,
    check_planned_heads,
)
from vllm_ascend_mooncake.core.layout import LayoutError
from vllm_ascend_mooncake.core.topology import TransferTopology

CONFIG = LayerGeometry(num_kv_heads=2, head_size=64)  # what the model's config says


def layers(**heads_and_sizes: tuple[int, int]) -> dict[str, SimpleNamespace]:
    return {
        name: SimpleNamespace(num_kv_heads=heads, head_size=size)
        for name, (heads, size) in heads_and_sizes.items()
    }


def test_the_layers_head_size_wins_over_the_configs() -> None:
    """vLLM's Qwen2 attention computes ``hidden_size // num_attention_heads`` (32 here) whatever
    the config's ``head_dim`` (64) says: the cache holds 32-element heads."""
    found = layers(a=(2, 32), b=(2, 32))
    assert attention_geometry(found, found, default=CONFIG, is_mla=False) == AttentionGeometry(
        2, 32
    )


def test_a_layer_that_does_not_say_takes_the_config() -> None:
    caches = {"a": None, "b": None}
    assert attention_geometry(caches, {}, default=CONFIG, is_mla=False) == AttentionGeometry(2, 64)


def test_mla_has_one_latent_head_of_the_layers_width() -> None:
    found = layers(a=(16, 576))
    assert attention_geometry(found, found, default=CONFIG, is_mla=True) == AttentionGeometry(
        1, 576
    )


def test_a_draft_layer_with_its_own_kv_head_count_is_refused_naming_it() -> None:
    found = layers(**{"model.layers.0.attn": (2, 64), "model.layers.1.mtp.attn": (1, 64)})
    with pytest.raises(LayoutError, match=r"model\.layers\.1\.mtp\.attn: 1.*draft layer"):
        attention_geometry(found, found, default=CONFIG, is_mla=False)


def test_the_layers_heads_must_be_those_the_topology_plans_with() -> None:
    topology = TransferTopology(num_kv_heads=4, prefill_tp=2, decode_tp=1)
    check_planned_heads(AttentionGeometry(2, 64), topology, is_prefill=True, tp_size=2)
    check_planned_heads(AttentionGeometry(4, 64), topology, is_prefill=False, tp_size=1)
    with pytest.raises(LayoutError, match=r"hold 1 KV head.*4 KV heads over TP 2 give 2"):
        check_planned_heads(AttentionGeometry(1, 64), topology, is_prefill=True, tp_size=2)
