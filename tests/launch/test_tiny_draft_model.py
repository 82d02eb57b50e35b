"""The tiny EAGLE draft's checkpoint: what vLLM's ``EagleLlamaForCausalLM`` loads (served for
real in tests/e2e/test_draft_layers.py), shaped by its spec and its target."""

from __future__ import annotations

import json

import pytest

from vllm_ascend_mooncake.launch.tiny_draft_model import TinyEagleDraftSpec
from vllm_ascend_mooncake.launch.tiny_model import TinyModelSpec, build_tiny_model

TARGET = TinyModelSpec(num_layers=2, num_attention_heads=8, num_kv_heads=4, head_dim=32)


def test_a_draft_takes_its_targets_sizes_and_its_own_attention(tmp_path) -> None:
    spec = TinyEagleDraftSpec.for_target(TARGET, num_kv_heads=1, head_dim=64, seed=3)
    assert (spec.hidden, spec.vocab_size, spec.dtype) == (256, TARGET.vocab_size, "float32")
    path = build_tiny_model(spec, cache_root=tmp_path)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["EagleLlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (1, 1)
    assert (config["head_dim"], config["hidden_size"]) == (64, 256)
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as weights:
        names = weights.keys()  # a safetensors file, not a dict
        shapes = {name: tuple(weights.get_slice(name).get_shape()) for name in names}
    assert shapes["fc.weight"] == (256, 512)
    assert shapes["layers.0.self_attn.k_proj.weight"] == (64, 256)
    # EAGLE drops layer 0's input norm and shares the target's embedding and LM head
    assert not any("input_layernorm" in n or "embed" in n or "lm_head" in n for n in shapes)


def test_an_impossible_draft_is_refused() -> None:
    with pytest.raises(ValueError, match="hidden_size is its target's"):
        TinyEagleDraftSpec(hidden_size=None)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        TinyEagleDraftSpec(hidden_size=256, num_attention_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="multiple of num_attention_heads"):
        TinyEagleDraftSpec(hidden_size=256, num_attention_heads=6, num_kv_heads=6)
    with pytest.raises(ValueError, match="needs a Llama target"):
        TinyEagleDraftSpec.for_target(TinyModelSpec(architecture="qwen2", head_dim=32))
