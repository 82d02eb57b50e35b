"""Regions of different head groups in one request: a draft (EAGLE/MTP) layer with a KV-head
count of its own is sharded by its own count and pulled with its own group's pulls, every byte
landing where decode's layout expects it (the simulator: :mod:`vam_testing.plan_simulator`)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from vam_testing.kv_reference import LAYOUT_KINDS, region_table
from vam_testing.plan_simulator import (
    PullCase,
    cdiv,
    draw_block_ids,
    equal_blocks,
    simulate_pull,
)
from vllm_ascend_mooncake.core.layout import BlockOrder, RegionLayout
from vllm_ascend_mooncake.core.plan import RequestPulls, may_need_staging, plan_request
from vllm_ascend_mooncake.core.topology import Topologies, TopologyError, TransferTopology

TPS = (1, 2, 4, 8)


def block_table(draw, count: int, total: int, style: str) -> list[int]:
    ids = draw(st.permutations(range(total)))[:count]
    return list(range(total))[total - count :] if style == "contiguous" else list(ids)


def prompt_case(*, num_tokens: int, cached_blocks: int, **fields) -> PullCase:
    """A pull of a ``num_tokens`` prompt of which decode caches ``cached_blocks`` blocks."""
    rng = np.random.default_rng(fields["seed"] + 1)
    prefill_count = cdiv(num_tokens, fields["prefill_block"])
    local_count = cdiv(num_tokens, fields["decode_block"]) - cached_blocks
    return PullCase(
        num_tokens=num_tokens,
        remote_ids=draw_block_ids(rng, prefill_count, prefill_count + 2, "shuffled"),
        local_ids=draw_block_ids(rng, local_count, max(local_count, 1) + 2, "shuffled"),
        remote_blocks=prefill_count + 2,
        local_blocks=max(local_count, 1) + 2,
        **fields,
    )


def pairable(heads: int, draft: int, prefill_tp: int, decode_tp: int, is_mla: bool) -> bool:
    try:
        TransferTopology(heads, prefill_tp, decode_tp, is_mla=is_mla, extra_kv_heads=(draft,))
    except TopologyError:
        return False
    return True


def check_peers(case: PullCase, decode_rank: int) -> None:
    """Simulate ``case`` and check that the plan reads, and so later notifies, exactly the
    prefill ranks of every group's pulls, each once."""
    plan = simulate_pull(case, decode_rank)
    topology = case.topology()
    wanted = {
        p.prefill_rank for g in topology.head_groups for p in g.pulls_for(decode_rank, case.seed)
    }
    ranks = [peer.prefill_rank for peer in plan.peers]
    assert len(ranks) == len(set(ranks))
    assert set(ranks) == wanted
    for rank in ranks:
        assert decode_rank in topology.readers_of(rank, case.seed)


@st.composite
def mixed_cases(draw) -> tuple[PullCase, int]:
    kind = draw(st.sampled_from(LAYOUT_KINDS))
    is_mla = kind == "latent"
    heads = 1 if is_mla else draw(st.sampled_from([1, 2, 4, 8, 16]))
    draft = draw(st.sampled_from([1, 2, 4, 8, 16]))
    assume(draft != heads or is_mla)
    prefill_tp = draw(st.sampled_from([1, 2, 4, 8, 16]))
    decode_tp = draw(st.sampled_from([1, 2, 4, 8, 16]))
    assume(pairable(heads, draft, prefill_tp, decode_tp, is_mla))
    remote_count = draw(st.integers(1, 10))
    local_count = draw(st.integers(0, remote_count))
    remote_total = remote_count + draw(st.integers(0, 4))
    local_total = max(local_count, 1) + draw(st.integers(0, 4))
    block_size = draw(st.sampled_from([1, 2, 3, 4]))
    num_layers = draw(st.integers(1, 3))
    case = PullCase(
        heads=heads,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        kind=kind,
        num_layers=num_layers,
        draft_heads=draft,
        draft_layers=draw(st.integers(1, 2)),
        draft_position=draw(st.integers(0, num_layers)),
        prefill_block=block_size,
        decode_block=block_size,
        head_token_bytes=draw(st.sampled_from([1, 2, 4, 6])),
        remote_blocks=remote_total,
        local_blocks=local_total,
        remote_ids=block_table(draw, remote_count, remote_total, "shuffled"),
        local_ids=block_table(
            draw, local_count, local_total, draw(st.sampled_from(["contiguous", "shuffled"]))
        ),
        prefill_pad=draw(st.sampled_from([0, 16])),
        decode_pad=draw(st.sampled_from([0, 8])),
        coalesce_runs=draw(st.booleans()),
        block_reads_from_bytes=draw(st.sampled_from([0, 1, 1 << 30])),
        cap=draw(st.sampled_from([1, 3, 1024])),
        staging_blocks=draw(st.sampled_from([1, 2, 64])),
        seed=draw(st.integers(0, 2**32)),
        flip_single_head=draw(st.booleans()),
        max_descriptor_bytes=draw(st.sampled_from([0, 7])),
        tell_planner_num_tokens=draw(st.booleans()),
    )
    return case, draw(st.integers(0, decode_tp - 1))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mixed_cases())
