"""Build a small random EAGLE draft model for a tiny Llama target, offline and deterministically.

Speculative decoding with EAGLE adds the draft model's layers to the engine's KV cache, after
the target's; their KV-head count (and head size) may differ from the target's, so the connector
plans them as a head group of their own. Tests need such a draft: :class:`TinyEagleDraftSpec`
describes one (vLLM's ``EagleLlamaForCausalLM``: one decoder layer whose input norm EAGLE drops,
and ``fc``, which reads the token's embedding beside the target's hidden state), and
:func:`~.tiny_model.build_tiny_model` builds and caches it like any tiny model. The draft has no
embedding and no LM head of its own: vLLM shares the target's, so the target's hidden and
vocabulary sizes are the draft's (:meth:`TinyEagleDraftSpec.for_target`).

Random weights propose tokens the target mostly rejects; greedy answers are the target's
whatever the draft proposes, so the draft's KV is checked by its bytes, not by answers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

from .tiny_model import (
    PROJECTION_GAIN,
    RMS_NORM_EPS,
    ROPE_THETA,
    TinyModelSpec,
    TinySpecBase,
    WeightShape,
    check_grouped_attention,
    mlp_shapes,
    qkv_shapes,
)

#: vLLM's model class for an EAGLE (1) draft of a Llama target.
EAGLE_LLAMA_ARCHITECTURE = "EagleLlamaForCausalLM"


@dataclasses.dataclass(frozen=True)
class TinyEagleDraftSpec(TinySpecBase):
    """Shape and seed of a one-layer EAGLE draft. ``hidden_size`` and ``vocab_size`` must be the
    target's (the draft shares its embedding and LM head); the attention's shape is the draft's
    own."""

    hidden_size: int | None
    num_attention_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int | None = None
    vocab_size: int = 512
    max_position_embeddings: int = 1024
    dtype: str = "float32"
    seed: int = 1

    def __post_init__(self) -> None:
        if self.hidden_size is None:
            raise ValueError("an EAGLE draft's hidden_size is its target's: give it")
        self.resolve_sizes(default_hidden=self.hidden_size)
        self.check_fields(not_sizes=("dtype",))
        check_grouped_attention(self.num_attention_heads, self.num_kv_heads, self.head_dim)
        if self.hidden % self.num_attention_heads:
            raise ValueError(
                f"transformers wants the hidden size ({self.hidden}) to be a multiple of "
                f"num_attention_heads ({self.num_attention_heads})"
            )

    @classmethod
    def for_target(cls, target: TinyModelSpec, **attention: int) -> TinyEagleDraftSpec:
        """A draft of ``target`` (its hidden size, vocabulary, length and dtype) with the
        attention shape given in ``attention`` (``num_kv_heads``, ``num_attention_heads``,
        ``head_dim``, ``seed``)."""
        if target.architecture != "llama":
            raise ValueError(
                f"an EAGLE Llama draft needs a Llama target, not {target.architecture}"
            )
        return cls(
            hidden_size=target.hidden,
            vocab_size=target.vocab_size,
            max_position_embeddings=target.max_position_embeddings,
            dtype=target.dtype,
            **attention,
        )

    def to_dict(self) -> dict[str, Any]:
        return {"architecture": "eagle_llama", **dataclasses.asdict(self)}

    def directory_name(self) -> str:
        return (
            f"eagle-llama-hid{self.hidden}-h{self.num_attention_heads}-kv{self.num_kv_heads}"
            f"-d{self.head_dim}-{self.dtype}-{self.fingerprint()[:16]}"
        )

    def config(self, bos_id: int, eos_id: int, pad_id: int) -> dict[str, Any]:
        """``config.json``: vLLM's ``EagleLlamaForCausalLM`` with one layer of this shape."""
        return {
            "architectures": [EAGLE_LLAMA_ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "rms_norm_eps": RMS_NORM_EPS,
            "rope_theta": ROPE_THETA,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": self.dtype,
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
            "pad_token_id": pad_id,
        }

    def weight_shapes(self) -> Iterator[WeightShape]:
        """``fc`` and layer 0 under EAGLE's names (no ``model.`` prefix, no input norm)."""
        hidden, heads_width = self.hidden, self.num_attention_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        yield "fc.weight", (hidden, 2 * hidden), PROJECTION_GAIN / math.sqrt(2 * hidden)
        prefix = "layers.0"
        yield from qkv_shapes(prefix, hidden, heads_width, kv_width)
        yield (
            f"{prefix}.self_attn.o_proj.weight",
            (hidden, heads_width),
            PROJECTION_GAIN / math.sqrt(heads_width),
        )
        yield from mlp_shapes(prefix, hidden, self.intermediate)
