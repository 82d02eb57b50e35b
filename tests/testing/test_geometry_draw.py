"""The random-geometry draws: every draw of many seeds is one vLLM CPU can serve here, the same
seed gives the same draw, and the draws cover every value each axis may take."""

from __future__ import annotations

from vam_testing import geometry_draw
from vam_testing.geometry_draw import (
    ARCHITECTURES,
    BLOCK_SIZES,
    CONFIG_HEAD_DIMS,
    DTYPES,
    HEAD_DIMS,
    KV_HEADS,
    LAYERS,
    MAX_RANKS,
    MIN_ATTENTION_HEADS,
    MLA_BLOCK_SIZE,
    QWEN3_NEXT,
    QWEN3_NEXT_ATTENTION_HEADS,
    QWEN3_NEXT_BLOCK_SIZE,
    QWEN3_NEXT_TP_SIZES,
    SLIDING_WINDOWS,
    TP_SIZES,
    GeometryDraw,
    draw_geometry,
    run_seeds,
)
from vllm_ascend_mooncake.launch.tiny_hybrid_model import (
    FULL,
    SLIDING,
    TinyQwen3NextModelSpec,
    TinySlidingWindowModelSpec,
)
from vllm_ascend_mooncake.launch.tiny_mla_model import TinyMLAModelSpec
from vllm_ascend_mooncake.launch.tiny_model import TinyModelSpec

SEEDS = range(2000)


def test_every_draw_is_servable() -> None:
    for seed in SEEDS:
        draw = draw_geometry(seed)
        try:
            check_servable(draw)
        except (AssertionError, ValueError) as exc:
            raise AssertionError(f"draw {draw}: {exc}") from exc


def check_servable(draw: GeometryDraw) -> None:
    assert draw.prefill_tp in TP_SIZES and draw.decode_tp in TP_SIZES
    assert draw.prefill_tp + draw.decode_tp <= MAX_RANKS
    assert draw.num_layers in LAYERS
    heads = draw.num_attention_heads
    assert heads >= MIN_ATTENTION_HEADS
    assert heads % draw.prefill_tp == 0 and heads % draw.decode_tp == 0
    spec = draw.model_spec()  # validates the model's own rules too
    if draw.is_mla:
        assert isinstance(spec, TinyMLAModelSpec)
        assert draw.dtype == "bfloat16" and spec.latent_size == 576
        assert draw.prefill_block_size == draw.decode_block_size == MLA_BLOCK_SIZE
        return
    if draw.is_qwen3_next:
        check_qwen3_next(draw, spec)
        return
    assert isinstance(spec, TinyModelSpec) and spec.architecture == draw.architecture
    kv = draw.num_kv_heads
    assert kv in KV_HEADS and heads % kv == 0
    for tp in (draw.prefill_tp, draw.decode_tp):
        assert kv % tp == 0 or tp % kv == 0, f"{draw}: vLLM cannot shard {kv} KV heads"
    assert draw.head_dim in HEAD_DIMS and draw.dtype in DTYPES
    assert draw.prefill_block_size in BLOCK_SIZES and draw.decode_block_size in BLOCK_SIZES
    if draw.config_head_dim is not None:  # stated, ignored by vLLM's Qwen2 attention
        assert draw.architecture == "qwen2" and draw.config_head_dim in CONFIG_HEAD_DIMS
        assert draw.config_head_dim != draw.head_dim and draw.hidden_size is None
        assert spec.config(1, 2, 0)["head_dim"] == draw.config_head_dim
        assert spec.hidden == draw.num_attention_heads * draw.head_dim
    if draw.sliding_window is not None:
        check_sliding_window(draw, spec)
    else:
        assert not draw.is_hybrid and not isinstance(spec, TinySlidingWindowModelSpec)
    draft = draw.draft_spec()
    if draft is not None:  # an EAGLE draft of the Llama target, shardable on both sides
        assert draw.architecture == "llama" and draw.draft_kv_heads in KV_HEADS
        assert draw.draft_head_dim in HEAD_DIMS and draft.head_dim == draw.draft_head_dim
        assert draft.hidden == spec.hidden and draft.dtype == spec.dtype
        assert draft.num_attention_heads % draft.num_kv_heads == 0
        assert draft.hidden % draft.num_attention_heads == 0
        for tp in (draw.prefill_tp, draw.decode_tp):
            assert draft.num_kv_heads % tp == 0 or tp % draft.num_kv_heads == 0
            assert draft.num_attention_heads % tp == 0
    else:
        assert draw.draft_kv_heads is None and draw.draft_head_dim is None
    if draw.hidden_size is not None:  # honoured by vLLM's Llama
        assert draw.architecture == "llama" and draw.config_head_dim is None
        assert draw.hidden_size != draw.num_attention_heads * draw.head_dim
        assert spec.config(1, 2, 0)["head_dim"] == draw.head_dim


