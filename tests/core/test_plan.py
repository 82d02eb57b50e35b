"""Equal block sizes on prefill and decode: plans executed on numpy memories reproduce the
reference KV byte for byte (the simulator: :mod:`vam_testing.plan_simulator`)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from vam_testing.kv_reference import LAYOUT_KINDS
from vam_testing.plan_simulator import PullCase, equal_blocks, simulate_pull
from vllm_ascend_mooncake.core.layout import BlockOrder, LayoutError, Region, RegionLayout
from vllm_ascend_mooncake.core.plan import PlanError, plan_request
from vllm_ascend_mooncake.core.topology import TopologyError, TransferTopology


def block_table(draw, count: int, total: int, style: str) -> list[int]:
    if style == "contiguous":
        start = draw(st.integers(0, total - count))
        return list(range(start, start + count))
    ids = draw(st.permutations(range(total)))[:count]
    return sorted(ids) if style == "sorted" else list(ids)


@st.composite
def scenarios(draw) -> tuple[PullCase, int]:
    kind = draw(st.sampled_from(LAYOUT_KINDS))
    heads = 1 if kind == "latent" else draw(st.sampled_from([1, 2, 4, 8, 16, 32]))
    prefill_tp = draw(st.sampled_from([1, 2, 4, 8, 16]))
    decode_tp = draw(st.sampled_from([1, 2, 4, 8, 16]))
    try:
        TransferTopology(heads, prefill_tp, decode_tp, is_mla=kind == "latent")
    except TopologyError:
        assume(False)
    remote_count = draw(st.integers(1, 12))
    local_count = draw(st.integers(0, remote_count))
    remote_total = remote_count + draw(st.integers(0, 6))
    local_total = max(local_count, 1) + draw(st.integers(0, 6))
    block_size = draw(st.sampled_from([1, 2, 3, 4]))
    sc = PullCase(
        heads=heads,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        kind=kind,
        num_layers=draw(st.integers(1, 2)),
        prefill_block=block_size,
        decode_block=block_size,
        head_token_bytes=draw(st.sampled_from([1, 2, 4, 6, 8])),
        remote_blocks=remote_total,
        local_blocks=local_total,
        remote_ids=block_table(
            draw,
            remote_count,
            remote_total,
            draw(st.sampled_from(["contiguous", "sorted", "shuffled"])),
        ),
        local_ids=block_table(
            draw,
            local_count,
            local_total,
            draw(st.sampled_from(["contiguous", "sorted", "shuffled"])),
        ),
        prefill_pad=draw(st.sampled_from([0, 0, 16])),
        decode_pad=draw(st.sampled_from([0, 0, 8])),
        coalesce_runs=draw(st.booleans()),
        block_reads_from_bytes=draw(st.sampled_from([0, 0, 1, 1 << 30])),
        cap=draw(st.sampled_from([1, 3, 1024])),
        staging_blocks=draw(st.sampled_from([1, 2, 64])),
        seed=draw(st.integers(0, 2**32)),
        flip_single_head=draw(st.booleans()),
        max_descriptor_bytes=draw(st.sampled_from([0, 0, 7, 64])),
        tell_planner_num_tokens=draw(st.booleans()),
    )
    return sc, draw(st.integers(0, decode_tp - 1))


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_plan_reproduces_reference_bytes(case: tuple[PullCase, int]) -> None:
    sc, decode_rank = case
    simulate_pull(sc, decode_rank)


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize(
    "tps", [(1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (4, 2), (2, 4), (8, 8), (16, 1), (1, 16)]
)
@pytest.mark.parametrize("coalesce", [True, False])
def test_every_layout_and_tp_pair_with_runs_and_prefix_hit(kind, tps, coalesce) -> None:
    decode_tp = tps[1]
    heads = 1 if kind == "latent" else 4
    remote_ids = [3, 4, 5, 6, 0, 9, 10, 2]  # runs of 4, 1, 2, 1
    local_ids = [8, 9, 10, 1, 5, 6, 13]  # prefix hit: one block fewer
    sc = equal_blocks(kind, heads, tps, 4, remote_ids, local_ids, num_layers=2, remote_blocks=12)
    sc.local_blocks, sc.coalesce_runs, sc.staging_blocks = 14, coalesce, 3
    for decode_rank in range(decode_tp):
        simulate_pull(sc, decode_rank)


def test_worked_example_h8_tp4_td2_split_kv_bf16() -> None:
    """B=128, d=128, bf16, separate K/V: per block per K/V tensor two 64 KiB pulls."""
    topo = TransferTopology(8, 4, 2)
    prefill = RegionLayout(BlockOrder.TOKEN_MAJOR, 16, 65536, 2, 128, 256)
    decode = RegionLayout(BlockOrder.TOKEN_MAJOR, 16, 131072, 4, 128, 256)
    local = [Region("k", 1 << 40, decode), Region("v", 2 << 40, decode)]
    remote = {
        p: [Region("k", (10 + p) << 40, prefill), Region("v", (20 + p) << 40, prefill)]
        for p in range(4)
    }
    plan = plan_request(topo, 0, 0, local, remote, [5], [9])
    assert [peer.prefill_rank for peer in plan.peers] == [0, 1]
    for j, peer in enumerate(plan.peers):
        (batch,) = peer.batches
        assert batch.local_addrs.tolist() == [
            (1 << 40) + 5 * 131072 + j * 65536,
            (2 << 40) + 5 * 131072 + j * 65536,
        ]
        assert batch.remote_addrs.tolist() == [
            ((10 + j) << 40) + 9 * 65536,
            ((20 + j) << 40) + 9 * 65536,
        ]
        assert batch.lengths.tolist() == [65536, 65536]
    (swap,) = plan.fixups
    assert (swap.outer, swap.inner, swap.unit) == (2, 128, 2 * 128 * 2)
    assert sorted(swap.addrs.tolist()) == [(1 << 40) + 5 * 131072, (2 << 40) + 5 * 131072]


def test_worked_example_h2_tp4_td1_two_replicas() -> None:
    sc = equal_blocks("split_kv", 2, (4, 1), 8, [1, 3], [5, 6], remote_blocks=4, local_blocks=8)
    plan = simulate_pull(sc, 0)
    ranks = [peer.prefill_rank for peer in plan.peers]
    assert len(ranks) == 2 and ranks[0] in (0, 1) and ranks[1] in (2, 3)


def merge_one_run_case() -> PullCase:
    """TP 4 -> 1 head-major merge of one 32-block run (3 layers, 2 heads per prefill rank)."""
    case = equal_blocks("fused_head_major", 8, (4, 1), 2, range(0, 32), range(8, 40))
    case.num_layers, case.head_token_bytes, case.remote_blocks, case.local_blocks = 3, 2, 40, 40
    return case


def test_run_level_coalescing_scales_with_runs_not_blocks() -> None:
    sc = merge_one_run_case()
    coalesced = simulate_pull(sc, 0)
    sc.coalesce_runs = False
    per_block = simulate_pull(sc, 0)
    assert coalesced.num_descriptors == 4 * 3  # one run x 4 pulls x 3 layers
    assert per_block.num_descriptors == 4 * 3 * 32
    assert per_block.fixups == []  # head-major blocks filled chunk by chunk need no fix-up
    assert coalesced.num_bytes == per_block.num_bytes


def test_large_head_major_blocks_are_read_block_by_block() -> None:
    """From ``block_reads_from_bytes`` on, a head-major merge skips run-level coalescing and its
    fix-up; below it, and for token-major blocks, runs stay coalesced."""
    sc = merge_one_run_case()
    prefill_block = 2 * 2 * 2  # 2 heads per prefill rank x 2 tokens x 2 bytes
    sc.block_reads_from_bytes = prefill_block
    per_block = simulate_pull(sc, 0)
    assert per_block.num_descriptors == 4 * 3 * 32 and per_block.fixups == []
    sc.block_reads_from_bytes = prefill_block + 1
    coalesced = simulate_pull(sc, 0)
    assert coalesced.num_descriptors == 4 * 3 and coalesced.fixups
    sc.kind, sc.block_reads_from_bytes = "fused_token_major", 1
    assert simulate_pull(sc, 0).fixups, "token-major merges always need their fix-up"


def test_descriptor_cap_splits_batches() -> None:
    sc = equal_blocks("fused_head_major", 4, (2, 4), 2, range(10), range(10), cap=7)
    sc.num_layers, sc.head_token_bytes, sc.remote_blocks, sc.local_blocks = 2, 2, 10, 10
    plan = simulate_pull(sc, 1)
    assert [len(b) for b in plan.peers[0].batches] == [7, 7, 6]


def test_out_of_range_block_ids_are_refused() -> None:
    topo = TransferTopology(2, 1, 1)
    layout = RegionLayout(BlockOrder.HEAD_MAJOR, 4, 64, 2, 4, 8)
    local = [Region("l0", 1 << 40, layout)]
    remote = {0: [Region("l0", 2 << 40, layout)]}
    with pytest.raises(PlanError, match="prefill block id 4 is outside"):
        plan_request(topo, 0, 0, local, remote, [0], [4])
    with pytest.raises(PlanError, match="decode block id -1 is outside"):
        plan_request(topo, 0, 0, local, remote, [-1], [0])
    with pytest.raises(PlanError, match="decode side wants 2 blocks"):
        plan_request(topo, 0, 0, local, remote, [0, 1], [0])


def test_mismatched_geometry_is_refused() -> None:
    topo = TransferTopology(2, 1, 1)
    local = [Region("l0", 1 << 40, RegionLayout(BlockOrder.HEAD_MAJOR, 4, 64, 2, 4, 8))]
    remote = {0: [Region("l0", 2 << 40, RegionLayout(BlockOrder.TOKEN_MAJOR, 4, 64, 2, 4, 8))]}
    with pytest.raises(LayoutError, match="block order token_major on prefill vs head_major"):
        plan_request(topo, 0, 0, local, remote, [0], [0])
    remote = {0: [Region("l0", 2 << 40, RegionLayout(BlockOrder.HEAD_MAJOR, 4, 96, 2, 6, 8))]}
    with pytest.raises(LayoutError, match="block size 6 on prefill vs 4 on decode"):
        plan_request(topo, 0, 0, local, remote, [0], [0])
    with pytest.raises(PlanError, match="registered 2 KV regions"):
        plan_request(topo, 0, 0, local, {0: remote[0] * 2}, [0], [0])


def test_token_major_slice_without_staging_is_refused() -> None:
    topo = TransferTopology(4, 1, 2)
    local = [Region("l0", 1 << 40, RegionLayout(BlockOrder.TOKEN_MAJOR, 4, 32, 2, 4, 4))]
    remote = {0: [Region("l0", 2 << 40, RegionLayout(BlockOrder.TOKEN_MAJOR, 4, 64, 4, 4, 4))]}
    with pytest.raises(PlanError, match="staging buffer"):
        plan_request(topo, 0, 0, local, remote, [0], [0])