def test_mixed_head_groups_reproduce_reference_bytes(sample: tuple[PullCase, int]) -> None:
    case, decode_rank = sample
    check_peers(case, decode_rank)


@st.composite
def mixed_block_size_cases(draw) -> tuple[PullCase, int]:
    # head-major blocks of unknown packing cannot be cut by token: not drawn here
    kind = draw(st.sampled_from(["packed_head_major", "fused_token_major", "split_kv", "latent"]))
    is_mla = kind == "latent"
    heads = 1 if is_mla else draw(st.sampled_from([1, 2, 4, 8]))
    draft = draw(st.sampled_from([1, 2, 4, 8]))
    assume(draft != heads or is_mla)
    prefill_tp, decode_tp = draw(st.sampled_from(TPS)), draw(st.sampled_from(TPS))
    assume(pairable(heads, draft, prefill_tp, decode_tp, is_mla))
    base, ratio = draw(st.sampled_from([1, 2])), draw(st.sampled_from([2, 4]))
    blocks = (base, base * ratio) if draw(st.booleans()) else (base * ratio, base)
    num_tokens = draw(st.integers(1, 30))
    case = prompt_case(
        heads=heads,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        kind=kind,
        draft_heads=draft,
        draft_position=draw(st.integers(0, 2)),
        prefill_block=blocks[0],
        decode_block=blocks[1],
        num_tokens=num_tokens,
        cached_blocks=draw(st.integers(0, cdiv(num_tokens, blocks[1]))),
        num_layers=2,
        head_token_bytes=draw(st.sampled_from([2, 4])),
        coalesce_runs=draw(st.booleans()),
        staging_blocks=draw(st.sampled_from([1, 64])),
        seed=draw(st.integers(0, 2**32)),
        token_unit=1,
    )
    return case, draw(st.integers(0, decode_tp - 1))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mixed_block_size_cases())
def test_mixed_head_groups_with_different_block_sizes(sample: tuple[PullCase, int]) -> None:
    case, decode_rank = sample
    check_peers(case, decode_rank)


@pytest.mark.parametrize("kind", ["fused_head_major", "fused_token_major", "split_kv", "latent"])
@pytest.mark.parametrize("heads", [(8, 2), (2, 8), (4, 1), (8, 4)])
def test_every_tp_pair_every_rank_every_replica(kind: str, heads: tuple[int, int]) -> None:
    """Exhaustively: every TP pair both groups can serve (one group replicated, TP > heads, where
    the other is not, included), every decode rank, replica seeds, a prefix cached."""
    served = 0
    for prefill_tp, decode_tp, seed in itertools.product(TPS, TPS, range(3)):
        if not pairable(*heads, prefill_tp, decode_tp, kind == "latent"):
            continue
        tps = (prefill_tp, decode_tp)
        case = equal_blocks(kind, heads[0], tps, 2, [4, 1, 2, 3], [3, 0, 1], seed=seed)
        case.num_layers, case.draft_heads, case.draft_position = 2, heads[1], 1
        case.remote_blocks, case.local_blocks, case.staging_blocks = 6, 5, 2
        for decode_rank in range(decode_tp):
            check_peers(case, decode_rank)
        served += 1
    assert served >= 12


def test_a_decode_rank_reads_a_prefill_rank_only_its_draft_layers_need() -> None:
    """8 model heads at TP 8 on both sides read 1:1; the draft's 4 heads are replicated on
    both, so decode rank 0 reads its draft head from prefill rank 0 or 1 by the seed: prefill
    rank 1, which the model's layers never send it, is then read and counts it as a reader."""
    topology = TransferTopology(8, 8, 8, extra_kv_heads=(4,))
    seeds = [s for s in range(8) if topology.prefill_ranks_for(0, s) == (0, 1)]
    assert seeds, "some seed must pick the other replica"
    seed = seeds[0]
    assert topology.readers_of(1, seed) == (0, 1)
    case = equal_blocks("fused_head_major", 8, (8, 8), 2, [0, 1], [1, 0], draft_heads=4, seed=seed)
    plan = simulate_pull(case, 0)
    assert [p.prefill_rank for p in plan.peers] == [0, 1]
    by_rank = {p.prefill_rank: p for p in plan.peers}
    model_bytes = 2 * 2 * case.head_token_bytes  # two 1-head blocks of 2 tokens
    assert by_rank[0].num_bytes == model_bytes  # the model's layer
    assert by_rank[1].num_bytes == model_bytes  # the draft layer, from the other replica


