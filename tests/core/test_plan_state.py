"""State groups (GDN conv + SSM) across TP sizes: planned runs applied page to page on simulated
rank memories reproduce, byte for byte, the decode rank's shard of the global state as vLLM
shards it (sharded here independently of :mod:`vllm_ascend_mooncake.core.state_layout`), and
touch nothing else (padding, other blocks, other layers' pages)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from vllm_ascend_mooncake.core.plan_state import (
    component_runs,
    merge_contiguous,
    plan_state_request,
    state_prefill_ranks,
)
from vllm_ascend_mooncake.core.plan_types import PeerPlan, PlanError, PlanOptions
from vllm_ascend_mooncake.core.state_layout import (
    ConvLayout,
    GdnSizes,
    StateLayout,
    StateLayoutError,
    describe_state_page,
    describe_state_tensors,
    gdn_components,
    gdn_rank_shapes,
    replicated_components,
)

SIZES = GdnSizes(num_k_heads=4, head_k_dim=3, num_v_heads=8, head_v_dim=2, conv_kernel=4)
TP_PAIRS = [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)]
LAYERS = 3
NUM_BLOCKS = 5
PADDING = 24  # bytes after the state content in each block
BASE = 4096  # first layer's address in a rank's memory (0 would hide a missing base)


def vllm_conv_shard(conv_sd: np.ndarray, rank: int, tp: int, layout: ConvLayout) -> np.ndarray:
    """Rank ``rank``'s conv state as vLLM shards the global ``(K-1, conv_dim)`` state:
    ``[Q_r | K_r | V_r]`` on the column axis, transposed for DS."""
    key_dim = SIZES.key_dim
    q, k, v = conv_sd[:, :key_dim], conv_sd[:, key_dim : 2 * key_dim], conv_sd[:, 2 * key_dim :]
    parts = [p[:, rank * p.shape[1] // tp : (rank + 1) * p.shape[1] // tp] for p in (q, k, v)]
    shard = np.concatenate(parts, axis=1)
    return shard if layout is ConvLayout.SD else np.ascontiguousarray(shard.T)


def vllm_ssm_shard(ssm: np.ndarray, rank: int, tp: int) -> np.ndarray:
    heads = ssm.shape[0] // tp
    return ssm[rank * heads : (rank + 1) * heads]


@dataclass
class RankMemory:
    """A rank's simulated memory (garbage everywhere to start) and its state layer tables."""

    mem: np.ndarray
    layout: StateLayout
    bases: list[tuple[int, ...]]  # per layer, per component

    def block_start(self, layer: int, component: int, block: int) -> int:
        offset = self.layout.components[component].offset
        return self.bases[layer][component] + block * self.layout.block_stride + offset


