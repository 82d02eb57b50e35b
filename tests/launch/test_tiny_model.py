"""The tiny-model factory builds loadable, deterministic, correctly shaped models offline."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from vllm_ascend_mooncake.deps import MissingDependencyError
from vllm_ascend_mooncake.launch import tiny_model
from vllm_ascend_mooncake.launch.tiny_mla_model import TinyMLAModelSpec
from vllm_ascend_mooncake.launch.tiny_model import (
    ARCHITECTURES,
    MANIFEST_FILE,
    TinyModelSpec,
    build_tiny_model,
)
from vllm_ascend_mooncake.launch.tiny_tokenizer import BOS_TOKEN, EOS_TOKEN

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
    MANIFEST_FILE,
)


def read_files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_same_spec_builds_byte_identical_files_in_separate_caches(tmp_path: Path) -> None:
    first = build_tiny_model(TinyModelSpec(), cache_root=tmp_path / "a")
    second = build_tiny_model(TinyModelSpec(), cache_root=tmp_path / "b")
    assert first.name == second.name
    assert sorted(path.name for path in first.iterdir()) == sorted(MODEL_FILES)
    assert read_files(first) == read_files(second)


def test_cached_model_is_reused_without_rebuilding(tmp_path: Path) -> None:
    first = build_tiny_model(TinyModelSpec(), cache_root=tmp_path)
    weights_mtime = (first / "model.safetensors").stat().st_mtime_ns
    second = build_tiny_model(TinyModelSpec(), cache_root=tmp_path)
    assert second == first
    assert (second / "model.safetensors").stat().st_mtime_ns == weights_mtime


def test_concurrent_builders_publish_one_complete_directory(tmp_path: Path) -> None:
    with ThreadPoolExecutor(max_workers=3) as pool:
        paths = list(pool.map(lambda _: build_tiny_model(TinyModelSpec(), tmp_path), range(3)))
    assert len(set(paths)) == 1
    assert [path.name for path in tmp_path.iterdir()] == [paths[0].name], "staging dirs left"
    assert sorted(path.name for path in paths[0].iterdir()) == sorted(MODEL_FILES)


def test_different_specs_get_different_directories_and_weights(tmp_path: Path) -> None:
    variants = [
        TinyModelSpec(),
        TinyModelSpec(seed=1),
        TinyModelSpec(num_kv_heads=4),
        TinyModelSpec(dtype="bfloat16"),
        TinyModelSpec(num_layers=3),
    ]
    paths = [build_tiny_model(spec, cache_root=tmp_path) for spec in variants]
    assert len(set(paths)) == len(variants)
    default_weights = (paths[0] / "model.safetensors").read_bytes()
    assert (paths[1] / "model.safetensors").read_bytes() != default_weights


def test_derived_sizes_resolve_to_the_same_spec() -> None:
    explicit = TinyModelSpec(hidden_size=8 * 64, intermediate_size=2 * 8 * 64)
    assert TinyModelSpec() == explicit
    assert TinyModelSpec().fingerprint() == explicit.fingerprint()
    assert TinyModelSpec(hidden_size=256).hidden == 256


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_attention_heads": 8, "num_kv_heads": 3}, "multiple of num_kv_heads"),
        ({"num_layers": 0}, "num_layers must be positive"),
        ({"head_dim": 63}, "head_dim must be even"),
        ({"vocab_size": 200}, "vocab_size must be at least"),
        ({"dtype": "int8"}, "dtype must be one of"),
    ],
)
def test_invalid_specs_are_rejected(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TinyModelSpec(**overrides)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_layers": 0}, "num_layers must be positive"),
        ({"qk_rope_head_dim": 63}, "qk_rope_head_dim must be even"),
        ({"vocab_size": 200}, "vocab_size must be at least"),
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"rope": "linear"}, "rope must be one of"),
    ],
)
def test_invalid_mla_specs_are_rejected(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TinyMLAModelSpec(**overrides)  # type: ignore[arg-type]


def test_mla_derived_sizes_resolve_to_the_same_spec() -> None:
    explicit = TinyMLAModelSpec(hidden_size=8 * 128, intermediate_size=2 * 8 * 128)
    assert TinyMLAModelSpec() == explicit
    assert TinyMLAModelSpec().fingerprint() == explicit.fingerprint()
    assert TinyMLAModelSpec().fingerprint() != TinyModelSpec().fingerprint()


def test_config_and_weights_have_the_requested_gqa_shape(tmp_path: Path) -> None:
    from safetensors import safe_open

    spec = TinyModelSpec(
        num_layers=3, num_attention_heads=4, num_kv_heads=2, head_dim=32, dtype="bfloat16"
    )
    path = build_tiny_model(spec, cache_root=tmp_path)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 3
    assert config["num_attention_heads"] == 4
    assert config["num_key_value_heads"] == 2
    assert config["head_dim"] == 32
    assert config["hidden_size"] == 128
    assert config["intermediate_size"] == 256
    assert config["torch_dtype"] == "bfloat16"
    with safe_open(path / "model.safetensors", framework="pt") as weights:
        names = set(weights.keys())
        assert len(names) == 3 + 9 * spec.num_layers
        k_proj = weights.get_tensor("model.layers.2.self_attn.k_proj.weight")
        q_proj = weights.get_tensor("model.layers.2.self_attn.q_proj.weight")
        assert tuple(k_proj.shape) == (2 * 32, 128)
        assert tuple(q_proj.shape) == (4 * 32, 128)
        assert str(k_proj.dtype) == "torch.bfloat16"
        assert tuple(weights.get_tensor("lm_head.weight").shape) == (spec.vocab_size, 128)


def test_tokenizer_round_trips_text_and_adds_bos(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = build_tiny_model(TinyModelSpec(), cache_root=tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == TinyModelSpec().vocab_size
    text = "Hello, my name is Zoë: π ≈ 3.14 — 日本語 ok?\n\tdone 🙂"
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.convert_tokens_to_ids(BOS_TOKEN)
    assert len(ids) < len(text.encode()), "BPE merges should compress ordinary text"
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    generation_config = json.loads((path / "generation_config.json").read_text())
    assert generation_config["eos_token_id"] == tokenizer.convert_tokens_to_ids(EOS_TOKEN)


def test_chat_template_renders_a_conversation(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(cache_root=tmp_path))
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    expected = "<|user|>\nWhat is the capital of France?" + EOS_TOKEN + "\n<|assistant|>\n"
    assert rendered == BOS_TOKEN + expected


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_greedy_output_depends_on_early_context_in_transformers(
    tmp_path: Path, architecture: str
) -> None:
    """The init scales keep random weights from collapsing into prompt-independent output; a
    Qwen2 model loads with every weight it declares (its Q/K/V biases included)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = TinyModelSpec(architecture=architecture, num_kv_heads=3, num_attention_heads=6)
    path = build_tiny_model(spec, cache_root=tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model, loading = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    model = model.eval()
    assert type(model).__name__ == ARCHITECTURES[architecture]
    assert not any(loading.values()), loading  # no missing, unexpected or mismatched weights
    if architecture == "qwen2":
        bias = model.model.layers[0].self_attn.k_proj.bias
        assert bias.shape == (3 * spec.head_dim,) and bias.abs().max() > 0
    story = " walked along the river for an hour and then sat down under the old tree while the"
    continuations = []
    for first_word in ("Alice", "Bob", "Carol"):
        ids = tokenizer(first_word + story, return_tensors="pt").input_ids
        with torch.no_grad():
            output = model.generate(
                ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        continuation = output[0, ids.shape[1] :].tolist()
        assert len(set(continuation)) > len(continuation) // 2, "degenerate repeated tokens"
        continuations.append(tuple(continuation))
    assert len(set(continuations)) == len(continuations)


def test_cli_prints_the_built_model_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny_model.main(["--num-kv-heads", "4", "--head-dim", "32", "--cache-root", str(tmp_path)])
    path = Path(capsys.readouterr().out.strip())
    assert path.parent == tmp_path
    config = json.loads((path / "config.json").read_text())
    assert (config["num_key_value_heads"], config["head_dim"]) == (4, 32)


def test_default_cache_root_follows_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(tiny_model.CACHE_ENV_VAR, str(tmp_path))
    assert build_tiny_model(TinyModelSpec(num_layers=1)).parent == tmp_path


def test_module_imports_without_heavy_libraries() -> None:
    code = (
        "import sys, vllm_ascend_mooncake.launch.tiny_model;"
        "heavy = {'torch', 'transformers', 'tokenizers', 'safetensors', 'vllm'} & set(sys.modules);"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_library_raises_an_actionable_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(MissingDependencyError, match="tokenizers"):
        build_tiny_model(TinyModelSpec(), cache_root=tmp_path)
    assert list(tmp_path.iterdir()) == [], "a failed build must not leave files behind"
