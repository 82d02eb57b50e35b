"""Build small random Llama, Qwen2 or DeepSeek-V2 (MLA) checkpoints that vLLM can serve, offline
and deterministically.

Tests, benchmarks and the demo need a real model directory (config, weights, tokenizer) whose
shape we choose: the number of KV heads decides how heterogeneous tensor parallelism splits the
KV cache, and the number of layers and the head size decide how many bytes move per block.
Nothing may be downloaded, so :func:`build_tiny_model` writes such a directory from scratch:

* ``config.json`` / ``generation_config.json``: a ``LlamaForCausalLM`` or ``Qwen2ForCausalLM``
  (biased Q/K/V projections) with the requested shape (:class:`TinyModelSpec`), or a dense
  ``DeepseekV2ForCausalLM`` whose attention is MLA with a latent KV cache
  (:class:`~.tiny_mla_model.TinyMLAModelSpec`);
* ``model.safetensors``: random weights drawn from a seeded generator;
* ``tokenizer.json`` / ``tokenizer_config.json``: a byte-level BPE tokenizer trained locally on a
  generated corpus, with BOS/EOS tokens and a plain chat template (:mod:`.tiny_tokenizer`).

The weights are scaled so that greedy decoding depends on the whole prompt rather than collapsing
into one repeated token: a KV-cache transfer that delivers wrong blocks then changes the output,
which is what the disaggregation tests rely on. Directories are cached under a hash of the spec
and published with an atomic rename, so concurrent builders (pytest workers, two engines) are safe.

Only the standard library is imported at module level; ``torch``, ``tokenizers`` and
``safetensors`` are imported when a model is built.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from vllm_ascend_mooncake import deps

from .tiny_tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    MIN_VOCAB_SIZE,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    tokenizer_config,
    train_tokenizer,
)

#: Bump when the generated files change for the same spec, so stale cache entries are not reused.
FORMAT_VERSION = 1

#: Environment variable that overrides the default cache root.
CACHE_ENV_VAR = "VAM_MODEL_CACHE"

#: Written last into a model directory; its presence marks a complete build.
MANIFEST_FILE = "tiny_model_spec.json"

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")

#: The grouped-query architectures :class:`TinyModelSpec` builds (vLLM's model classes).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# Initialisation scales. Every projection reads an RMS-normalised input (or a sum of such
# outputs), so ``gain / sqrt(fan_in)`` keeps activations of order ``gain``. The choices below
# were checked with transformers and vLLM (tests/testing, tests/engine):
# * embeddings with std 1 keep each token's identity at the same scale as the layer outputs, so
#   the residual stream is neither dominated by the current token nor washed out by the layers;
# * query/key gain 2 makes attention logits spread by several units, so attention is sharp and
#   the next token depends on particular earlier tokens, not only on the last one;
# * the LM head is scaled so logits spread by about 8: greedy argmax margins are then far larger
#   than the rounding differences between bfloat16/float32 or between TP layouts.
EMBEDDING_STD = 1.0
QUERY_KEY_GAIN = 2.0
PROJECTION_GAIN = 1.0
LOGIT_STD = 8.0

#: Qwen2's Q/K/V biases: small beside the projections' outputs (order 1), not zero, so a bias
#: that vLLM dropped or sharded wrongly changes the answers.
_QKV_BIAS_STD = 0.1

ROPE_THETA = 10000.0
RMS_NORM_EPS = 1e-5


#: (name, shape, std) of one weight tensor; std ``None`` means all ones.
WeightShape = tuple[str, tuple[int, ...], float | None]


def mlp_shapes(prefix: str, hidden: int, intermediate: int) -> Iterator[WeightShape]:
    """A layer's post-attention norm and gated MLP, which both model kinds share."""
    yield f"{prefix}.post_attention_layernorm.weight", (hidden,), None
    for name in ("gate_proj", "up_proj"):
        yield (
            f"{prefix}.mlp.{name}.weight",
            (intermediate, hidden),
            PROJECTION_GAIN / math.sqrt(hidden),
        )
    yield (
        f"{prefix}.mlp.down_proj.weight",
        (hidden, intermediate),
        PROJECTION_GAIN / math.sqrt(intermediate),
    )


