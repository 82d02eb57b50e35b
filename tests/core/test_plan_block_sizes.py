"""Different block sizes on prefill and decode: plans reproduce the reference, token by token.

The expected decode bytes come from :class:`ReferencePrompt`: token ``t`` of the prompt sits in
the side's ``t // B``-th block at slot ``t % B``, whatever the other side's block size. Decode
slots past the last prefill-held token keep their bytes, and so does everything else.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

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
from vllm_ascend_mooncake.testing.kv_reference import (
    LAYOUT_KINDS,
    AddressSpace,
    ReferencePrompt,
    cpu_like_packing,
    execute_plan,
    owned_heads,
    region_layouts,
    region_table,
    table_bytes,
)

GiB = 1 << 30


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Case:
    heads: int
    prefill_tp: int
    decode_tp: int
    kind: str
    prefill_block: int
    decode_block: int
    num_tokens: int
    cached_blocks: int  # decode blocks of the prompt already cached on decode
    num_layers: int = 1
    head_token_bytes: int = 4
    extra_blocks: int = 2
    id_style: str = "shuffled"
    prefill_pad: int = 0
    decode_pad: int = 0
    coalesce_runs: bool = True
    cap: int = 1024
    staging_blocks: int = 64
    seed: int = 0
    flip_single_head: bool = False
    max_descriptor_bytes: int = 0
    pass_num_tokens: bool = True
    token_unit: int = 1  # packing unit of packed_head_major chunks

    @property
    def is_mla(self) -> bool:
        return self.kind == "latent"

    @property
    def prefill_blocks(self) -> int:
        return cdiv(self.num_tokens, self.prefill_block)

    @property
    def decode_blocks(self) -> int:
        return cdiv(self.num_tokens, self.decode_block)


def _ids(rng: np.random.Generator, count: int, total: int, style: str) -> list[int]:
    if style == "contiguous":
        start = int(rng.integers(0, total - count + 1))
        return list(range(start, start + count))
    ids = rng.permutation(total)[:count].tolist()
    return sorted(ids) if style == "sorted" else ids


def run_case(case: Case, decode_rank: int) -> RequestPlan | None:
    """Fill prefill memories token by token, plan, execute, compare every decode byte.

    Different block sizes with head-major blocks of unknown packing must be refused instead."""
    topo = TransferTopology(case.heads, case.prefill_tp, case.decode_tp, is_mla=case.is_mla)
    num_heads = 1 if case.is_mla else case.heads
    num_regions = len(region_layouts(case.kind, case.num_layers, 1, 1, 1, 1, 0))
    rng = np.random.default_rng(case.seed)
    prefill_count = case.prefill_blocks
    local_count = case.decode_blocks - case.cached_blocks
    remote_total = prefill_count + case.extra_blocks
    local_total = max(local_count, 1) + case.extra_blocks
    remote_ids = _ids(rng, prefill_count, remote_total, case.id_style)
    local_ids = _ids(rng, local_count, local_total, case.id_style)
    # Every slot of the prompt's prefill blocks holds a token (past the prompt: what a real
    # engine leaves there, which moves with its block).
    ref = ReferencePrompt.random(
        num_regions,
        prefill_count * case.prefill_block,
        num_heads,
        case.head_token_bytes,
        seed=case.seed + 7,
    )

    remote_spaces, remote_tables, snapshots = {}, {}, {}
    for p in range(case.prefill_tp):
        heads = owned_heads(num_heads, case.prefill_tp, p, case.is_mla)
        layouts = region_layouts(
            case.kind,
            case.num_layers,
            len(heads),
            case.prefill_block,
            case.head_token_bytes,
            remote_total,
            case.prefill_pad,
            case.flip_single_head,
            case.token_unit,
        )
        base = (p + 1) * GiB
        memory = rng.integers(0, 256, table_bytes(layouts), dtype=np.uint8)
        regions, offsets = region_table(f"p{p}.", base, layouts)
        ref.place(memory, layouts, offsets, heads, remote_ids)
        space = AddressSpace()
        space.add(base, memory)
        remote_spaces[p], remote_tables[p] = space, regions
        snapshots[p] = memory.copy()

    my_heads = owned_heads(num_heads, case.decode_tp, decode_rank, case.is_mla)
    local_layouts = region_layouts(
        case.kind,
        case.num_layers,
        len(my_heads),
        case.decode_block,
        case.head_token_bytes,
        local_total,
        case.decode_pad,
        case.flip_single_head,
        case.token_unit,
    )
    local_base = 100 * GiB
    local_memory = rng.integers(0, 256, table_bytes(local_layouts), dtype=np.uint8)
    before = local_memory.copy()
    local_regions, local_offsets = region_table("d.", local_base, local_layouts)
    local_space = AddressSpace()
    local_space.add(local_base, local_memory)
    staging_base = 200 * GiB
    prefill_heads = max(
        len(owned_heads(num_heads, case.prefill_tp, p, case.is_mla)) for p in range(case.prefill_tp)
    )
    # Prefill ranks read in parallel share the staging buffer.
    parallel_reads = len({pull.prefill_rank for pull in topo.pulls_for(decode_rank, case.seed)})
    staging_capacity = (
        case.staging_blocks
        * parallel_reads
        * prefill_heads
        * case.prefill_block
        * case.head_token_bytes
    )
    local_space.add(staging_base, np.zeros(staging_capacity, dtype=np.uint8))

    def plan() -> RequestPlan:
        return plan_request(
            topo,
            decode_rank,
            case.seed,
            local_regions,
            remote_tables,
            local_ids,
            remote_ids,
            PlanOptions(
                max_descriptors_per_batch=case.cap,
                coalesce_runs=case.coalesce_runs,
                staging=StagingArea(staging_base, staging_capacity),
                max_descriptor_bytes=case.max_descriptor_bytes,
            ),
            num_tokens=case.num_tokens if case.pass_num_tokens else None,
        )

    local_layout, remote_layout = local_layouts[0], remote_tables[0][0].layout
    if (
        case.prefill_block != case.decode_block
        and effective_order(local_layout, remote_layout) is BlockOrder.HEAD_MAJOR
        and not (local_layout.packing and remote_layout.packing)
    ):
        with pytest.raises(LayoutError, match="with head-major blocks whose packing is unknown"):
            plan()
        return None
    plan = plan()
    execute_plan(plan, local_space, remote_spaces)

    expected = before.copy()
    ref.place(
        expected, local_layouts, local_offsets, my_heads, local_ids, first_block=case.cached_blocks
    )
    if not np.array_equal(local_memory, expected):
        wrong = np.flatnonzero(local_memory != expected)
        raise AssertionError(f"{len(wrong)} wrong decode bytes, first at offset {wrong[0]}")
    for p, memory in snapshots.items():
        assert np.array_equal(remote_spaces[p].view((p + 1) * GiB, len(memory)), memory)
    for peer in plan.peers:
        assert all(0 < len(batch) <= case.cap for batch in peer.batches)
        if case.max_descriptor_bytes:  # staged reads are whole prefill blocks, at least one
            largest_block = max(r.layout.block_len for r in remote_tables[peer.prefill_rank])
            limit = max(case.max_descriptor_bytes, largest_block)
            assert all(b.lengths.max() <= limit for b in peer.batches)
    return plan


@st.composite
def cases(draw) -> tuple[Case, int]:
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
    pass_num_tokens = draw(st.booleans()) if decode_block >= prefill_block else True
    case = Case(
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
        pass_num_tokens=pass_num_tokens,
        token_unit=token_unit,
    )
    return case, draw(st.integers(0, decode_tp - 1))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_plan_with_different_block_sizes_reproduces_reference_bytes(
    sample: tuple[Case, int],
) -> None:
    case, decode_rank = sample
    run_case(case, decode_rank)


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize("tps", [(1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (4, 2), (2, 4)])
@pytest.mark.parametrize("blocks", [(2, 4), (2, 8), (4, 2), (8, 2), (4, 4)])
@pytest.mark.parametrize("cached_blocks", [0, 1])
def test_every_layout_tp_pair_and_ratio(kind, tps, blocks, cached_blocks) -> None:
    prefill_tp, decode_tp = tps
    prefill_block, decode_block = blocks
    case = Case(
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
        run_case(case, decode_rank)


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
    2 tokens (its only prefill block), so its swap covers 2 rows."""
    case = Case(
        heads=2,
        prefill_tp=2,
        decode_tp=1,
        kind="fused_token_major",
        prefill_block=2,
        decode_block=4,
        num_tokens=5,
        cached_blocks=0,
    )
    plan = run_case(case, 0)
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