def test_the_8_vs_2_heads_example_reads_per_group() -> None:
    """Prefill TP 4, decode TP 2: the model's 8 heads merge two prefill ranks per decode rank;
    the draft's 2 heads are replicated on prefill and read from one rank of the two."""
    topology = TransferTopology(8, 4, 2, extra_kv_heads=(2,))
    model, draft = topology.head_groups
    assert [p.prefill_rank for p in model.pulls_for(1, 0)] == [2, 3]
    assert [p.prefill_rank for p in draft.pulls_for(1, 0)] in ([2], [3])
    assert topology.prefill_ranks_for(1, 0) == (2, 3)
    layouts = [
        RegionLayout(BlockOrder.HEAD_MAJOR, 4, 4 * 2 * 4, 4, 2, 4),
        RegionLayout(BlockOrder.HEAD_MAJOR, 4, 1 * 2 * 4, 1, 2, 4, kv_heads=2),
    ]
    regions, _ = region_table("d.", 1 << 30, layouts)
    pulls = RequestPulls.of(topology, 1, 0, regions)
    assert pulls.by_region == (model.pulls_for(1, 0), draft.pulls_for(1, 0))


def test_one_head_group_plans_exactly_as_before() -> None:
    """A draft whose total equals the model's is no group of its own: regions naming it plan
    exactly as regions naming none."""
    topology = TransferTopology(4, 2, 1, extra_kv_heads=(4,))
    plain = TransferTopology(4, 2, 1)
    assert topology.head_groups == (topology,)
    layout = RegionLayout(BlockOrder.TOKEN_MAJOR, 4, 4 * 2 * 2, 4, 2, 2)
    remote = RegionLayout(BlockOrder.TOKEN_MAJOR, 4, 2 * 2 * 2, 2, 2, 2)
    local, _ = region_table("d.", 1 << 30, [layout, layout])
    tables = {p: region_table(f"p{p}.", (p + 2) << 30, [remote, remote])[0] for p in range(2)}
    a = plan_request(topology, 0, 5, local, tables, [0, 2], [1, 3])
    b = plan_request(plain, 0, 5, local, tables, [0, 2], [1, 3])
    for pa, pb in zip(a.peers, b.peers, strict=True):
        assert pa.prefill_rank == pb.prefill_rank
        for ba, bb in zip(pa.batches, pb.batches, strict=True):
            assert np.array_equal(ba.local_addrs, bb.local_addrs)
            assert np.array_equal(ba.remote_addrs, bb.remote_addrs)
    assert [(s.outer, s.inner, s.unit) for s in a.fixups] == [
        (s.outer, s.inner, s.unit) for s in b.fixups
    ]


def test_a_region_of_an_unknown_head_group_is_refused() -> None:
    topology = TransferTopology(8, 2, 2, extra_kv_heads=(4,))
    layout = RegionLayout(BlockOrder.HEAD_MAJOR, 2, 2 * 2 * 2, 2, 2, 2, kv_heads=6)
    regions, _ = region_table("d.", 1 << 30, [layout])
    with pytest.raises(TopologyError, match=r"no head group of 6 KV heads.*8, 4"):
        RequestPulls.of(topology, 0, 0, regions)


def test_a_draft_group_the_tp_sizes_cannot_shard_is_refused_naming_it() -> None:
    with pytest.raises(TopologyError, match=r"draft \(EAGLE/MTP\) layers' 3 KV heads"):
        TransferTopology(8, 2, 4, extra_kv_heads=(3,))


def test_topologies_of_other_remote_sizes_keep_the_draft_group() -> None:
    topologies = Topologies(TransferTopology(8, 2, 2, extra_kv_heads=(2,)), local_is_decode=True)
    other = topologies.with_remote_tp(4)
    assert [g.num_kv_heads for g in other.head_groups] == [8, 2]
    assert other.replicates_on_prefill  # 2 heads over prefill TP 4


def test_staging_is_judged_per_head_group() -> None:
    """Head-major blocks of several heads read slices in place; the draft's single head per
    decode rank is order-free and may need staging from a token-major prefill."""
    topology = TransferTopology(8, 1, 2, extra_kv_heads=(2,))
    model = RegionLayout(BlockOrder.HEAD_MAJOR, 4, 4 * 2 * 2, 4, 2, 2)
    draft = RegionLayout(BlockOrder.HEAD_MAJOR, 4, 1 * 2 * 2, 1, 2, 2, kv_heads=2)
    assert not may_need_staging(TransferTopology(8, 1, 2), [model])
    assert may_need_staging(topology, [model, draft])
