"""The hybrid tiny models (issue #45) build offline into checkpoints transformers loads, with the
layer kinds and weight names the architectures expect; no engine is started (the colocated check
is ``python -m vllm_ascend_mooncake.launch.tiny_hybrid_model``, recorded in docs/design/hma.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_ascend_mooncake.launch.tiny_hybrid_model import (
    FULL,
    LINEAR,
    SLIDING,
    TinyQwen3NextModelSpec,
    TinySlidingWindowModelSpec,
    check_gdn_tp_split,
)
from vllm_ascend_mooncake.launch.tiny_model import (
    MANIFEST_FILE,
    TinyModelSpec,
    TinySpecBase,
    build_tiny_model,
)

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")


def hf_tensor_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """The tensors transformers' own model class has for the config in ``directory`` (built on
    the meta device: no memory, no weights read)."""
    config = transformers.AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def written_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    tensors = safetensors_torch.load_file(str(directory / "model.safetensors"))
    return {name: tuple(tensor.shape) for name, tensor in tensors.items()}


def build(spec: TinySpecBase, tmp_path: Path) -> Path:
    directory = build_tiny_model(spec, cache_root=tmp_path)
    assert (directory / MANIFEST_FILE).is_file()
    return directory


def test_qwen3_next_config_loads_with_interleaved_gdn_and_full_attention(tmp_path: Path) -> None:
    spec = TinyQwen3NextModelSpec()
    directory = build(spec, tmp_path)
    config = transformers.AutoConfig.from_pretrained(directory)
    assert type(config).__name__ == "Qwen3NextConfig"
    assert config.layer_types == [LINEAR, FULL, LINEAR, FULL]
    assert (config.num_key_value_heads, config.head_dim) == (2, 64)
    assert (config.linear_num_key_heads, config.linear_num_value_heads) == (2, 4)
    assert config.num_experts == 4 and config.mlp_only_layers == []
    assert json.loads((directory / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_qwen3_next_weights_are_the_ones_transformers_expects(tmp_path: Path) -> None:
    """Every tensor transformers builds, by name and shape; transformers 5 fuses the routed
    experts into 3-D tensors where the released checkpoints (and vLLM's loader) have one tensor
    per expert, so those are compared by their total size."""
    directory = build(TinyQwen3NextModelSpec(), tmp_path)
    ours, theirs = written_shapes(directory), hf_tensor_shapes(directory)

    def experts(shapes: dict[str, tuple[int, ...]]) -> int:
        return sum(
            torch.Size(shape).numel() for name, shape in shapes.items() if ".mlp.experts." in name
        )

    assert experts(ours) == experts(theirs) > 0
    plain = {name: shape for name, shape in theirs.items() if ".mlp.experts." not in name}
    assert {name: shape for name, shape in ours.items() if ".mlp.experts." not in name} == plain
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in ours


def test_sliding_window_llama_config_alternates_sliding_and_full(tmp_path: Path) -> None:
    spec = TinySlidingWindowModelSpec()
    directory = build(spec, tmp_path)
    config = transformers.AutoConfig.from_pretrained(directory)
    assert type(config).__name__ == "LlamaConfig"
    assert config.layer_types == [SLIDING, FULL, SLIDING, FULL]
    assert config.sliding_window == 64
    assert written_shapes(directory) == hf_tensor_shapes(directory)


def test_sliding_window_model_does_not_share_the_llama_cache_entry() -> None:
    """Same Llama fields, different model: the window is part of the cache key."""
    window = TinySlidingWindowModelSpec()
    assert window.fingerprint() != TinyModelSpec(num_layers=4, dtype="bfloat16").fingerprint()
    assert window.fingerprint() != TinySlidingWindowModelSpec(sliding_window=32).fingerprint()
    assert window.directory_name().startswith("sw64-llama-l4-")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_layers": 1}, "both layer kinds"),
        ({"full_attention_interval": 5}, "both layer kinds"),
        ({"num_experts": 1}, "num_experts_per_tok"),
        ({"linear_num_value_heads": 3}, "multiple of linear_num_key_heads"),
    ],
)
def test_qwen3_next_spec_refuses_what_vllm_cannot_serve(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TinyQwen3NextModelSpec(**kwargs)


def test_gdn_split_check_accepts_vllms_shards_and_rejects_a_plain_split(tmp_path: Path) -> None:
    """The colocated run's TP check (``check_gdn_tp_split``), fed rank weights cut by hand: the
    per-sub-projection split vLLM uses passes, one contiguous split of the conv rows fails."""
    spec = TinyQwen3NextModelSpec()
    directory = build(spec, tmp_path)
    weights = safetensors_torch.load_file(str(directory / "model.safetensors"))
    layer = "model.layers.0.linear_attn"
    conv = weights[f"{layer}.conv1d.weight"].float().reshape(-1, spec.linear_conv_kernel_dim)
    a_log = weights[f"{layer}.A_log"].float()
    key_dim = spec.linear_num_key_heads * spec.linear_key_head_dim
    q, k, v = conv[:key_dim], conv[key_dim : 2 * key_dim], conv[2 * key_dim :]

    def rank(conv_rows: torch.Tensor, heads: torch.Tensor) -> dict:
        return {
            "layer": layer,
            "conv_weight": conv_rows.reshape(-1).tolist(),
            "a_log": heads.tolist(),
        }

    def halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return t[: len(t) // 2], t[len(t) // 2 :]

    (q0, q1), (k0, k1), (v0, v1), (a0, a1) = halves(q), halves(k), halves(v), halves(a_log)
    vllm_split = [rank(torch.cat([q0, k0, v0]), a0), rank(torch.cat([q1, k1, v1]), a1)]
    plain = [rank(conv[: len(conv) // 2], a0), rank(conv[len(conv) // 2 :], a1)]
    assert check_gdn_tp_split(spec, str(directory), vllm_split)
    assert check_gdn_tp_split(spec, str(directory), [rank(conv, a_log)])
    assert not check_gdn_tp_split(spec, str(directory), plain)