def check_qwen3_next(draw: GeometryDraw, spec: object) -> None:
    """bfloat16, TP 1 or 2 splitting the KV heads and the GDN heads (never replicated), the
    default tiny model's pages (vLLM then picks 128-token blocks at TP 1 and 2), no draft and no
    disagreeing config."""
    assert isinstance(spec, TinyQwen3NextModelSpec) and draw.is_hybrid
    assert draw.architecture == QWEN3_NEXT and draw.dtype == "bfloat16"
    assert draw.prefill_tp in QWEN3_NEXT_TP_SIZES and draw.decode_tp in QWEN3_NEXT_TP_SIZES
    defaults = TinyQwen3NextModelSpec()
    pages = ("num_kv_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads")
    pages += ("linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")
    for field in pages:
        assert getattr(spec, field) == getattr(defaults, field), field
    assert (draw.num_kv_heads, draw.head_dim) == (spec.num_kv_heads, spec.head_dim)
    for tp in (draw.prefill_tp, draw.decode_tp):
        assert spec.num_kv_heads % tp == 0
        assert spec.linear_num_key_heads % tp == 0 and spec.linear_num_value_heads % tp == 0
        assert spec.num_attention_heads % tp == 0
    assert draw.num_attention_heads in QWEN3_NEXT_ATTENTION_HEADS
    assert draw.prefill_block_size == draw.decode_block_size == QWEN3_NEXT_BLOCK_SIZE
    assert spec.dtype == "bfloat16" and "linear_attention" in spec.layer_types
    assert FULL in spec.layer_types and draw.draft_spec() is None
    assert draw.hidden_size is None and draw.config_head_dim is None
    assert draw.sliding_window is None


def check_sliding_window(draw: GeometryDraw, spec: object) -> None:
    """A bfloat16 Llama whose layers alternate sliding and full attention, its window drawn,
    no draft and no disagreeing config (the Llama axes already checked)."""
    assert isinstance(spec, TinySlidingWindowModelSpec) and draw.is_hybrid
    assert draw.architecture == "llama" and draw.dtype == spec.dtype == "bfloat16"
    low, high = SLIDING_WINDOWS
    assert low <= draw.sliding_window <= high and spec.sliding_window == draw.sliding_window
    assert spec.layer_types[0] == SLIDING and FULL in spec.layer_types
    config = spec.config(1, 2, 0)
    assert config["sliding_window"] == draw.sliding_window
    assert config["layer_types"] == spec.layer_types
    assert draw.draft_kv_heads is None and draw.draft_head_dim is None
    assert draw.hidden_size is None and draw.config_head_dim is None


def test_a_seed_always_draws_the_same_geometry() -> None:
    assert [draw_geometry(s) for s in range(50)] == [draw_geometry(s) for s in range(50)]
    # pinned: a change to the drawing rules must not silently change what a printed seed means
    assert str(draw_geometry(16)) == "seed16-qwen2-l3-h4-kv4-d64-bfloat16-tp4to2-b64to32"
    assert str(draw_geometry(2)) == "seed2-qwen3_next-l3-h4-kv2-d64-bfloat16-tp1to1-b128to128"
    assert str(draw_geometry(4)) == "seed4-llama-l2-h6-kv6-d64-sw85-bfloat16-tp2to2-b32to32"


