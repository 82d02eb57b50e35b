"""Plans executed on numpy memories must reproduce the reference KV byte for byte."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from vllm_ascend_mooncake.core.layout import BlockOrder, LayoutError, Region, RegionLayout
from vllm_ascend_mooncake.core.plan import (
    PlanError,
    PlanOptions,
    RequestPlan,
    StagingArea,
    plan_request,
)
from vllm_ascend_mooncake.core.topology import TopologyError, TransferTopology
from vllm_ascend_mooncake.testing.kv_reference import (
    LAYOUT_KINDS,
    AddressSpace,
    ReferenceKV,
    execute_plan,
    owned_heads,
    region_layouts,
    region_table,
    table_bytes,
)

GiB = 1 << 30


@dataclass
class Scenario:
    heads: int
    prefill_tp: int
    decode_tp: int
    kind: str
    num_layers: int
    tokens: int
    head_token_bytes: int
    remote_blocks: int
    local_blocks: int
    remote_ids: list[int]
    local_ids: list[int]
    prefill_pad: int = 0
    decode_pad: int = 0
    coalesce_runs: bool = True
    block_reads_from_bytes: int = 0
    cap: int = 1024
    staging_blocks: int = 64
    seed: int = 0
    flip_single_head: bool = False
    max_descriptor_bytes: int = 0

    @property
    def is_mla(self) -> bool:
        return self.kind == "latent"


def run_scenario(sc: Scenario, decode_rank: int) -> RequestPlan:
    """Fill prefill memories from the reference, plan, execute, and compare every decode byte."""
    topo = TransferTopology(sc.heads, sc.prefill_tp, sc.decode_tp, is_mla=sc.is_mla)
    num_heads = 1 if sc.is_mla else sc.heads
    probe = region_layouts(sc.kind, sc.num_layers, 1, sc.tokens, sc.head_token_bytes, 1, 0)
    ref = ReferenceKV.random(
        len(probe), sc.remote_blocks, num_heads, sc.tokens, sc.head_token_bytes, seed=sc.seed
    )
    rng = np.random.default_rng(sc.seed + 1)

    remote_spaces, remote_tables, remote_snapshots = {}, {}, {}
    for p in range(sc.prefill_tp):
        heads = owned_heads(num_heads, sc.prefill_tp, p, sc.is_mla)
        layouts = region_layouts(
            sc.kind,
            sc.num_layers,
            len(heads),
            sc.tokens,
            sc.head_token_bytes,
            sc.remote_blocks,
            sc.prefill_pad,
            sc.flip_single_head,
        )
        base = (p + 1) * GiB
        memory = rng.integers(0, 256, table_bytes(layouts), dtype=np.uint8)
        regions, offsets = region_table(f"p{p}.", base, layouts)
        ref.fill(memory, layouts, offsets, heads, ((b, b) for b in range(sc.remote_blocks)))
        space = AddressSpace()
        space.add(base, memory)
        remote_spaces[p], remote_tables[p] = space, regions
        remote_snapshots[p] = memory.copy()

    my_heads = owned_heads(num_heads, sc.decode_tp, decode_rank, sc.is_mla)
    local_layouts = region_layouts(
        sc.kind,
        sc.num_layers,
        len(my_heads),
        sc.tokens,
        sc.head_token_bytes,
        sc.local_blocks,
        sc.decode_pad,
        sc.flip_single_head,
    )
    local_base = 100 * GiB
    local_memory = rng.integers(0, 256, table_bytes(local_layouts), dtype=np.uint8)
    before = local_memory.copy()
    local_regions, local_offsets = region_table("d.", local_base, local_layouts)
    local_space = AddressSpace()
    local_space.add(local_base, local_memory)
    staging_base = 200 * GiB
    staging_capacity = sc.staging_blocks * max(
        layouts[0].block_len
        for layouts in (
            region_layouts(
                sc.kind,
                1,
                len(owned_heads(num_heads, sc.prefill_tp, p, sc.is_mla)),
                sc.tokens,
                sc.head_token_bytes,
                1,
                0,
            )
            for p in range(sc.prefill_tp)
        )
    )
    local_space.add(staging_base, np.zeros(staging_capacity, dtype=np.uint8))

    options = PlanOptions(
        max_descriptors_per_batch=sc.cap,
        coalesce_runs=sc.coalesce_runs,
        block_reads_from_bytes=sc.block_reads_from_bytes,
        staging=StagingArea(staging_base, staging_capacity),
        max_descriptor_bytes=sc.max_descriptor_bytes,
    )
    plan = plan_request(
        topo,
        decode_rank,
        sc.seed,
        local_regions,
        remote_tables,
        sc.local_ids,
        sc.remote_ids,
        options,
    )
    execute_plan(plan, local_space, remote_spaces)

    # Every requested decode block holds exactly the reference heads of its prefill block...
    expected = before.copy()
    paired_remote = sc.remote_ids[len(sc.remote_ids) - len(sc.local_ids) :]
    ref.fill(
        expected,
        local_layouts,
        local_offsets,
        my_heads,
        zip(sc.local_ids, paired_remote, strict=True),
    )
    # ...and nothing else changed, padding and other blocks included.
    if not np.array_equal(local_memory, expected):
        wrong = np.flatnonzero(local_memory != expected)
        raise AssertionError(f"{len(wrong)} wrong decode bytes, first at offset {wrong[0]}")
    for p, space_memory in remote_snapshots.items():
        assert np.array_equal(remote_spaces[p].view((p + 1) * GiB, len(space_memory)), space_memory)
    for peer in plan.peers:
        assert all(0 < len(batch) <= sc.cap for batch in peer.batches)
        if sc.max_descriptor_bytes:  # staged reads are whole prefill blocks, at least one
            largest_block = max(r.layout.block_len for r in remote_tables[peer.prefill_rank])
            limit = max(sc.max_descriptor_bytes, largest_block)
            assert all(b.lengths.max() <= limit for b in peer.batches)
    return plan


def block_table(draw, count: int, total: int, style: str) -> list[int]:
    if style == "contiguous":
        start = draw(st.integers(0, total - count))
        return list(range(start, start + count))
    ids = draw(st.permutations(range(total)))[:count]
    return sorted(ids) if style == "sorted" else list(ids)


@st.composite
def scenarios(draw) -> tuple[Scenario, int]:
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
    sc = Scenario(
        heads=heads,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        kind=kind,
        num_layers=draw(st.integers(1, 2)),
        tokens=draw(st.sampled_from([1, 2, 3, 4])),
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
    )
    return sc, draw(st.integers(0, decode_tp - 1))


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_plan_reproduces_reference_bytes(case: tuple[Scenario, int]) -> None:
    sc, decode_rank = case
    run_scenario(sc, decode_rank)


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize(
    "tps", [(1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (4, 2), (2, 4), (8, 8), (16, 1), (1, 16)]
)
@pytest.mark.parametrize("coalesce", [True, False])
def test_every_layout_and_tp_pair_with_runs_and_prefix_hit(kind, tps, coalesce) -> None:
    prefill_tp, decode_tp = tps
    heads = 1 if kind == "latent" else 4
    sc = Scenario(
        heads=heads,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        kind=kind,
        num_layers=2,
        tokens=4,
        head_token_bytes=4,
        remote_blocks=12,
        local_blocks=14,
        remote_ids=[3, 4, 5, 6, 0, 9, 10, 2],  # runs of 4, 1, 2, 1
        local_ids=[8, 9, 10, 1, 5, 6, 13],  # prefix hit: one block fewer
        coalesce_runs=coalesce,
        staging_blocks=3,
    )
    for decode_rank in range(decode_tp):
        run_scenario(sc, decode_rank)


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
    sc = Scenario(
        heads=2,
        prefill_tp=4,
        decode_tp=1,
        kind="split_kv",
        num_layers=1,
        tokens=8,
        head_token_bytes=4,
        remote_blocks=4,
        local_blocks=8,
        remote_ids=[1, 3],
        local_ids=[5, 6],
    )
    plan = run_scenario(sc, 0)
    ranks = [peer.prefill_rank for peer in plan.peers]
    assert len(ranks) == 2 and ranks[0] in (0, 1) and ranks[1] in (2, 3)


def merge_one_run_scenario() -> Scenario:
    """TP 4 -> 1 head-major merge of one 32-block run (3 layers, 2 heads per prefill rank)."""
    return Scenario(
        heads=8,
        prefill_tp=4,
        decode_tp=1,
        kind="fused_head_major",
        num_layers=3,
        tokens=2,
        head_token_bytes=2,
        remote_blocks=40,
        local_blocks=40,
        remote_ids=list(range(0, 32)),
        local_ids=list(range(8, 40)),
    )


def test_run_level_coalescing_scales_with_runs_not_blocks() -> None:
    sc = merge_one_run_scenario()
    coalesced = run_scenario(sc, 0)
    sc.coalesce_runs = False
    per_block = run_scenario(sc, 0)
    assert coalesced.num_descriptors == 4 * 3  # one run x 4 pulls x 3 layers
    assert per_block.num_descriptors == 4 * 3 * 32
    assert per_block.fixups == []  # head-major blocks filled chunk by chunk need no fix-up
    assert coalesced.num_bytes == per_block.num_bytes


def test_large_head_major_blocks_are_read_block_by_block() -> None:
    """From ``block_reads_from_bytes`` on, a head-major merge skips run-level coalescing and its
    fix-up; below it, and for token-major blocks, runs stay coalesced."""
    sc = merge_one_run_scenario()
    prefill_block = 2 * 2 * 2  # 2 heads per prefill rank x 2 tokens x 2 bytes
    sc.block_reads_from_bytes = prefill_block
    per_block = run_scenario(sc, 0)
    assert per_block.num_descriptors == 4 * 3 * 32 and per_block.fixups == []
    sc.block_reads_from_bytes = prefill_block + 1
    coalesced = run_scenario(sc, 0)
    assert coalesced.num_descriptors == 4 * 3 and coalesced.fixups
    sc.kind, sc.block_reads_from_bytes = "fused_token_major", 1
    assert run_scenario(sc, 0).fixups, "token-major merges always need their fix-up"


def test_descriptor_cap_splits_batches() -> None:
    sc = Scenario(
        heads=4,
        prefill_tp=2,
        decode_tp=4,
        kind="fused_head_major",
        num_layers=2,
        tokens=2,
        head_token_bytes=2,
        remote_blocks=10,
        local_blocks=10,
        remote_ids=list(range(10)),
        local_ids=list(range(10)),
        cap=7,
    )
    plan = run_scenario(sc, 1)
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
