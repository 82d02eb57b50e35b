"""The tiny DeepSeek-V2 (MLA) checkpoint's shape, config and weights: the MLA models the tests and
benchmarks serve, built by :func:`~.tiny_model.build_tiny_model` like the grouped-query ones."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

from .tiny_model import (
    EMBEDDING_STD,
    LOGIT_STD,
    PROJECTION_GAIN,
    QUERY_KEY_GAIN,
    RMS_NORM_EPS,
    ROPE_THETA,
    TinySpecBase,
    WeightShape,
    mlp_shapes,
)

#: RoPE variants of :class:`TinyMLAModelSpec` (see its docstring).
MLA_ROPE_KINDS = ("yarn", "default")


@dataclasses.dataclass(frozen=True)
class TinyMLAModelSpec(TinySpecBase):
    """Shape and seed of a tiny DeepSeek-V2 model: multi-head latent attention (MLA), dense MLPs.

    The defaults keep DeepSeek-V2's real latent geometry, ``kv_lora_rank + qk_rope_head_dim`` =
    576 elements per token, the only head size vLLM CPU's MLA backends (``CPU_MLA``,
    ``AMX_MLA``) support; they also need ``bfloat16`` (AMX) or accept it (the reference
    backend). Queries come from one ``q_proj`` (``q_lora_rank`` None, as in DeepSeek-V2-Lite),
    and no layer is a mixture of experts (``first_k_dense_replace`` = ``num_layers``).

    ``rope`` is ``"yarn"`` by default, as in DeepSeek-V2's own configs, here with scaling
    factor 1 (the same rotation as plain RoPE): vLLM then rotates with
    ``DeepseekScalingRotaryEmbedding`` in PyTorch. ``"default"`` (plain RoPE, what a bare
    ``DeepseekV2Config`` gives) makes vLLM CPU use its ``rotary_embedding`` C++ op, which
    misaddresses MLA's strided ``q_pe``/``k_pe`` views in every forward of more than one token
    (vLLM 0.32; see tests/e2e/test_mla.py): prefill's cached latent then differs from what a
    one-token forward writes, so P/D and colocated answers differ.

    ``hidden_size`` defaults to ``num_attention_heads * v_head_dim`` and ``intermediate_size`` to
    twice the hidden size (:class:`~.tiny_model.TinySpecBase`).
    """

    num_layers: int = 2
    num_attention_heads: int = 8
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    hidden_size: int | None = None
    intermediate_size: int | None = None
    vocab_size: int = 512
    max_position_embeddings: int = 1024
    dtype: str = "bfloat16"
    rope: str = "yarn"
    seed: int = 0

    def __post_init__(self) -> None:
        self.resolve_sizes(default_hidden=self.num_attention_heads * self.v_head_dim)
        self.check_fields(not_sizes=("dtype", "rope"))
        if self.rope not in MLA_ROPE_KINDS:
            raise ValueError(f"rope must be one of {MLA_ROPE_KINDS}, got {self.rope!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"qk_rope_head_dim must be even for rotary embeddings, got {self.qk_rope_head_dim}"
            )

    @property
    def latent_size(self) -> int:
        """Elements of one token's latent KV cache entry (vLLM's MLA head size)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def to_dict(self) -> dict[str, Any]:
        """All fields with derived sizes resolved, and the architecture; the cache key's input."""
        return {"architecture": "deepseek_v2", **dataclasses.asdict(self)}

    def directory_name(self) -> str:
        """Readable, collision-free directory name for the cache."""
        return (
            f"deepseek_v2-l{self.num_layers}-h{self.num_attention_heads}-lora{self.kv_lora_rank}"
            f"-rope{self.qk_rope_head_dim}-{self.rope}-{self.dtype}-{self.fingerprint()[:16]}"
        )

    def config(self, bos_id: int, eos_id: int, pad_id: int) -> dict[str, Any]:
        """A dense DeepSeek-V2 config (transformers' ``DeepseekV2Config`` keys; no experts)."""
        return {
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "moe_intermediate_size": self.intermediate,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "kv_lora_rank": self.kv_lora_rank,
            "q_lora_rank": None,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "v_head_dim": self.v_head_dim,
            "head_dim": self.qk_rope_head_dim,
            # transformers wants expert counts; first_k_dense_replace makes every layer dense.
            "n_routed_experts": 1,
            "n_shared_experts": 1,
            "num_experts_per_tok": 1,
            "first_k_dense_replace": self.num_layers,
            "moe_layer_freq": 1,
            "topk_method": "greedy",
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "rms_norm_eps": RMS_NORM_EPS,
            "rope_theta": ROPE_THETA,
            "rope_scaling": self._rope_scaling(),
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "initializer_range": 0.02,
            "torch_dtype": self.dtype,
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
            "pad_token_id": pad_id,
            "use_cache": True,
        }

    def _rope_scaling(self) -> dict[str, Any] | None:
        """DeepSeek's YaRN with factor 1 (no interpolation: plain RoPE's angles, mscale 1), or
        none."""
        if self.rope == "default":
            return None
        return {
            "type": "yarn",
            "factor": 1.0,
            "original_max_position_embeddings": self.max_position_embeddings,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        }

    def weight_shapes(self) -> Iterator[WeightShape]:
        """Every tensor of the DeepSeek-V2 model, as vLLM loads them, in a fixed order.

        The scales follow the Llama ones: queries and both key parts (``k_nope`` from the normalised
        latent through ``kv_b_proj``, ``k_pe`` straight from ``kv_a_proj_with_mqa``) get the
        query/key gain, so attention stays sharp; values and outputs keep activations of order 1."""
        hidden, heads = self.hidden, self.num_attention_heads
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        query_key_std = QUERY_KEY_GAIN / math.sqrt(hidden)
        yield "model.embed_tokens.weight", (self.vocab_size, hidden), EMBEDDING_STD
        for layer in range(self.num_layers):
            prefix = f"model.layers.{layer}"
            yield f"{prefix}.input_layernorm.weight", (hidden,), None
            yield f"{prefix}.self_attn.q_proj.weight", (heads * qk_head_dim, hidden), query_key_std
            yield (
                f"{prefix}.self_attn.kv_a_proj_with_mqa.weight",
                (self.latent_size, hidden),
                query_key_std,
            )
            yield f"{prefix}.self_attn.kv_a_layernorm.weight", (self.kv_lora_rank,), None
            # kv_b_proj's rows: per head, qk_nope_head_dim rows of k_nope then v_head_dim rows of v.
            # One std for both (the key gain): the value rows only scale the attention output.
            yield (
                f"{prefix}.self_attn.kv_b_proj.weight",
                (heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank),
                QUERY_KEY_GAIN / math.sqrt(self.kv_lora_rank),
            )
            yield (
                f"{prefix}.self_attn.o_proj.weight",
                (hidden, heads * self.v_head_dim),
                PROJECTION_GAIN / math.sqrt(heads * self.v_head_dim),
            )
            yield from mlp_shapes(prefix, hidden, self.intermediate)
        yield "model.norm.weight", (hidden,), None
        yield "lm_head.weight", (self.vocab_size, hidden), LOGIT_STD / math.sqrt(hidden)