def qkv_shapes(prefix: str, hidden: int, heads_width: int, kv_width: int) -> Iterator[WeightShape]:
    """A grouped-query layer's Q, K and V projections (sharp attention: query/key gain)."""
    query_key_std = QUERY_KEY_GAIN / math.sqrt(hidden)
    yield f"{prefix}.self_attn.q_proj.weight", (heads_width, hidden), query_key_std
    yield f"{prefix}.self_attn.k_proj.weight", (kv_width, hidden), query_key_std
    yield (
        f"{prefix}.self_attn.v_proj.weight",
        (kv_width, hidden),
        PROJECTION_GAIN / math.sqrt(hidden),
    )


def check_grouped_attention(num_attention_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """What a grouped-query attention's shape must satisfy for vLLM to build it."""
    if num_attention_heads % num_kv_heads:
        raise ValueError(
            f"num_attention_heads ({num_attention_heads}) must be a multiple of "
            f"num_kv_heads ({num_kv_heads}) for grouped-query attention"
        )
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")


class TinySpecBase:
    """What :func:`build_tiny_model` builds from: :class:`TinyModelSpec` or
    :class:`~.tiny_mla_model.TinyMLAModelSpec`. Each gives its files' config, weights and cache
    key; they share ``hidden_size`` and ``intermediate_size``, which a spec may leave out (None),
    resolved at construction so that a spec that leaves them out equals (and caches like) one
    that spells the same values out, and the fingerprint of their files."""

    hidden_size: int | None
    intermediate_size: int | None
    vocab_size: int
    max_position_embeddings: int
    dtype: str
    seed: int

    def to_dict(self) -> dict[str, Any]:
        """All fields with derived sizes resolved; what the cache key is computed from."""
        raise NotImplementedError

    def directory_name(self) -> str:
        """Readable, collision-free directory name for the cache."""
        raise NotImplementedError

    def config(self, bos_id: int, eos_id: int, pad_id: int) -> dict[str, Any]:
        """``config.json``."""
        raise NotImplementedError

    def weight_shapes(self) -> Iterator[WeightShape]:
        """Every weight tensor, in a fixed order."""
        raise NotImplementedError

    def check_fields(self, not_sizes: Sequence[str]) -> None:
        """The checks every spec shares: each field but ``not_sizes`` a positive int (``seed``
        may be 0), a vocabulary the tokenizer fits in, a dtype vLLM CPU serves."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in not_sizes:
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{field.name} must be an int, got {value!r}")
            if field.name != "seed" and value <= 0:
                raise ValueError(f"{field.name} must be positive, got {value}")
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(
                f"vocab_size must be at least {MIN_VOCAB_SIZE} (256 byte symbols plus "
                f"{len(SPECIAL_TOKENS)} special tokens), got {self.vocab_size}"
            )
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")

    def fingerprint(self) -> str:
        """Hex digest identifying the files this spec builds (changes with FORMAT_VERSION)."""
        payload = json.dumps(
            {"format_version": FORMAT_VERSION, "spec": self.to_dict()}, sort_keys=True
        )
        return hashlib.sha256(payload.encode()).hexdigest()

    def resolve_sizes(self, default_hidden: int) -> None:
        """Fill in what was left out: ``default_hidden``, and an MLP twice the hidden size."""
        if self.hidden_size is None:
            object.__setattr__(self, "hidden_size", default_hidden)
        if self.intermediate_size is None:
            object.__setattr__(self, "intermediate_size", 2 * self.hidden)

    @property
    def hidden(self) -> int:
        """The resolved hidden size (never ``None``)."""
        assert self.hidden_size is not None
        return self.hidden_size

    @property
    def intermediate(self) -> int:
        """The resolved MLP intermediate size (never ``None``)."""
        assert self.intermediate_size is not None
        return self.intermediate_size


@dataclasses.dataclass(frozen=True)
class TinyModelSpec(TinySpecBase):
    """Shape and seed of a tiny grouped-query model: Llama, or Qwen2 (``architecture="qwen2"``:
    Llama's layers plus biases on the Q/K/V projections).

    ``hidden_size`` defaults to ``num_attention_heads * head_dim`` and ``intermediate_size`` to
    twice the hidden size (:class:`TinySpecBase`). ``config_head_dim``: a ``head_dim`` that
    config.json states and the attention ignores (Qwen2 only: vLLM's Qwen2 attention computes
    ``hidden_size // num_attention_heads``, the real ``head_dim`` here, while vLLM's
    ``ModelConfig.get_head_size()`` returns the config's), for checking that nothing plans with
    the config's value.
    """

    num_layers: int = 2
    num_attention_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    hidden_size: int | None = None
    intermediate_size: int | None = None
    vocab_size: int = 512
    max_position_embeddings: int = 1024
    dtype: str = "float32"
    seed: int = 0
    architecture: str = "llama"
    config_head_dim: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"architecture must be one of {sorted(ARCHITECTURES)}, got {self.architecture!r}"
            )
        self.resolve_sizes(default_hidden=self.num_attention_heads * self.head_dim)
        self.check_fields(not_sizes=("dtype", "architecture", "config_head_dim"))
        if self.config_head_dim is not None and (
            self.architecture != "qwen2" or self.config_head_dim in (self.head_dim, 0)
        ):
            raise ValueError(
                f"config_head_dim states a head_dim the attention ignores: Qwen2 only, and "
                f"other than head_dim {self.head_dim}; got {self.config_head_dim} for "
                f"{self.architecture}"
            )
        check_grouped_attention(self.num_attention_heads, self.num_kv_heads, self.head_dim)
        if self.architecture == "qwen2" and self.hidden != self.num_attention_heads * self.head_dim:
            raise ValueError(
                f"a Qwen2 model's head_dim is hidden_size / num_attention_heads: hidden_size "
                f"{self.hidden} != {self.num_attention_heads} x {self.head_dim}"
            )

    def to_dict(self) -> dict[str, Any]:
        """All fields with derived sizes resolved; what the cache key is computed from (an unset
        ``config_head_dim`` left out: specs made before it cache as they did)."""
        fields = dataclasses.asdict(self)
        if fields["config_head_dim"] is None:
            del fields["config_head_dim"]
        return fields

    def directory_name(self) -> str:
        """Readable, collision-free directory name for the cache."""
        return (
            f"{self.architecture}-l{self.num_layers}-h{self.num_attention_heads}-kv{self.num_kv_heads}"
            f"-d{self.head_dim}"
            + (f"-cfgd{self.config_head_dim}" if self.config_head_dim else "")
            + f"-{self.dtype}-{self.fingerprint()[:16]}"
        )

    def config(self, bos_id: int, eos_id: int, pad_id: int) -> dict[str, Any]:
        """``config.json``: vLLM's Llama or Qwen2 with this shape."""
        config: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.architecture]],
            "model_type": self.architecture,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "rms_norm_eps": RMS_NORM_EPS,
            "rope_theta": ROPE_THETA,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "initializer_range": 0.02,
            "torch_dtype": self.dtype,
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
            "pad_token_id": pad_id,
            "use_cache": True,
        }
        if self.architecture == "qwen2":
            # Qwen2 always biases Q/K/V (no attention_bias switch); no sliding window.
            for key in ("attention_bias", "mlp_bias", "head_dim"):
                del config[key]
            config.update(use_sliding_window=False, sliding_window=None, max_window_layers=0)
            if self.config_head_dim is not None:
                config["head_dim"] = self.config_head_dim
        return config

    def weight_shapes(self) -> Iterator[WeightShape]:
        """Every tensor, in a fixed order."""
        hidden, heads_width = self.hidden, self.num_attention_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        yield "model.embed_tokens.weight", (self.vocab_size, hidden), EMBEDDING_STD
        for layer in range(self.num_layers):
            prefix = f"model.layers.{layer}"
            yield f"{prefix}.input_layernorm.weight", (hidden,), None
            yield from qkv_shapes(prefix, hidden, heads_width, kv_width)
            if self.architecture == "qwen2":
                for name, width in (
                    ("q_proj", heads_width),
                    ("k_proj", kv_width),
                    ("v_proj", kv_width),
                ):
                    yield f"{prefix}.self_attn.{name}.bias", (width,), _QKV_BIAS_STD
            yield (
                f"{prefix}.self_attn.o_proj.weight",
                (hidden, heads_width),
                PROJECTION_GAIN / math.sqrt(heads_width),
            )
            yield from mlp_shapes(prefix, hidden, self.intermediate)
        yield "model.norm.weight", (hidden,), None
        yield "lm_head.weight", (self.vocab_size, hidden), LOGIT_STD / math.sqrt(hidden)


