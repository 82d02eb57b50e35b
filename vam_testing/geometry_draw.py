"""Seeded random P/D geometries: a model and a topology nobody picked, reproducible from a seed.

The end-to-end suite names its geometries; this module draws others, so that correctness does not
rest on the ones someone chose. One seed gives one :class:`GeometryDraw`: an architecture (Llama,
Qwen2 or a DeepSeek-V2 with MLA), its KV heads, head size, layers and dtype, the prefill and decode
TP sizes and each side's block size. Every draw is one vLLM CPU can serve on a 2-core, 24 GiB
machine:

* TP sizes 1, 2 or 4 on each side, at most :data:`MAX_RANKS` ranks in all (a TP 4 instance takes
  about 8 GiB here);
* KV heads 1-8 that vLLM can shard at both TP sizes (a TP size divides the KV heads or the KV
  heads divide it, the latter replicating heads); attention heads the least multiple of the KV
  heads and both TP sizes, at least :data:`MIN_ATTENTION_HEADS`;
* head_dim 64 or 128 (vLLM CPU attention sizes), layers 2-4, float32 or bfloat16;
* a config that disagrees with its attention, half the time (issue #44): a Qwen2 whose config
  states a ``head_dim`` its vLLM attention ignores (it computes ``hidden_size // heads``), or a
  Llama whose ``hidden_size`` is not ``heads x head_dim`` (vLLM honours its ``head_dim``). These
  are drawn from a second generator of the seed, so the other axes of a printed seed keep
  their meaning;
* an EAGLE draft model beside a Llama target, half the time (issue #44): its own KV heads (any
  vLLM can shard at both TP sizes and whose attention heads split the model's hidden size, the
  model's count included) and head size, so that the
  engines' KV caches end with a layer of another head group or head size; drawn from a third
  generator of the seed;
* block sizes 32, 64 or 128 per side, mixed (vLLM CPU's chunk packing is known, so blocks are cut
  by token). MLA models are bfloat16 (vLLM CPU's MLA backends need it) with DeepSeek-V2's real
  latent (576 elements) and block size 32 on both sides: vLLM CPU's MLA backends take no other
  (CPU_MLA forces 16, AMX_MLA takes 32);
* hybrid models, served with vLLM's hybrid KV cache manager (issue #45), both bfloat16 (vLLM
  CPU serves neither in float32 here) and neither with an EAGLE draft or a disagreeing config:

  - a sliding-window Llama (:class:`TinySlidingWindowModelSpec`: layers alternating sliding and
    full attention, a window of :data:`SLIDING_WINDOWS` tokens) in a quarter of the Llama
    draws. The draw keeps the Llama draw's KV heads, head size, layers, TP sizes and block
    sizes (so a printed seed's other axes keep their meaning) and only its dtype becomes
    bfloat16; prompts past the window plus a block drop sliding blocks (the long prompt of most
    draws);
  - a Qwen3-Next (:class:`TinyQwen3NextModelSpec`: Gated DeltaNet layers and full attention)
    in :data:`QWEN3_NEXT_FRACTION` of all draws, which it replaces. Its TP sizes are 1 or 2
    (they split its two KV heads and its two linear key / four value heads; GDN heads are
    never replicated) and its attention pages stay the default tiny model's (two KV heads of
    64, linear heads 2/4 of 64): vLLM picks a Qwen3-Next's block size itself, so that an
    attention page holds a state page, and for that geometry it is
    :data:`QWEN3_NEXT_BLOCK_SIZE` at TP 1 and 2 (docs/design/hma.md); the draw passes it on
    both sides. Layers and attention heads (which change no page) are drawn.

  Both are drawn from generators of their own (``random.Random`` of ``"sliding-<seed>"`` and
  ``"qwen3-next-<seed>"``), not by adding to :data:`ARCHITECTURES`, which would change the
  architecture, and so every other axis, of most existing seeds: a seed that draws neither means
  what it meant before.

No I/O, no vLLM: tests/testing checks every draw of many seeds against these rules.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
from dataclasses import dataclass

from vllm_ascend_mooncake.launch.tiny_draft_model import TinyEagleDraftSpec
from vllm_ascend_mooncake.launch.tiny_hybrid_model import (
    TinyQwen3NextModelSpec,
    TinySlidingWindowModelSpec,
)
from vllm_ascend_mooncake.launch.tiny_mla_model import TinyMLAModelSpec
from vllm_ascend_mooncake.launch.tiny_model import TinyModelSpec

ARCHITECTURES = ("llama", "qwen2", "deepseek_mla")
TP_SIZES = (1, 2, 4)
#: prefill + decode ranks: TP 4 + TP 2 fits 24 GiB beside the test; TP 4 + TP 4 does not
MAX_RANKS = 6
KV_HEADS = tuple(range(1, 9))
HEAD_DIMS = (64, 128)
LAYERS = (2, 3, 4)
DTYPES = ("float32", "bfloat16")
BLOCK_SIZES = (32, 64, 128)
#: vLLM CPU's MLA backends: AMX_MLA takes 32-token blocks, CPU_MLA forces 16 whatever is asked
MLA_BLOCK_SIZE = 32
#: hybrid draws: the share of Llama draws made sliding-window ones, their windows (tokens), the
#: share of all draws made Qwen3-Next ones, its TP sizes, attention heads and block size
SLIDING_FRACTION = 0.25
SLIDING_WINDOWS = (16, 128)
QWEN3_NEXT = "qwen3_next"
QWEN3_NEXT_FRACTION = 0.125
QWEN3_NEXT_TP_SIZES = (1, 2)
QWEN3_NEXT_ATTENTION_HEADS = (4, 8)
QWEN3_NEXT_BLOCK_SIZE = 128
HYBRID_DTYPE = "bfloat16"
#: fewer query heads than this make the tiny model's attention too coarse to tell KV apart
MIN_ATTENTION_HEADS = 4

#: The environment variables a run's draws come from (the pytest options override them).
SEED_ENV_VAR = "VAM_GEOMETRY_SEED"
DRAWS_ENV_VAR = "VAM_GEOMETRY_DRAWS"
DEFAULT_DRAWS = 3
#: What a Qwen2 draw's config may state as its ``head_dim`` while the attention uses another.
CONFIG_HEAD_DIMS = (32, 64, 128)


#: The text a draw's prompts are cut from (as the served model's token ids: at least
#: :data:`LONGEST_PROMPT` of them with the tiny models' tokenizer).
PROMPT_TEXT = " ".join(f"word{i} the quick brown fox jumps over {i} lazy dogs" for i in range(60))
LONGEST_PROMPT = 400


@dataclass(frozen=True)
class GeometryDraw:
    """One drawn P/D deployment. ``num_kv_heads`` and ``head_dim`` are ``None`` for MLA, whose
    KV cache is one latent per token, replicated on every rank."""

    seed: int
    architecture: str
    num_layers: int
    dtype: str
    num_attention_heads: int
    num_kv_heads: int | None
    head_dim: int | None
    prefill_tp: int
    decode_tp: int
    prefill_block_size: int
    decode_block_size: int
    #: Llama: a hidden size other than heads x head_dim (None: that product)
    hidden_size: int | None = None
    #: Qwen2: the head_dim its config states and its attention ignores (None: none stated)
    config_head_dim: int | None = None
    #: Llama: an EAGLE draft model's total KV heads and head size (None: no draft model)
    draft_kv_heads: int | None = None
    draft_head_dim: int | None = None
    #: Llama: the sliding window of its sliding-window layers (None: full attention only)
    sliding_window: int | None = None

    @property
    def is_mla(self) -> bool:
        return self.architecture == "deepseek_mla"

    @property
    def is_qwen3_next(self) -> bool:
        return self.architecture == QWEN3_NEXT

    @property
    def is_hybrid(self) -> bool:
        """Served with several KV cache groups (vLLM's hybrid manager): prefill computes the
        prompt but its last token, decode computes that one."""
        return self.is_qwen3_next or self.sliding_window is not None

    def model_spec(
        self,
    ) -> TinyModelSpec | TinyMLAModelSpec | TinySlidingWindowModelSpec | TinyQwen3NextModelSpec:
        """The tiny model to build; its weights are seeded by the draw's seed too."""
        weights_seed = self.seed % 2**31
        if self.is_qwen3_next:
            return TinyQwen3NextModelSpec(
                num_layers=self.num_layers,
                num_attention_heads=self.num_attention_heads,
                dtype=self.dtype,
                seed=weights_seed,
            )
        if self.sliding_window is not None:
            assert self.num_kv_heads is not None and self.head_dim is not None
            return TinySlidingWindowModelSpec(
                num_layers=self.num_layers,
                num_attention_heads=self.num_attention_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                dtype=self.dtype,
                seed=weights_seed,
                sliding_window=self.sliding_window,
            )
        if self.is_mla:
            return TinyMLAModelSpec(
                num_layers=self.num_layers,
                num_attention_heads=self.num_attention_heads,
                dtype=self.dtype,
                seed=weights_seed,
            )
        assert self.num_kv_heads is not None and self.head_dim is not None
        return TinyModelSpec(
            architecture=self.architecture,
            num_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            hidden_size=self.hidden_size,
            config_head_dim=self.config_head_dim,
            dtype=self.dtype,
            seed=weights_seed,
        )

    def draft_spec(self) -> TinyEagleDraftSpec | None:
        """The EAGLE draft model to serve beside the model (None: none), seeded by the draw."""
        if self.draft_kv_heads is None or self.draft_head_dim is None:
            return None
        model = self.model_spec()
        assert isinstance(model, TinyModelSpec)
        return TinyEagleDraftSpec.for_target(
            model,
            num_attention_heads=_attention_heads(
                self.draft_kv_heads, self.prefill_tp, self.decode_tp
            ),
            num_kv_heads=self.draft_kv_heads,
            head_dim=self.draft_head_dim,
            seed=(self.seed + 1) % 2**31,
        )

    def prompt_lengths(self) -> list[int]:
        """A short prompt, one whose last token starts a new block of the larger size (the pull
        then covers whole blocks only) and a long one spanning many blocks, from the seed."""
        rng = random.Random(self.seed)
        larger = max(self.prefill_block_size, self.decode_block_size)
        if self.is_qwen3_next:
            # one token past whole blocks: the reference (decode's own answer, prefix-cached)
            # then takes P/D's path, the cached blocks' state and the last token alone; a
            # prompt computed in one piece differs by GDN's chunked kernel alone (up to 1.0 in
            # bf16 logprobs, tests/e2e/test_hybrid_models.py)
            return [larger + 1, rng.choice((2, 3)) * larger + 1]
        return [rng.randint(2, 31), larger + 1, rng.randint(larger + 2, LONGEST_PROMPT)]

    def __str__(self) -> str:
        heads = "latent576" if self.is_mla else f"kv{self.num_kv_heads}-d{self.head_dim}"
        if self.hidden_size is not None:
            heads += f"-hidden{self.hidden_size}"
        if self.config_head_dim is not None:
            heads += f"-cfgd{self.config_head_dim}"
        if self.draft_kv_heads is not None:
            heads += f"-eagle-kv{self.draft_kv_heads}-d{self.draft_head_dim}"
        if self.sliding_window is not None:
            heads += f"-sw{self.sliding_window}"
        return (
            f"seed{self.seed}-{self.architecture}-l{self.num_layers}-h{self.num_attention_heads}"
            f"-{heads}-{self.dtype}-tp{self.prefill_tp}to{self.decode_tp}"
            f"-b{self.prefill_block_size}to{self.decode_block_size}"
        )


def negative_control_prompt(prompt: list[int]) -> list[int]:
    """A prompt as long as ``prompt`` with a third of its tokens changed (its last 8 kept): fed
    ``prompt`` with this one's KV, decode must continue this one."""
    other = list(prompt)
    for i in range(4, len(other) - 8, 3):
        other[i] = 3 + (other[i] + 1) % 400
    return other


def shardable(num_kv_heads: int, tp: int) -> bool:
    """vLLM's rule: TP splits the KV heads evenly, or replicates each over ``tp / heads`` ranks."""
    return num_kv_heads % tp == 0 or tp % num_kv_heads == 0


def draw_geometry(seed: int) -> GeometryDraw:
    """The geometry of ``seed`` (the same on every machine and Python version: ``random.Random``
    with an int or str seed is stable)."""
    qwen3_next = _qwen3_next(seed)
    if qwen3_next is not None:
        return qwen3_next
    rng = random.Random(seed)
    architecture = rng.choice(ARCHITECTURES)
    prefill_tp, decode_tp = rng.choice(
        [(p, d) for p in TP_SIZES for d in TP_SIZES if p + d <= MAX_RANKS]
    )
    num_layers = rng.choice(LAYERS)
    if architecture == "deepseek_mla":
        heads = _attention_heads(1, prefill_tp, decode_tp)
        return GeometryDraw(
            seed=seed,
            architecture=architecture,
            num_layers=num_layers,
            dtype="bfloat16",
            num_attention_heads=heads,
            num_kv_heads=None,
            head_dim=None,
            prefill_tp=prefill_tp,
            decode_tp=decode_tp,
            prefill_block_size=MLA_BLOCK_SIZE,
            decode_block_size=MLA_BLOCK_SIZE,
        )
    kv_heads = rng.choice(
        [n for n in KV_HEADS if shardable(n, prefill_tp) and shardable(n, decode_tp)]
    )
    draw = GeometryDraw(
        seed=seed,
        architecture=architecture,
        num_layers=num_layers,
        dtype=rng.choice(DTYPES),
        num_attention_heads=_attention_heads(kv_heads, prefill_tp, decode_tp),
        num_kv_heads=kv_heads,
        head_dim=rng.choice(HEAD_DIMS),
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        prefill_block_size=rng.choice(BLOCK_SIZES),
        decode_block_size=rng.choice(BLOCK_SIZES),
    )
    sliding = _as_sliding_window(draw)
    if sliding is not None:
        return sliding
    return _with_draft(_with_disagreeing_config(draw))


def _qwen3_next(seed: int) -> GeometryDraw | None:
    """A Qwen3-Next draw in :data:`QWEN3_NEXT_FRACTION` of the seeds (see the module docstring),
    from a generator of its own; None for the others."""
    rng = random.Random(f"qwen3-next-{seed}")
    if rng.random() >= QWEN3_NEXT_FRACTION:
        return None
    prefill_tp, decode_tp = rng.choice(
        [(p, d) for p in QWEN3_NEXT_TP_SIZES for d in QWEN3_NEXT_TP_SIZES]
    )
    defaults = TinyQwen3NextModelSpec()
    return GeometryDraw(
        seed=seed,
        architecture=QWEN3_NEXT,
        num_layers=rng.choice(LAYERS),
        dtype=HYBRID_DTYPE,
        num_attention_heads=rng.choice(QWEN3_NEXT_ATTENTION_HEADS),
        num_kv_heads=defaults.num_kv_heads,
        head_dim=defaults.head_dim,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        prefill_block_size=QWEN3_NEXT_BLOCK_SIZE,
        decode_block_size=QWEN3_NEXT_BLOCK_SIZE,
    )


def _as_sliding_window(draw: GeometryDraw) -> GeometryDraw | None:
    """:data:`SLIDING_FRACTION` of the Llama draws as sliding-window ones, bfloat16, with a window
    from a generator of their own (see the module docstring); None for the others."""
    rng = random.Random(f"sliding-{draw.seed}")
    if draw.architecture != "llama" or rng.random() >= SLIDING_FRACTION:
        return None
    return dataclasses.replace(
        draw, dtype=HYBRID_DTYPE, sliding_window=rng.randint(*SLIDING_WINDOWS)
    )


def _with_draft(draw: GeometryDraw) -> GeometryDraw:
    """Half the Llama draws get an EAGLE draft model (see the module docstring), from a
    generator of its own."""
    rng = random.Random(f"draft-{draw.seed}")
    if draw.architecture != "llama" or rng.random() < 0.5:
        return draw
    hidden = draw.model_spec().hidden
    kv_heads = rng.choice(
        [
            n
            for n in KV_HEADS
            if shardable(n, draw.prefill_tp)
            and shardable(n, draw.decode_tp)
            # transformers' config check: the hidden size splits over the attention heads
            and hidden % _attention_heads(n, draw.prefill_tp, draw.decode_tp) == 0
        ]
    )
    return dataclasses.replace(draw, draft_kv_heads=kv_heads, draft_head_dim=rng.choice(HEAD_DIMS))


def _with_disagreeing_config(draw: GeometryDraw) -> GeometryDraw:
    """Half the time, a config that disagrees with the attention (see the module docstring),
    from a generator of its own (``random.Random`` of a str is stable too)."""
    rng = random.Random(f"config-{draw.seed}")
    if rng.random() < 0.5:
        return draw
    assert draw.head_dim is not None
    if draw.architecture == "qwen2":
        stated = rng.choice([d for d in CONFIG_HEAD_DIMS if d != draw.head_dim])
        return dataclasses.replace(draw, config_head_dim=stated)
    width = draw.num_attention_heads * draw.head_dim
    return dataclasses.replace(draw, hidden_size=rng.choice((width // 2, 2 * width)))


def _attention_heads(kv_heads: int, prefill_tp: int, decode_tp: int) -> int:
    """The least head count that is a multiple of the KV heads and of both TP sizes, raised to at
    least :data:`MIN_ATTENTION_HEADS` by a whole factor."""
    heads = math.lcm(kv_heads, prefill_tp, decode_tp)
    return heads * math.ceil(MIN_ATTENTION_HEADS / heads)


def run_seeds(seed: int | None = None, draws: int | None = None) -> list[int]:
    """The seeds of this run's draws: ``seed`` alone (reproducing one draw), else ``draws`` seeds
    from a fresh random base, different each run. ``None`` reads :data:`SEED_ENV_VAR` and
    :data:`DRAWS_ENV_VAR`."""
    if seed is None and os.environ.get(SEED_ENV_VAR):
        seed = int(os.environ[SEED_ENV_VAR])
    if seed is not None:
        return [seed]
    if draws is None:
        draws = int(os.environ.get(DRAWS_ENV_VAR) or DEFAULT_DRAWS)
    base = random.Random(int.from_bytes(os.urandom(8), "little"))
    return [base.randrange(1, 10**9) for _ in range(draws)]
