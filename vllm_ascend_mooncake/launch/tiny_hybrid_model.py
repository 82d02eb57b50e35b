"""Tiny random checkpoints of the models vLLM serves with its hybrid KV cache manager (HMA):
several KV cache groups, each with block ids of its own, which the connector must move per group
(issue #45). Built by :func:`~.tiny_model.build_tiny_model` like the grouped-query and MLA ones.

* :class:`TinyQwen3NextModelSpec`: Qwen3-Next, Gated DeltaNet linear-attention layers (a
  ``MambaSpec`` group: one conv state and one SSM state per request) interleaved with gated full
  attention (a ``FullAttentionSpec`` group); a small mixture of experts in every layer (vLLM's
  Qwen3-Next refuses a model without one).
* :class:`TinySlidingWindowModelSpec`: a Llama whose ``layer_types`` interleave sliding-window
  and full attention (vLLM's ``LlamaAttention`` honours ``layer_types``, as for Ministral):
  a ``SlidingWindowSpec`` group beside a ``FullAttentionSpec`` group, every layer otherwise the
  tiny Llama's (same weights, same scales).

``python -m vllm_ascend_mooncake.launch.tiny_hybrid_model`` builds both, serves each colocated with
``vllm.LLM`` (no KV connector, so the hybrid manager stays on) and prints the KV cache config
and the tensors the CPU model runner allocated, per rank; ``docs/design/hma.md`` records them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

from .tiny_model import (
    EMBEDDING_STD,
    LOGIT_STD,
    PROJECTION_GAIN,
    QUERY_KEY_GAIN,
    RMS_NORM_EPS,
    ROPE_THETA,
    TinyModelSpec,
    TinySpecBase,
    WeightShape,
    build_tiny_model,
)

#: ``layer_types`` values (transformers' names).
FULL, LINEAR, SLIDING = "full_attention", "linear_attention", "sliding_attention"

#: Scale of the GDN decay parameter ``A_log`` (decay rate ``exp(A_log)``): random around 0, so
#: heads forget at different rates, none so fast that the state only holds the last token.
_A_LOG_STD = 0.5


@dataclasses.dataclass(frozen=True)
class TinyQwen3NextModelSpec(TinySpecBase):
    """Shape and seed of a tiny Qwen3-Next: every ``full_attention_interval``-th layer full
    attention (Qwen3-Next's own rule, ``(i + 1) % interval == 0``), the others Gated DeltaNet.

    The defaults suit vLLM CPU: head sizes 64 (CPU attention's sizes), two KV heads and two
    linear key heads so that TP 2 splits both kinds, bf16. Every layer's MLP is a routed
    mixture of ``num_experts`` experts with one shared expert, as in the real model: vLLM's
    ``Qwen3NextForCausalLM`` raises "No Qwen3Next layer found" when no layer has experts, so a
    dense variant is not servable. ``hidden_size`` defaults to ``num_attention_heads *
    head_dim``, ``intermediate_size`` to twice that; each expert is half as wide.
    """

    num_layers: int = 4
    full_attention_interval: int = 2
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    num_experts: int = 4
    num_experts_per_tok: int = 2
    hidden_size: int | None = None
    intermediate_size: int | None = None
    vocab_size: int = 512
    max_position_embeddings: int = 1024
    dtype: str = "bfloat16"
    seed: int = 0

    def __post_init__(self) -> None:
        self.resolve_sizes(default_hidden=self.num_attention_heads * self.head_dim)
        self.check_fields(not_sizes=("dtype",))
        if self.num_experts < self.num_experts_per_tok:
            raise ValueError(
                f"num_experts ({self.num_experts}) must be at least num_experts_per_tok "
                f"({self.num_experts_per_tok})"
            )
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_kv_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if FULL not in self.layer_types or LINEAR not in self.layer_types:
            raise ValueError(
                f"a hybrid needs both layer kinds; {self.num_layers} layers with a full one every "
                f"{self.full_attention_interval} give {self.layer_types}"
            )

    @property
    def layer_types(self) -> list[str]:
        """Each layer's kind, as config.json lists them."""
        interval = self.full_attention_interval
        return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(self.num_layers)]

    def to_dict(self) -> dict[str, Any]:
        """All fields with derived sizes resolved, and the architecture; the cache key's input."""
        return {"architecture": "qwen3_next", **dataclasses.asdict(self)}

    def directory_name(self) -> str:
        """Readable, collision-free directory name for the cache."""
        return (
            f"qwen3_next-l{self.num_layers}-i{self.full_attention_interval}"
            f"-h{self.num_attention_heads}-kv{self.num_kv_heads}-lk{self.linear_num_key_heads}"
            f"-lv{self.linear_num_value_heads}-e{self.num_experts}-{self.dtype}"
            f"-{self.fingerprint()[:16]}"
        )

    def config(self, bos_id: int, eos_id: int, pad_id: int) -> dict[str, Any]:
        """transformers' ``Qwen3NextConfig`` keys."""
        return {
            "architectures": ["Qwen3NextForCausalLM"],
            "model_type": "qwen3_next",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.num_layers,
            "layer_types": self.layer_types,
            "full_attention_interval": self.full_attention_interval,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "partial_rotary_factor": 0.25,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            # Experts (and the shared one) half the MLP's width each.
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.intermediate // 2,
            "shared_expert_intermediate_size": self.intermediate // 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "router_aux_loss_coef": 0.0,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "rms_norm_eps": RMS_NORM_EPS,
            "rope_theta": ROPE_THETA,
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

    def weight_shapes(self) -> Iterator[WeightShape]:
        """Every tensor under transformers' (and the released checkpoints') names.

        Norms are all ones: Qwen3-Next's RMS norms scale by ``1 + weight`` (2 here), its gated
        GDN norm by ``weight``. GDN's queries and keys are L2-normalised in the kernel, so the
        projections keep the plain gain; the full attention's get the query/key gain as Llama's.
        """
        hidden = self.hidden
        std = PROJECTION_GAIN / math.sqrt(hidden)
        key_width = self.linear_num_key_heads * self.linear_key_head_dim
        value_width = self.linear_num_value_heads * self.linear_value_head_dim
        heads_width = self.num_attention_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        yield "model.embed_tokens.weight", (self.vocab_size, hidden), EMBEDDING_STD
        for layer, kind in enumerate(self.layer_types):
            prefix = f"model.layers.{layer}"
            yield f"{prefix}.input_layernorm.weight", (hidden,), None
            if kind == LINEAR:
                attn = f"{prefix}.linear_attn"
                heads = self.linear_num_value_heads
                yield f"{attn}.dt_bias", (heads,), None
                yield f"{attn}.A_log", (heads,), _A_LOG_STD
                conv_width = 2 * key_width + value_width
                yield (
                    f"{attn}.conv1d.weight",
                    (conv_width, 1, self.linear_conv_kernel_dim),
                    1 / math.sqrt(self.linear_conv_kernel_dim),
                )
                yield f"{attn}.in_proj_qkvz.weight", (2 * key_width + 2 * value_width, hidden), std
                yield f"{attn}.in_proj_ba.weight", (2 * heads, hidden), std
                yield f"{attn}.norm.weight", (self.linear_value_head_dim,), None
                yield (
                    f"{attn}.out_proj.weight",
                    (hidden, value_width),
                    PROJECTION_GAIN / math.sqrt(value_width),
                )
            else:
                attn, query_key_std = f"{prefix}.self_attn", QUERY_KEY_GAIN / math.sqrt(hidden)
                # Queries and the output gate come out of one projection: twice the width.
                yield f"{attn}.q_proj.weight", (2 * heads_width, hidden), query_key_std
                yield f"{attn}.k_proj.weight", (kv_width, hidden), query_key_std
                yield f"{attn}.v_proj.weight", (kv_width, hidden), std
                yield (
                    f"{attn}.o_proj.weight",
                    (hidden, heads_width),
                    PROJECTION_GAIN / math.sqrt(heads_width),
                )
                yield f"{attn}.q_norm.weight", (self.head_dim,), None
                yield f"{attn}.k_norm.weight", (self.head_dim,), None
            yield from self._moe_shapes(prefix)
        yield "model.norm.weight", (hidden,), None
        yield "lm_head.weight", (self.vocab_size, hidden), LOGIT_STD / math.sqrt(hidden)

    def _moe_shapes(self, prefix: str) -> Iterator[WeightShape]:
        """The routed experts (one tensor each, the released checkpoints' layout), the router,
        the shared expert and its gate."""
        hidden, width = self.hidden, self.intermediate // 2
        yield f"{prefix}.post_attention_layernorm.weight", (hidden,), None
        yield f"{prefix}.mlp.gate.weight", (self.num_experts, hidden), 1 / math.sqrt(hidden)
        experts = [f"{prefix}.mlp.experts.{e}" for e in range(self.num_experts)]
        for expert in [*experts, f"{prefix}.mlp.shared_expert"]:
            for name in ("gate_proj", "up_proj"):
                yield (
                    f"{expert}.{name}.weight",
                    (width, hidden),
                    PROJECTION_GAIN / math.sqrt(hidden),
                )
            yield f"{expert}.down_proj.weight", (hidden, width), PROJECTION_GAIN / math.sqrt(width)
        yield f"{prefix}.mlp.shared_expert_gate.weight", (1, hidden), 1 / math.sqrt(hidden)


@dataclasses.dataclass(frozen=True)
class TinySlidingWindowModelSpec(TinyModelSpec):
    """A tiny Llama (:class:`~.tiny_model.TinyModelSpec`'s layers and weights) whose layers
    alternate sliding-window and full attention, starting with a sliding one: vLLM's hybrid
    manager gives each kind a KV cache group. ``sliding_window`` is in tokens; vLLM drops a
    request's sliding blocks that lie wholly before its window, so prompts longer than the block
    size plus the window (vLLM CPU's default block is 128 tokens) exercise dropping them."""

    num_layers: int = 4
    dtype: str = "bfloat16"
    sliding_window: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.architecture != "llama":
            raise ValueError("the sliding-window model is a Llama")
        if self.num_layers < 2:
            raise ValueError("alternating sliding and full layers needs at least 2 layers")

    @property
    def layer_types(self) -> list[str]:
        """Each layer's kind, as config.json lists them."""
        return [SLIDING if i % 2 == 0 else FULL for i in range(self.num_layers)]

    def to_dict(self) -> dict[str, Any]:
        """The Llama's fields plus the window; the kind keeps its cache key apart."""
        return {"kind": "sliding_window", **super().to_dict()}

    def directory_name(self) -> str:
        """Readable, collision-free directory name for the cache."""
        return f"sw{self.sliding_window}-{super().directory_name()}"

    def config(self, bos_id: int, eos_id: int, pad_id: int) -> dict[str, Any]:
        """The Llama's ``config.json`` with ``layer_types`` and ``sliding_window``."""
        return {
            **super().config(bos_id, eos_id, pad_id),
            "layer_types": self.layer_types,
            "sliding_window": self.sliding_window,
        }


# --- colocated check: serve each model with the hybrid manager on, record its KV caches ---------


def describe_worker_kv_caches(worker: Any) -> dict[str, Any]:
    """Run on each worker (``LLM.collective_rpc``): the KV cache config the runner was given and
    every tensor it allocated per layer, with shapes, strides, dtypes and data pointers, so that
    the design can say what a connector registers per group on this rank."""
    import torch

    runner = worker.model_runner
    config = runner.kv_cache_config
    groups = []
    for index, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        fields = {
            key: str(value) if isinstance(value, torch.dtype) else value
            for key, value in vars(spec).items()
            if isinstance(value, (int, float, str, bool, tuple, list, type(None), torch.dtype))
        }
        groups.append(
            {
                "group": index,
                "spec": type(spec).__name__,
                "layers": list(group.layer_names),
                "block_size": spec.block_size,
                "page_size_bytes": spec.page_size_bytes,
                "fields": fields,
            }
        )
    forward_context = worker.vllm_config.compilation_config.static_forward_context
    layers = {}
    for name in sorted(forward_context):
        cache = getattr(forward_context[name], "kv_cache", None)
        if cache is None:
            continue
        tensors = cache if isinstance(cache, (list, tuple)) else [cache]
        if tensors and isinstance(tensors[0], (list, tuple)):  # one entry per virtual engine
            tensors = tensors[0]
        layers[name] = [
            {
                "shape": list(t.shape),
                "stride": list(t.stride()),
                "dtype": str(t.dtype),
                "data_ptr": t.data_ptr(),
                "bytes": t.numel() * t.element_size(),
            }
            for t in tensors
            if isinstance(t, torch.Tensor) and t.numel()
        ]
    return {
        "rank": worker.rank,
        "connector_views": _connector_views(worker, config),
        "num_blocks": config.num_blocks,
        "groups": groups,
        "kv_cache_tensors": [_plain(vars(t)) for t in config.kv_cache_tensors],
        "layers": layers,
    }


def gdn_rank_weights(worker: Any) -> dict[str, Any]:
    """Run on each worker: the first GDN layer's conv weight (one row per conv-state column) and
    ``A_log`` (one entry per value head, the SSM state's first axis) as this rank loaded them.
    Their rows are the columns and heads of the states this rank holds, which is how
    :func:`check_gdn_tp_split` verifies the split the design relies on."""
    context = worker.vllm_config.compilation_config.static_forward_context
    name = next((n for n in sorted(context) if n.endswith("linear_attn")), None)
    if name is None:
        return {}
    layer = context[name]
    return {
        "layer": name,
        "conv_weight": layer.conv1d.weight.detach().float().reshape(-1).tolist(),
        "a_log": layer.A_log.detach().float().tolist(),
    }


def check_gdn_tp_split(
    spec: TinyQwen3NextModelSpec, model: str, ranks: list[dict[str, Any]]
) -> bool:
    """Whether each rank's conv rows are ``[Q_r | K_r | V_r]`` (the ``r``-th contiguous part of
    each sub-projection of the checkpoint's ``conv1d``) and its ``A_log`` the ``r``-th
    contiguous part of the value heads: vLLM's GDN sharding, read in
    ``qwen_gdn_linear_attn.py`` (``mamba_v2_sharded_weight_loader``), checked on what it loaded."""
    from safetensors.torch import load_file

    weights = load_file(f"{model}/model.safetensors")
    layer = ranks[0]["layer"]  # vLLM's layer name is the checkpoint's module name
    conv = weights[f"{layer}.conv1d.weight"].float().reshape(-1, spec.linear_conv_kernel_dim)
    a_log = weights[f"{layer}.A_log"].float()
    key_dim = spec.linear_num_key_heads * spec.linear_key_head_dim
    parts = (key_dim, key_dim, spec.linear_num_value_heads * spec.linear_value_head_dim)
    tp = len(ranks)
    for rank, got in enumerate(ranks):
        rows, start = [], 0
        for width in parts:
            share = width // tp
            rows.append(conv[start + rank * share : start + (rank + 1) * share])
            start += width
        expected_conv = [float(x) for block in rows for x in block.reshape(-1)]
        heads = len(a_log) // tp
        expected_a_log = [float(x) for x in a_log[rank * heads : (rank + 1) * heads]]
        if got["conv_weight"] != expected_conv or got["a_log"] != expected_a_log:
            return False
    return True


def _connector_views(worker: Any, config: Any) -> dict[str, dict[str, Any]]:
    """What ``register_kv_caches`` is handed per layer (vLLM 0.32's ``allocate_kv_cache``): a
    ``[B, H, N, C]`` view of the shared int8 buffer, C in bytes and strides in bytes, viewed as the
    spec's ``dtype`` where it has one (attention) and left int8 where it has not (a Mamba page,
    which vLLM unpacks into conv and SSM tensors only when it binds the layer). Computed with
    vLLM's own ``compute_layer_kv_cache_shape_bytes`` and ``compute_layout_strides``."""
    from vllm.v1.kv_cache_interface import (
        compute_layer_kv_cache_shape_bytes,
        compute_layout_strides,
    )

    layout = worker.vllm_config.cache_config.get_resolved_kv_cache_layout()
    spec_of = {
        name: group.kv_cache_spec for group in config.kv_cache_groups for name in group.layer_names
    }
    views: dict[str, dict[str, Any]] = {}
    for tensor in config.kv_cache_tensors:
        spec = spec_of[tensor.layers[0]]
        shape = compute_layer_kv_cache_shape_bytes(spec, config.num_blocks)
        strides = compute_layout_strides(
            spec,
            config.num_blocks,
            len(tensor.layers),
            layout,
            fixed_strides=(tensor.layer_stride, tensor.block_stride, None, None, None),
        )
        for index, name in enumerate(tensor.layers):
            views[name] = {
                "layout": getattr(layout, "name", str(layout)),
                "byte_offset": tensor.offset + index * tensor.layer_stride,
                "shape_bytes": list(shape),
                "byte_strides_BHNC": list(strides[1:]),
                "dtype": str(getattr(spec, "dtype", "torch.int8")),
            }
    return views


def _plain(fields: dict[str, Any]) -> dict[str, Any]:
    """A dataclass's fields as JSON values (vLLM's ``KVCacheTensor`` changes between releases:
    0.32 places layers by ``layer_stride``/``block_stride``, older ones list ``shared_by``)."""
    return {k: v if isinstance(v, (int, str, bool, list)) else str(v) for k, v in fields.items()}


def serve_colocated(model: str, tensor_parallel_size: int, prompt_tokens: int) -> dict[str, Any]:
    """Serve ``model`` with ``vllm.LLM`` (no connector), generate a few greedy tokens, and return
    the answer, whether the hybrid manager stayed on, and every rank's KV caches."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        tensor_parallel_size=tensor_parallel_size,
        max_model_len=512,
        max_num_seqs=4,
        enforce_eager=True,
        seed=0,
    )
    prompt = {"prompt_token_ids": [(7 * i + 3) % 500 + 5 for i in range(prompt_tokens)]}
    params = SamplingParams(temperature=0.0, max_tokens=8)
    first = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    # Again: the second run hits the prefix cache (state groups cache only aligned prefixes).
    second = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    scheduler_config = llm.llm_engine.vllm_config.scheduler_config
    gdn = [rank for rank in llm.collective_rpc(gdn_rank_weights) if rank]
    return {
        "gdn_rank_weights": gdn,
        "model": model,
        "tensor_parallel_size": tensor_parallel_size,
        "hybrid_manager_on": not scheduler_config.disable_hybrid_kv_cache_manager,
        "cache_block_size": llm.llm_engine.vllm_config.cache_config.block_size,
        "answer": list(first),
        "answer_again": list(second),
        "ranks": llm.collective_rpc(describe_worker_kv_caches),
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Build one model, serve it colocated, print the record as JSON."""
    parser = argparse.ArgumentParser(prog="python -m vllm_ascend_mooncake.launch.tiny_hybrid_model")
    parser.add_argument("model", choices=("qwen3_next", "sliding_window"))
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=150)
    args = parser.parse_args(argv)
    spec: TinySpecBase = (
        TinyQwen3NextModelSpec() if args.model == "qwen3_next" else TinySlidingWindowModelSpec()
    )
    path = build_tiny_model(spec)
    # collective_rpc ships describe_worker_kv_caches to the workers by pickle.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    record = serve_colocated(str(path), args.tp, args.prompt_tokens)
    ranks = record.pop("gdn_rank_weights")
    if isinstance(spec, TinyQwen3NextModelSpec):
        record["gdn_tp_split_as_designed"] = check_gdn_tp_split(spec, str(path), ranks)
    print("HYBRID_RECORD " + json.dumps(record, default=str))


if __name__ == "__main__":
    main()