def default_cache_root() -> Path:
    """``$VAM_MODEL_CACHE`` if set, else ``~/.cache/vllm_ascend_mooncake/models``."""
    configured = os.environ.get(CACHE_ENV_VAR)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "vllm_ascend_mooncake" / "models"


def build_tiny_model(
    spec: TinySpecBase | None = None, cache_root: str | os.PathLike[str] | None = None
) -> Path:
    """Return the directory of the model described by ``spec``, building it if not cached.

    The build goes to a private temporary directory next to the target and is published with
    one ``rename``; a concurrent builder that loses the race discards its copy and uses the
    winner's, which has identical content.
    """
    spec = spec or TinyModelSpec()
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    target = root / spec.directory_name()
    if _is_complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=root))
    try:
        write_model_files(spec, staging)
        staging.chmod(0o755)
        try:
            os.rename(staging, target)
        except OSError:
            if not _is_complete(target):
                raise RuntimeError(
                    f"cannot publish tiny model to {target}: the path exists but is not a "
                    f"complete build (no {MANIFEST_FILE}); remove it and retry"
                ) from None
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def write_model_files(spec: TinySpecBase, directory: Path) -> None:
    """Write all files of ``spec``'s model into the existing ``directory`` (no caching)."""
    tokenizer = train_tokenizer(spec.vocab_size)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    pad_id = tokenizer.token_to_id(PAD_TOKEN)
    tokenizer.save(str(directory / "tokenizer.json"))
    _write_json(directory / "tokenizer_config.json", tokenizer_config(spec.max_position_embeddings))
    _write_json(
        directory / "special_tokens_map.json",
        {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN},
    )
    _write_json(directory / "config.json", spec.config(bos_id, eos_id, pad_id))
    _write_json(
        directory / "generation_config.json",
        {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id},
    )
    _write_weights(spec, directory / "model.safetensors")
    for path in directory.iterdir():
        path.chmod(0o644)
    _write_json(
        directory / MANIFEST_FILE,
        {
            "format_version": FORMAT_VERSION,
            "fingerprint": spec.fingerprint(),
            "spec": spec.to_dict(),
        },
    )