def rank_memory(
    rng: np.random.Generator, tp: int, conv_layout: ConvLayout, ssm_dtype: type, form: str
) -> RankMemory:
    conv_shape, ssm_shape = gdn_rank_shapes(SIZES, tp, conv_layout)
    itemsizes = (2, np.dtype(ssm_dtype).itemsize)
    components = gdn_components(
        SIZES,
        tp,
        conv_layout=conv_layout,
        itemsizes=itemsizes,
        engine_shapes=(conv_shape, ssm_shape),
    )
    content = sum(c.nbytes(tp) for c in components)
    page = content + PADDING
    if form == "page":  # vLLM CPU: one int8 view per layer, components at page offsets
        layout = describe_state_page(
            (NUM_BLOCKS, 1, 1, content), (page, content, content, 1), components, tp_size=tp
        )
        bases = [(BASE + i * NUM_BLOCKS * page,) * 2 for i in range(LAYERS)]
        size = BASE + LAYERS * NUM_BLOCKS * page + 512
    else:  # vllm-ascend: one tensor per component, each at its own address
        shapes = [(NUM_BLOCKS, *conv_shape), (NUM_BLOCKS, *ssm_shape)]
        strides = [
            (page // item, *[int(np.prod(shape[i + 1 :])) for i in range(1, len(shape))])
            for shape, item in zip(shapes, itemsizes, strict=True)
        ]
        layout = describe_state_tensors(shapes, strides, itemsizes, components, tp_size=tp)
        area = NUM_BLOCKS * page + 64
        bases = [(BASE + 2 * i * area, BASE + (2 * i + 1) * area + 8) for i in range(LAYERS)]
        size = BASE + 2 * LAYERS * area + 512
    assert page % 4 == 0 and page % np.dtype(ssm_dtype).itemsize == 0
    mem = rng.integers(0, 256, size, dtype=np.uint8)
    return RankMemory(mem, layout, bases)


def write_state(
    memory: RankMemory,
    layer: int,
    block: int,
    rank: int,
    conv_sd: np.ndarray,
    ssm: np.ndarray,
    conv_layout: ConvLayout,
) -> None:
    """Write rank ``rank``'s shard of a global state into a block, as the engine would."""
    tp = memory.layout.tp_size
    shards = (vllm_conv_shard(conv_sd, rank, tp, conv_layout), vllm_ssm_shard(ssm, rank, tp))
    for c, shard in enumerate(shards):
        data = np.ascontiguousarray(shard).view(np.uint8).ravel()
        start = memory.block_start(layer, c, block)
        memory.mem[start : start + len(data)] = data


def apply_plan(plans: list[PeerPlan], decode: RankMemory, prefill: dict[int, RankMemory]) -> int:
    """Run every descriptor; return the bytes written, asserting none is written twice."""
    written = np.zeros(len(decode.mem), dtype=np.int32)
    for plan in plans:
        source = prefill[plan.prefill_rank].mem
        for batch in plan.batches:
            for local, remote, length in zip(
                batch.local_addrs, batch.remote_addrs, batch.lengths, strict=True
            ):
                decode.mem[local : local + length] = source[remote : remote + length]
                written[local : local + length] += 1
    assert written.max() <= 1
    return int(written.sum())


def random_state(rng: np.random.Generator, ssm_dtype: type) -> tuple[np.ndarray, np.ndarray]:
    conv = rng.integers(0, 2**16, (SIZES.conv_kernel - 1, SIZES.conv_dim), dtype=np.uint16)
    ssm_shape = (SIZES.num_v_heads, SIZES.head_v_dim, SIZES.head_k_dim)
    ssm = rng.integers(0, np.iinfo(ssm_dtype).max, ssm_shape, dtype=ssm_dtype)
    return conv, ssm


@pytest.mark.parametrize("prefill_tp, decode_tp", TP_PAIRS)
@pytest.mark.parametrize("conv_layout", list(ConvLayout))
@pytest.mark.parametrize("ssm_dtype", [np.uint16, np.uint32])
@pytest.mark.parametrize("form", ["page", "tensors"])
def test_planned_runs_rebuild_decode_shards_exactly(
    prefill_tp: int, decode_tp: int, conv_layout: ConvLayout, ssm_dtype: type, form: str
) -> None:
    rng = np.random.default_rng([prefill_tp, decode_tp, len(conv_layout.value), form == "page"])
    states = {
        (layer, block): random_state(rng, ssm_dtype)
        for layer in range(LAYERS)
        for block in range(NUM_BLOCKS)
    }
    prefill = {}
    for p in range(prefill_tp):
        prefill[p] = rank_memory(rng, prefill_tp, conv_layout, ssm_dtype, form)
        for (layer, block), (conv, ssm) in states.items():
            write_state(prefill[p], layer, block, p, conv, ssm, conv_layout)
    block_pairs = [(3, 1), (0, 4)]  # (decode block, prefill block); others left alone
    for d in range(decode_tp):
        decode = rank_memory(rng, decode_tp, conv_layout, ssm_dtype, form)
        expected = RankMemory(decode.mem.copy(), decode.layout, decode.bases)
        for layer in range(LAYERS):
            for d_block, p_block in block_pairs:
                conv, ssm = states[(layer, p_block)]
                write_state(expected, layer, d_block, d, conv, ssm, conv_layout)
        options = PlanOptions(max_descriptors_per_batch=5)
        plans = plan_state_request(
            decode.layout,
            d,
            decode.bases,
            prefill[0].layout,
            {p: m.bases for p, m in prefill.items()},
            block_pairs,
            options=options,
        )
        ranks = tuple(p.prefill_rank for p in plans)
        if prefill_tp > decode_tp:
            per = prefill_tp // decode_tp
            assert ranks == tuple(range(d * per, (d + 1) * per))
        else:
            assert ranks == (d * prefill_tp // decode_tp,)
        assert all(1 <= len(b) <= 5 for p in plans for b in p.batches)
        written = apply_plan(plans, decode, prefill)
        content = sum(c.nbytes(decode_tp) for c in decode.layout.components)
        assert written == LAYERS * len(block_pairs) * content
        np.testing.assert_array_equal(decode.mem, expected.mem)


@pytest.mark.parametrize("prefill_tp, decode_tp", TP_PAIRS)
def test_replicated_state_is_copied_whole_from_the_seeded_rank(
    prefill_tp: int, decode_tp: int
) -> None:
    rng = np.random.default_rng([prefill_tp, decode_tp])
    shapes, itemsizes = ((3, 10), (2, 4, 4)), (2, 4)
    components = replicated_components(shapes, itemsizes)
    content = sum(c.nbytes(1) for c in components)
    page = content + PADDING

    def memory(tp: int) -> RankMemory:
        layout = describe_state_page(
            (NUM_BLOCKS, 1, 1, content), (page, content, content, 1), components, tp_size=tp
        )
        bases = [(BASE + i * NUM_BLOCKS * page,) * 2 for i in range(LAYERS)]
        mem = rng.integers(0, 256, BASE + LAYERS * NUM_BLOCKS * page + 64, dtype=np.uint8)
        return RankMemory(mem, layout, bases)

    pages = {
        (layer, b): rng.integers(0, 256, content, dtype=np.uint8)
        for layer in range(LAYERS)
        for b in range(NUM_BLOCKS)
    }
    prefill = {p: memory(prefill_tp) for p in range(prefill_tp)}
    for m in prefill.values():
        for (layer, block), data in pages.items():
            start = m.block_start(layer, 0, block)
            m.mem[start : start + content] = data
    seed = 7
    for d in range(decode_tp):
        decode = memory(decode_tp)
        expected = decode.mem.copy()
        for layer in range(LAYERS):
            start = decode.block_start(layer, 0, 2)
            expected[start : start + content] = pages[(layer, 0)]
        plans = plan_state_request(
            decode.layout,
            d,
            decode.bases,
            prefill[0].layout,
            {p: m.bases for p, m in prefill.items()},
            [(2, 0)],
            seed=seed,
        )
        assert [p.prefill_rank for p in plans] == [(seed + d) % prefill_tp]
        assert plans[0].num_descriptors == LAYERS  # both components in one run per layer
        assert apply_plan(plans, decode, prefill) == LAYERS * content
        np.testing.assert_array_equal(decode.mem, expected)


def test_tiny_qwen3_next_shapes_and_runs_match_the_recorded_engine() -> None:
    """docs/design/hma.md, section 2: shapes, content bytes, and 9 conv + 1 SSM runs per layer
    for TP 1 -> 2 (SD)."""
    tiny = GdnSizes(num_k_heads=2, head_k_dim=64, num_v_heads=4, head_v_dim=64, conv_kernel=4)
    assert gdn_rank_shapes(tiny, 1, ConvLayout.SD) == ((3, 512), (4, 64, 64))
    assert gdn_rank_shapes(tiny, 2, ConvLayout.SD) == ((3, 256), (2, 64, 64))
    layouts = {}
    for tp, content, page, conv_bytes in ((1, 35840, 65536, 3072), (2, 17920, 32768, 1536)):
        components = gdn_components(tiny, tp, conv_layout=ConvLayout.SD, itemsizes=(2, 2))
        assert components[1].offset == conv_bytes
        layouts[tp] = describe_state_page(
            (100, 1, 1, content), (page, content, content, 1), components, tp_size=tp
        )
    for d in range(2):
        conv = component_runs(layouts[2], d, layouts[1], 0, 0)
        ssm = component_runs(layouts[2], d, layouts[1], 0, 1)
        assert (len(conv.lengths), len(ssm.lengths)) == (9, 1)
        assert ssm.lengths.tolist() == [2 * 64 * 64 * 2]
        assert ssm.remote.tolist() == [d * 2 * 64 * 64 * 2]
        plans = plan_state_request(layouts[2], d, [(0, 0)], layouts[1], {0: [(0, 0)]}, [(1, 1)])
        assert plans[0].num_descriptors == 10


def test_equal_tp_moves_one_run_per_layer_and_block() -> None:
    """Same TP: conv and SSM are contiguous on both sides, so one descriptor per page content."""
    components = gdn_components(SIZES, 2, conv_layout=ConvLayout.DS, itemsizes=(2, 4))
    content = sum(c.nbytes(2) for c in components)
    strides = (content + 64, content, content, 1)
    layout = describe_state_page((8, 1, 1, content), strides, components, tp_size=2)
    plans = plan_state_request(layout, 1, [(0, 0)], layout, {1: [(9000, 9000)]}, [(3, 5)])
    batch = plans[0].batches[0]
    assert [p.prefill_rank for p in plans] == [1]
    assert batch.local_addrs.tolist() == [3 * (content + 64)]
    assert batch.remote_addrs.tolist() == [9000 + 5 * (content + 64)]
    assert batch.lengths.tolist() == [content]


def test_merge_contiguous_needs_both_sides_contiguous() -> None:
    local = np.array([0, 10, 20, 40])
    remote = np.array([100, 110, 130, 160])
    lengths = np.array([10, 10, 20, 5])
    merged = merge_contiguous(local, remote, lengths)
    assert [m.tolist() for m in merged] == [[0, 20, 40], [100, 130, 160], [20, 20, 5]]


@pytest.mark.parametrize("tp", [3, 8])
def test_tp_that_does_not_divide_the_heads_is_refused(tp: int) -> None:
    with pytest.raises(StateLayoutError, match=f"TP size {tp} does not divide the GDN"):
        gdn_components(SIZES, tp, conv_layout=ConvLayout.SD, itemsizes=(2, 2))


@pytest.mark.parametrize(
    "engine_shapes",
    [
        ((20, 3), (4, 2, 3)),  # the DS conv layout where the config says SD
        ((3, 20), (4, 3, 2)),  # SSM head dims swapped
        ((3, 40), (8, 2, 3)),  # the TP 1 shapes
        ((3, 20),),  # no SSM state
    ],
)
def test_engine_shapes_that_differ_from_the_config_are_refused(engine_shapes) -> None:
    assert gdn_rank_shapes(SIZES, 2, ConvLayout.SD) == ((3, 20), (4, 2, 3))
    with pytest.raises(StateLayoutError, match="differ from"):
        gdn_components(
            SIZES, 2, conv_layout=ConvLayout.SD, itemsizes=(2, 2), engine_shapes=engine_shapes
        )


def test_page_views_that_do_not_hold_the_components_are_refused() -> None:
    components = gdn_components(SIZES, 1, conv_layout=ConvLayout.SD, itemsizes=(2, 2))
    content = sum(c.nbytes(1) for c in components)
    with pytest.raises(StateLayoutError, match="does not hold"):
        describe_state_page((4, 1, 1, content + 2), (512, 1, 1, 1), components, tp_size=1)
    with pytest.raises(StateLayoutError, match="expected a state page view"):
        describe_state_page((4, 2, 1, content), (512, 1, 1, 1), components, tp_size=1)
    with pytest.raises(StateLayoutError, match="past the block stride"):
        describe_state_page((4, 1, 1, content), (content - 2, 1, 1, 1), components, tp_size=1)
    shapes = [(4, 3, 40), (4, 8, 2, 3)]
    fits = describe_state_tensors(
        shapes, [(256, 40, 1), (256, 6, 3, 1)], (2, 2), components, tp_size=1
    )
    assert (fits.block_stride, [c.offset for c in fits.components]) == (512, [0, 0])
    with pytest.raises(StateLayoutError, match="not the"):
        describe_state_tensors(
            shapes, [(256, 40, 1), (256, 6, 1, 2)], (2, 2), components, tp_size=1
        )
    with pytest.raises(StateLayoutError, match="block stride"):
        describe_state_tensors(
            shapes, [(256, 40, 1), (256, 6, 3, 1)], (2, 4), components, tp_size=1
        )


def test_unpairable_layouts_and_bad_tables_are_refused() -> None:
    def layout(conv_layout: ConvLayout, tp: int) -> StateLayout:
        components = gdn_components(SIZES, tp, conv_layout=conv_layout, itemsizes=(2, 2))
        return StateLayout(tp, 4, 1024, components)

    sd, ds = layout(ConvLayout.SD, 2), layout(ConvLayout.DS, 2)
    tables = {0: [(0, 0)], 1: [(0, 0)]}
    with pytest.raises(PlanError, match="not shards of the same state"):
        plan_state_request(sd, 0, [(0, 0)], ds, tables, [(0, 0)])
    with pytest.raises(PlanError, match="block id 4 is outside"):
        plan_state_request(sd, 0, [(0, 0)], sd, tables, [(0, 4)])
    with pytest.raises(PlanError, match="repeat"):
        plan_state_request(sd, 0, [(0, 0)], sd, tables, [(1, 0), (1, 2)])
    with pytest.raises(PlanError, match="no state base addresses for prefill rank 1"):
        plan_state_request(sd, 1, [(0, 0)], sd, {0: [(0, 0)]}, [(0, 0)])
    with pytest.raises(PlanError, match="1 state layers, the decode rank 2"):
        plan_state_request(sd, 0, [(0, 0), (0, 0)], sd, tables, [(0, 0)])
    with pytest.raises(PlanError, match="decode rank 2 is outside"):
        state_prefill_ranks(sd, 2, sd)
