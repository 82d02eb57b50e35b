"""Different block sizes on prefill and decode: plans reproduce the reference, token by token.

The simulator (:mod:`vam_testing.plan_simulator`, shared with the equal-size
tests) checks token by token: token ``t`` of the prompt sits in a side's ``t // B``-th block at
slot ``t % B``, whatever the other side's block size.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from vam_testing.kv_reference import (
    LAYOUT_KINDS,
    cpu_like_packing,
    owned_heads,
    region_layouts,
)
from vam_testing.plan_simulator import (
    PullCase,
    cdiv,
    draw_block_ids,
    simulate_pull,
)
from vllm_ascend_mooncake.core.layout import (
    BlockOrder,
    LayoutError,
    Region,
    RegionLayout,
    check_pairable,
    effective_order,
    packing_text,
)
from vllm_ascend_mooncake.core.plan import (
    PlanError,
    PlanOptions,
    RequestPlan,
    StagingArea,
    plan_request,
)
from vllm_ascend_mooncake.core.plan_tokens import align_tokens
from vllm_ascend_mooncake.core.topology import TopologyError, TransferTopology


def prompt_case(
    *,
    num_tokens: int,
    cached_blocks: int,
    extra_blocks: int = 2,
    id_style: str = "shuffled",
    **fields,
) -> PullCase:
    """A pull of a ``num_tokens`` prompt of which decode caches ``cached_blocks`` blocks, its
    block ids drawn (``id_style``) from tables ``extra_blocks`` larger than needed."""
    rng = np.random.default_rng(fields.get("seed", 0) + 1)
    prefill_count = cdiv(num_tokens, fields["prefill_block"])
    local_count = cdiv(num_tokens, fields["decode_block"]) - cached_blocks
    remote_total = prefill_count + extra_blocks
    local_total = max(local_count, 1) + extra_blocks
    return PullCase(
        num_tokens=num_tokens,
        remote_ids=draw_block_ids(rng, prefill_count, remote_total, id_style),
        local_ids=draw_block_ids(rng, local_count, local_total, id_style),
        remote_blocks=remote_total,
        local_blocks=local_total,
        **fields,
    )


def simulate_or_refuse(case: PullCase, decode_rank: int) -> RequestPlan | None:
    """:func:`simulate_pull`, except that different block sizes with head-major blocks of
    unknown packing must be refused."""
    num_heads = 1 if case.is_mla else case.heads

    def first_layout(tp: int, rank: int, block: int) -> RegionLayout:
        heads = len(owned_heads(num_heads, tp, rank, case.is_mla))
        return region_layouts(
            case.kind,
            1,
            heads,
            block,
            case.head_token_bytes,
            1,
            0,
            case.flip_single_head,
            case.token_unit,
        )[0]

    local = first_layout(case.decode_tp, decode_rank, case.decode_block)
    remote = first_layout(case.prefill_tp, 0, case.prefill_block)
    if (
        case.prefill_block != case.decode_block
        and effective_order(local, remote) is BlockOrder.HEAD_MAJOR
        and not (local.packing and remote.packing)
    ):
        with pytest.raises(LayoutError, match="with head-major blocks whose packing is unknown"):
            simulate_pull(case, decode_rank)
        return None
    return simulate_pull(case, decode_rank)


@st.composite
def cases(draw) -> tuple[PullCase, int]:
    kind = draw(st.sampled_from(LAYOUT_KINDS))
    heads = 1 if kind == "latent" else draw(st.sampled_from([1, 2, 4, 8]))
    prefill_tp = draw(st.sampled_from([1, 2, 4, 8]))
    decode_tp = draw(st.sampled_from([1, 2, 4, 8]))
    try:
        TransferTopology(heads, prefill_tp, decode_tp, is_mla=kind == "latent")
    except TopologyError:
        assume(False)
    base = draw(st.sampled_from([1, 2, 3]))
    ratio = draw(st.sampled_from([1, 2, 4]))
    decode_larger = draw(st.booleans())
    prefill_block, decode_block = (base, base * ratio) if decode_larger else (base * ratio, base)
    num_tokens = draw(st.integers(1, 40))
    smaller = min(prefill_block, decode_block)
    token_unit = draw(st.sampled_from([u for u in (1, 2, 3, 4) if smaller % u == 0]))
    decode_blocks = cdiv(num_tokens, decode_block)
    # a larger prefill block needs the prompt length to know how many decode blocks it fills
    tell_planner = draw(st.booleans()) if decode_block >= prefill_block else True
    case = prompt_case(
        heads=heads,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        kind=kind,
        prefill_block=prefill_block,
        decode_block=decode_block,
        num_tokens=num_tokens,
        cached_blocks=draw(st.integers(0, decode_blocks)),
        num_layers=draw(st.integers(1, 2)),
        head_token_bytes=draw(st.sampled_from([1, 2, 4, 6])),
        extra_blocks=draw(st.integers(0, 4)),
        id_style=draw(st.sampled_from(["contiguous", "sorted", "shuffled"])),
        prefill_pad=draw(st.sampled_from([0, 0, 16])),
        decode_pad=draw(st.sampled_from([0, 0, 8])),
        coalesce_runs=draw(st.booleans()),
        cap=draw(st.sampled_from([1, 3, 1024])),
        staging_blocks=draw(st.sampled_from([1, 2, 64])),
        seed=draw(st.integers(0, 2**32)),
        flip_single_head=draw(st.booleans()),
        max_descriptor_bytes=draw(st.sampled_from([0, 0, 7, 64])),
        tell_planner_num_tokens=tell_planner,
        token_unit=token_unit,
    )
    return case, draw(st.integers(0, decode_tp - 1))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_plan_with_different_block_sizes_reproduces_reference_bytes(
    sample: tuple[PullCase, int],
) -> None:
    case, decode_rank = sample
    simulate_or_refuse(case, decode_rank)


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize("tps", [(1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (4, 2), (2, 4)])
@pytest.mark.parametrize("blocks", [(2, 4), (2, 8), (4, 2), (8, 2), (4, 4)])
@pytest.mark.parametrize("cached_blocks", [0, 1])
def test_every_layout_tp_pair_and_ratio(kind, tps, blocks, cached_blocks) -> None:
    prefill_tp, decode_tp = tps
    prefill_block, decode_block = blocks
    case = prompt_case(
        heads=1 if kind == "latent" else 4,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        kind=kind,
        prefill_block=prefill_block,
        decode_block=decode_block,
        num_tokens=29,
        cached_blocks=cached_blocks,
        num_layers=2,
        staging_blocks=3,
        token_unit=2 if kind == "packed_head_major" else 1,
    )
    for decode_rank in range(decode_tp):
        simulate_or_refuse(case, decode_rank)


def test_head_major_blocks_of_unknown_packing_and_different_sizes_are_refused() -> None:
    """A head-major chunk is cut by token only when its packing is known and alike on both
    sides: otherwise (a backend not described in core/packing.py) prefill 32 / decode 64 is
    refused at the handshake, naming the side."""
    topo = TransferTopology(2, 1, 1)
    packed = cpu_like_packing(8, token_unit=2)
    prefill = RegionLayout(BlockOrder.HEAD_MAJOR, 8, 2 * 32 * 8, 2, 32, 8)
    decode = RegionLayout(BlockOrder.HEAD_MAJOR, 8, 2 * 64 * 8, 2, 64, 8)

    def plan(local: RegionLayout, remote: RegionLayout) -> None:
        plan_request(
            topo,
            0,
            0,
            [Region("l0", 1 << 40, local)],
            {0: [Region("l0", 2 << 40, remote)]},
            [5],
            [3, 6],
            num_tokens=50,
            options=PlanOptions(staging=StagingArea(3 << 40, 1 << 20)),
        )

    with pytest.raises(LayoutError, match="32 on prefill vs 64 on decode with head-major blocks"):
        plan(decode, prefill)
    with pytest.raises(LayoutError, match="packing is unknown on prefill"):
        plan(replace(decode, packing=packed), prefill)
    with pytest.raises(LayoutError, match="packed differently"):
        plan(replace(decode, packing=packed), replace(prefill, packing=cpu_like_packing(8)))
    plan(replace(decode, packing=packed), replace(prefill, packing=packed))
    # The refusal names both sides' values and what to change.
    with pytest.raises(LayoutError) as refused:
        check_pairable(replace(decode, packing=packed), prefill)
    message = str(refused.value)
    assert "prefill: unknown, 8 B per head and token" in message
    assert f"decode: {packing_text(packed)}, 8 B" in message
    assert "run both with the same --block-size (32 or 64)" in message
    with pytest.raises(LayoutError, match="unknown on prefill and decode"):
        check_pairable(decode, prefill)
    with pytest.raises(LayoutError, match=r"same dtype, --kv-cache-dtype and attention kernel"):
        check_pairable(
            replace(decode, packing=packed), replace(prefill, packing=cpu_like_packing(8))
        )
    # A packed single-head chunk is not token rows, so it does not pair with token-major blocks;
    # a single head of unknown packing does (both sides run one backend, a token-major one).
    token_major = RegionLayout(BlockOrder.TOKEN_MAJOR, 8, 2 * 64 * 8, 2, 64, 8)
    single = RegionLayout(BlockOrder.HEAD_MAJOR, 8, 32 * 8, 1, 32, 8)
    with pytest.raises(LayoutError, match="block order"):
        check_pairable(token_major, replace(single, packing=packed))
    check_pairable(token_major, single)


def test_packing_must_cover_the_head_and_divide_the_block() -> None:
    with pytest.raises(LayoutError, match="holds 6 B per head per token, the region 8 B"):
        RegionLayout(BlockOrder.HEAD_MAJOR, 8, 256, 1, 32, 8, packing=cpu_like_packing(6))
    with pytest.raises(LayoutError, match="groups tokens by 3, which does not divide"):
        RegionLayout(BlockOrder.HEAD_MAJOR, 8, 256, 1, 32, 8, packing=cpu_like_packing(8, 3))


def test_token_major_merge_swaps_only_filled_rows() -> None:
    """TP 2 -> 1 token-major merge, Bp=2, Bd=4, 5 tokens: the last decode block is filled for
    2 tokens (its only prefill block), so its swap covers 2 rows (decode blocks apart, so that
    their swaps stay apart)."""
    case = PullCase(
        heads=2,
        prefill_tp=2,
        decode_tp=1,
        kind="fused_token_major",
        prefill_block=2,
        decode_block=4,
        num_tokens=5,
        remote_ids=[4, 1, 2],
        local_ids=[3, 0],
    )
    plan = simulate_or_refuse(case, 0)
    assert sorted((s.outer, s.inner, len(s.addrs)) for s in plan.fixups) == [(2, 2, 1), (2, 4, 1)]


def test_pd_32_to_64_block_counts() -> None:
    pieces = align_tokens(
        list(range(10, 14)), list(range(7)), decode_block_size=64, prefill_block_size=32
    )
    assert pieces.tokens == 32 and len(pieces) == 7
    assert pieces.local_blocks.tolist() == [10, 10, 11, 11, 12, 12, 13]
    assert pieces.local_slots.tolist() == [0, 32] * 3 + [0]
    assert pieces.local_filled.tolist() == [64] * 6 + [32]
    # prefill 64 -> decode 32, a cached decode block: the first prefill block is read from slot 32
    pieces = align_tokens(
        [4, 5], [0, 1], decode_block_size=32, prefill_block_size=64, num_tokens=90
    )
    assert pieces.remote_blocks.tolist() == [0, 1] and pieces.remote_slots.tolist() == [32, 0]


def test_block_sizes_that_do_not_divide_are_refused() -> None:
    topo = TransferTopology(2, 1, 1)
    local = [Region("l0", 1 << 40, RegionLayout(BlockOrder.HEAD_MAJOR, 4, 64, 2, 4, 8))]
    remote = {0: [Region("l0", 2 << 40, RegionLayout(BlockOrder.HEAD_MAJOR, 4, 96, 2, 6, 8))]}
    with pytest.raises(LayoutError, match="block size 6 on prefill vs 4 on decode: neither"):
        plan_request(topo, 0, 0, local, remote, [0], [0], num_tokens=4)
    with pytest.raises(PlanError, match="block size 6 on prefill vs 4 on decode"):
        align_tokens([0], [0], decode_block_size=4, prefill_block_size=6, num_tokens=4)


def test_block_count_mismatches_are_refused() -> None:
    topo = TransferTopology(2, 1, 1)
    small = RegionLayout(BlockOrder.TOKEN_MAJOR, 8, 2 * 2 * 8, 2, 2, 8)
    large = RegionLayout(BlockOrder.TOKEN_MAJOR, 8, 2 * 4 * 8, 2, 4, 8)
    # prefill block larger than decode's: the prompt length decides the decode block count
    local, remote = [Region("l0", 1 << 40, small)], {0: [Region("l0", 2 << 40, large)]}
    with pytest.raises(PlanError, match="num_tokens"):
        plan_request(topo, 0, 0, local, remote, [0, 1], [0])
    with pytest.raises(PlanError, match="decode side wants 3 blocks of 2 tokens"):
        plan_request(topo, 0, 0, local, remote, [0, 1, 2], [0], num_tokens=4)
    with pytest.raises(PlanError, match="holds 1 blocks of 4 tokens, but a 5-token prompt fills 2"):
        plan_request(topo, 0, 0, local, remote, [0, 1], [0], num_tokens=5)
    # decode block larger: 3 prefill blocks of 2 tokens fill 2 decode blocks of 4
    local, remote = [Region("l0", 1 << 40, large)], {0: [Region("l0", 2 << 40, small)]}
    with pytest.raises(PlanError, match="decode side wants 3 blocks of 4 tokens"):
        plan_request(topo, 0, 0, local, remote, [0, 1, 2], [0, 1, 2])
    with pytest.raises(PlanError, match="prefill block id 9 is outside"):
        plan_request(topo, 0, 0, local, remote, [0], [0, 9], num_tokens=4)