def _is_complete(directory: Path) -> bool:
    return (directory / MANIFEST_FILE).is_file()


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_weights(spec: TinySpecBase, path: Path) -> None:
    torch = deps.require_torch()
    safetensors_torch = deps.require_safetensors_torch()
    generator = torch.Generator(device="cpu").manual_seed(spec.seed)
    dtype = getattr(torch, spec.dtype)
    tensors = {}
    for name, shape, std in spec.weight_shapes():
        if std is None:
            values = torch.ones(shape, dtype=torch.float32)
        else:
            values = torch.randn(shape, generator=generator, dtype=torch.float32) * std
        tensors[name] = values.to(dtype).contiguous()
    safetensors_torch.save_file(tensors, str(path), metadata={"format": "pt"})


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_ascend_mooncake.launch.tiny_model",
        description=(
            "Build (or find in the cache) a tiny random Llama or Qwen2 model; print its path."
        ),
    )
    for field in dataclasses.fields(TinyModelSpec):
        flag = "--" + field.name.replace("_", "-")
        if field.name == "dtype":
            parser.add_argument(flag, choices=SUPPORTED_DTYPES, default=field.default)
        elif field.name == "architecture":
            parser.add_argument(flag, choices=sorted(ARCHITECTURES), default=field.default)
        else:
            parser.add_argument(flag, type=int, default=field.default)
    parser.add_argument(
        "--cache-root",
        type=Path,
        default=None,
        help=f"cache directory (default: ${CACHE_ENV_VAR} or ~/.cache/vllm_ascend_mooncake/models)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point: build the model and print its directory."""
    args = _parse_args(argv)
    spec = TinyModelSpec(
        **{field.name: getattr(args, field.name) for field in dataclasses.fields(TinyModelSpec)}
    )
    print(build_tiny_model(spec, cache_root=args.cache_root))


if __name__ == "__main__":
    main()
