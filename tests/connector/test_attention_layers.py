"""Head count and head size come from the attention layers the engine built, not the config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_ascend_mooncake.connector.attention_layers import (
    AttentionGeometry,
    DraftLayers,
    LayerGeometry,
    attention_geometry,
    check_planned_heads,
    draft_layer_heads,
    draft_layer_names,
)
from vllm_ascend_mooncake.core.layout import LayoutError
from vllm_ascend_mooncake.core.topology import TransferTopology
from vllm_ascend_mooncake.datapath.registration import LayerHeads

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


def test_a_model_layer_with_a_kv_head_count_of_its_own_is_refused_naming_it() -> None:
    """A layer that is not a draft model's holds the model's heads: one that does not is refused
    (it would be planned with the wrong heads), naming it."""
    found = layers(**{"model.layers.0.attn": (2, 64), "model.layers.1.mtp.attn": (1, 64)})
    with pytest.raises(LayoutError, match=r"model\.layers\.1\.mtp\.attn: 1.*draft layer"):
        attention_geometry(found, found, default=CONFIG, is_mla=False)


def test_draft_layers_are_those_vllm_adds_for_its_draft_model() -> None:
    """Marked by vLLM's speculators, under the draft model's prefix, or numbered past the
    target's layers (EAGLE, EAGLE3 and MTP heads)."""
    marked = SimpleNamespace(is_draft_layer=True)
    names = [
        "model.layers.0.self_attn.attn",
        "model.layers.1.self_attn.attn",
        "model.layers.2.self_attn.attn",  # EAGLE's first layer after a 2-layer target
        "draft_model.model.layers.0.self_attn.attn",
        "spec.attn",
    ]
    assert draft_layer_names(names, {"spec.attn": marked}, target_layers=2) == {
        "model.layers.2.self_attn.attn",
        "draft_model.model.layers.0.self_attn.attn",
        "spec.attn",
    }


def test_draft_layers_with_their_own_head_count_are_a_group_of_their_own() -> None:
    found = layers(**{"model.layers.0.attn": (2, 64), "model.layers.1.attn": (1, 64)})
    geometry = attention_geometry(
        found, found, default=CONFIG, is_mla=False, draft_layers={"model.layers.1.attn"}
    )
    assert geometry == AttentionGeometry(2, 64, DraftLayers(frozenset({"model.layers.1.attn"}), 1))
    topology = TransferTopology(num_kv_heads=4, prefill_tp=2, decode_tp=2, extra_kv_heads=(2,))
    check_planned_heads(geometry, topology, is_prefill=True, tp_size=2, draft_kv_heads=2)
    assert draft_layer_heads(geometry, topology, draft_kv_heads=2) == {
        "model.layers.1.attn": LayerHeads(num_kv_heads=1, group_kv_heads=2)
    }
    # a draft of the model's head count shares its group: nothing of its own to describe
    same = AttentionGeometry(2, 64, DraftLayers(frozenset({"model.layers.1.attn"}), 2))
    plain = TransferTopology(num_kv_heads=4, prefill_tp=2, decode_tp=2, extra_kv_heads=(4,))
    check_planned_heads(same, plain, is_prefill=True, tp_size=2, draft_kv_heads=4)
    assert draft_layer_heads(same, plain, draft_kv_heads=4) == {}


def test_draft_layers_with_their_own_head_size_are_described_with_it() -> None:
    """An EAGLE draft of head size 128 beside a model of 64: of its own head group (1 of 2 KV
    heads) or of the model's (2 of 4), its layers are described with their own head size."""
    found = layers(**{"model.layers.0.attn": (2, 64), "model.layers.1.attn": (1, 128)})
    geometry = attention_geometry(
        found, found, default=CONFIG, is_mla=False, draft_layers={"model.layers.1.attn"}
    )
    assert geometry == AttentionGeometry(
        2, 64, DraftLayers(frozenset({"model.layers.1.attn"}), 1, head_size=128)
    )
    topology = TransferTopology(num_kv_heads=4, prefill_tp=2, decode_tp=2, extra_kv_heads=(2,))
    assert draft_layer_heads(geometry, topology, draft_kv_heads=2) == {
        "model.layers.1.attn": LayerHeads(num_kv_heads=1, group_kv_heads=2, head_size=128)
    }
    found = layers(**{"model.layers.0.attn": (2, 64), "model.layers.1.attn": (2, 128)})
    same_heads = attention_geometry(
        found, found, default=CONFIG, is_mla=False, draft_layers={"model.layers.1.attn"}
    )
    plain = TransferTopology(num_kv_heads=4, prefill_tp=2, decode_tp=2, extra_kv_heads=(4,))
    assert draft_layer_heads(same_heads, plain, draft_kv_heads=4) == {
        "model.layers.1.attn": LayerHeads(num_kv_heads=2, group_kv_heads=4, head_size=128)
    }


def test_model_layers_of_different_head_sizes_are_refused_naming_them() -> None:
    found = layers(a=(2, 64), b=(2, 128))
    with pytest.raises(
        LayoutError, match=r"the model's attention layers.*head sizes.*a: 64, b: 128"
    ):
        attention_geometry(found, found, default=CONFIG, is_mla=False)


def test_a_draft_layer_contradicting_its_groups_total_is_refused_naming_it() -> None:
    """The draft config's 2 KV heads over TP 1 give 2 per rank; a draft layer holding 1
    (a config that does not describe the draft's attention) is refused, naming it."""
    found = layers(**{"model.layers.0.attn": (4, 64), "model.layers.1.attn": (1, 64)})
    geometry = attention_geometry(
        found, found, default=CONFIG, is_mla=False, draft_layers={"model.layers.1.attn"}
    )
    topology = TransferTopology(num_kv_heads=4, prefill_tp=1, decode_tp=1, extra_kv_heads=(2,))
    with pytest.raises(LayoutError, match=r"draft layer model\.layers\.1\.attn holds 1.*give 2"):
        check_planned_heads(geometry, topology, is_prefill=False, tp_size=1, draft_kv_heads=2)


def test_draft_layers_that_disagree_among_themselves_are_refused() -> None:
    found = layers(a=(4, 64), b=(1, 64), c=(2, 64))
    with pytest.raises(LayoutError, match=r"the draft's attention layers.*b: 1, c: 2"):
        attention_geometry(found, found, default=CONFIG, is_mla=False, draft_layers={"b", "c"})


def test_mla_draft_layers_are_one_latent_like_the_models() -> None:
    found = layers(a=(16, 576), b=(16, 576))
    geometry = attention_geometry(found, found, default=CONFIG, is_mla=True, draft_layers={"b"})
    assert geometry == AttentionGeometry(1, 576)


def test_the_layers_heads_must_be_those_the_topology_plans_with() -> None:
    topology = TransferTopology(num_kv_heads=4, prefill_tp=2, decode_tp=1)
    check_planned_heads(AttentionGeometry(2, 64), topology, is_prefill=True, tp_size=2)
    check_planned_heads(AttentionGeometry(4, 64), topology, is_prefill=False, tp_size=1)
    with pytest.raises(LayoutError, match=r"hold 1 KV head.*4 KV heads over TP 2 give 2"):
        check_planned_heads(AttentionGeometry(1, 64), topology, is_prefill=True, tp_size=2)