def test_the_draws_cover_every_value_of_every_axis() -> None:
    draws = [draw_geometry(s) for s in SEEDS]
    grouped = [d for d in draws if not d.is_mla and not d.is_qwen3_next]
    assert {d.architecture for d in draws} == {*ARCHITECTURES, QWEN3_NEXT}
    assert {(d.prefill_tp, d.decode_tp) for d in draws} == {
        (p, d) for p in TP_SIZES for d in TP_SIZES if p + d <= MAX_RANKS
    }
    assert {d.num_kv_heads for d in grouped} == set(KV_HEADS)
    assert {d.head_dim for d in grouped} == set(HEAD_DIMS)
    assert {d.dtype for d in grouped} == set(DTYPES)
    assert {d.num_layers for d in draws} == set(LAYERS)
    assert {(d.prefill_block_size, d.decode_block_size) for d in grouped} == {
        (p, d) for p in BLOCK_SIZES for d in BLOCK_SIZES
    }
    # configs that disagree with their attention, both kinds, beside agreeing ones
    qwen2 = [d for d in grouped if d.architecture == "qwen2"]
    llama = [d for d in grouped if d.architecture == "llama"]
    assert {d.config_head_dim for d in qwen2} == {None, *CONFIG_HEAD_DIMS}
    assert {d.hidden_size is None for d in llama} == {True, False}
    # EAGLE drafts of every KV-head count and head size beside Llama draws without one
    assert {d.draft_kv_heads for d in llama} == {None, *KV_HEADS}
    assert {d.draft_head_dim for d in llama} == {None, *HEAD_DIMS}
    assert {d.draft_kv_heads is None for d in draws if d.architecture != "llama"} == {True}


def test_hybrid_draws_occur_and_cover_their_axes() -> None:
    """Sliding-window Llamas and Qwen3-Nexts at a reasonable rate, every TP pair they may take,
    sliding windows small and large, and long prompts that drop sliding blocks."""
    draws = [draw_geometry(s) for s in SEEDS]
    sliding = [d for d in draws if d.sliding_window is not None]
    qwen3_next = [d for d in draws if d.is_qwen3_next]
    llama = [d for d in draws if d.architecture == "llama"]
    assert 0.15 * len(llama) <= len(sliding) <= 0.35 * len(llama), len(sliding)
    assert 0.08 * len(draws) <= len(qwen3_next) <= 0.18 * len(draws), len(qwen3_next)
    assert {(d.prefill_tp, d.decode_tp) for d in qwen3_next} == {
        (p, d) for p in QWEN3_NEXT_TP_SIZES for d in QWEN3_NEXT_TP_SIZES
    }
    assert {d.num_layers for d in qwen3_next} == set(LAYERS)
    assert {d.num_attention_heads for d in qwen3_next} == set(QWEN3_NEXT_ATTENTION_HEADS)
    assert {(d.prefill_tp, d.decode_tp) for d in sliding} == {
        (p, d) for p in TP_SIZES for d in TP_SIZES if p + d <= MAX_RANKS
    }
    assert {(d.prefill_block_size, d.decode_block_size) for d in sliding} == {
        (p, d) for p in BLOCK_SIZES for d in BLOCK_SIZES
    }
    assert {d.num_kv_heads for d in sliding} == set(KV_HEADS)
    assert {d.head_dim for d in sliding} == set(HEAD_DIMS)
    windows = {d.sliding_window for d in sliding}
    assert min(windows) == SLIDING_WINDOWS[0] and max(windows) == SLIDING_WINDOWS[1]
    # most sliding draws' long prompt lies past the window and a block: blocks are dropped
    dropping = [
        d
        for d in sliding
        if max(d.prompt_lengths())
        > d.sliding_window + max(d.prefill_block_size, d.decode_block_size)
    ]
    assert len(dropping) >= 0.5 * len(sliding), (len(dropping), len(sliding))


def test_run_seeds_reproduce_one_or_draw_fresh_ones(monkeypatch) -> None:
    monkeypatch.delenv(geometry_draw.SEED_ENV_VAR, raising=False)
    monkeypatch.delenv(geometry_draw.DRAWS_ENV_VAR, raising=False)
    assert run_seeds(seed=123) == [123]
    first, second = run_seeds(draws=3), run_seeds(draws=3)
    assert len(first) == 3 and first != second  # different each run
    assert len(run_seeds()) == geometry_draw.DEFAULT_DRAWS
    monkeypatch.setenv(geometry_draw.DRAWS_ENV_VAR, "5")
    assert len(run_seeds()) == 5
    monkeypatch.setenv(geometry_draw.SEED_ENV_VAR, "77")
    assert run_seeds() == [77]
    assert run_seeds(seed=9) == [9]  # the option wins over the environment
