"""One simulator for the planner's tests: fill prefill memories from a reference prompt, plan a
pull, execute the plan on numpy memories and compare every decode byte.

The expected decode bytes come from :class:`~.kv_reference.ReferencePrompt`: token ``t`` of the
prompt sits in a side's ``t // B``-th block of the request at slot ``t % B``, whatever the other
side's block size, so equal and different block sizes are checked by the same rule. Decode slots
past the last prefill-held token keep their bytes, and so does every other byte of decode's
memory, padding and other blocks included; prefill's memories are never written.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.plan import PlanOptions, RequestPlan, StagingArea, plan_request
from ..core.topology import TransferTopology
from .kv_reference import (
    AddressSpace,
    ReferencePrompt,
    execute_plan,
    owned_heads,
    region_layouts,
    region_table,
    table_bytes,
)

GiB = 1 << 30
LOCAL_BASE = 100 * GiB
STAGING_BASE = 200 * GiB


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PullCase:
    """One decode rank's pull of one prompt: geometry, block tables and planner options.

    ``remote_ids`` are the prompt's prefill blocks in order, every slot of them holding a token
    (past the prompt: what a real engine leaves there, which moves with its block);
    ``local_ids`` are the prompt's last decode blocks, the ones not already cached on decode.
    """

    heads: int
    prefill_tp: int
    decode_tp: int
    kind: str  # one of kv_reference.LAYOUT_KINDS
    prefill_block: int
    decode_block: int
    remote_ids: list[int]
    local_ids: list[int]
    # the prompt length; None: it fills every prefill block
    num_tokens: int | None = None
    tell_planner_num_tokens: bool = True
    # sizes of the block tables; 0: just large enough for the ids
    remote_blocks: int = 0
    local_blocks: int = 0
    num_layers: int = 1
    head_token_bytes: int = 4
    prefill_pad: int = 0
    decode_pad: int = 0
    flip_single_head: bool = False
    token_unit: int = 1  # packing unit of packed_head_major chunks
    coalesce_runs: bool = True
    block_reads_from_bytes: int = 0
    cap: int = 1024
    max_descriptor_bytes: int = 0
    staging_blocks: int = 64  # prefill blocks of staging per prefill rank read in parallel
    seed: int = 0

    @property
    def is_mla(self) -> bool:
        return self.kind == "latent"

    @property
    def prompt_tokens(self) -> int:
        if self.num_tokens is not None:
            return self.num_tokens
        return len(self.remote_ids) * self.prefill_block

    @property
    def cached_blocks(self) -> int:
        """Decode blocks of the prompt already cached on decode (not pulled)."""
        return cdiv(self.prompt_tokens, self.decode_block) - len(self.local_ids)


def draw_block_ids(rng: np.random.Generator, count: int, total: int, style: str) -> list[int]:
    """``count`` distinct block ids below ``total``: one contiguous run, sorted or shuffled."""
    if style == "contiguous":
        start = int(rng.integers(0, total - count + 1))
        return list(range(start, start + count))
    ids = rng.permutation(total)[:count].tolist()
    return sorted(ids) if style == "sorted" else ids


def simulate_pull(case: PullCase, decode_rank: int) -> RequestPlan:
    """Plan ``case`` for ``decode_rank``, execute it, and check every byte on both sides.

    Planner refusals (``PlanError``, ``LayoutError``) propagate to the caller."""
    topology = TransferTopology(case.heads, case.prefill_tp, case.decode_tp, is_mla=case.is_mla)
    num_heads = 1 if case.is_mla else case.heads
    num_regions = len(region_layouts(case.kind, case.num_layers, 1, 1, 1, 1, 0))
    remote_total = case.remote_blocks or max(case.remote_ids, default=-1) + 1
    local_total = case.local_blocks or max(case.local_ids, default=-1) + 1
    rng = np.random.default_rng(case.seed)
    reference = ReferencePrompt.random(
        num_regions,
        len(case.remote_ids) * case.prefill_block,
        num_heads,
        case.head_token_bytes,
        seed=case.seed + 7,
    )

    def layouts_of(heads: int, block: int, total: int, pad: int):
        return region_layouts(
            case.kind,
            case.num_layers,
            heads,
            block,
            case.head_token_bytes,
            total,
            pad,
            case.flip_single_head,
            case.token_unit,
        )

    remote_spaces, remote_tables, snapshots = {}, {}, {}
    for p in range(case.prefill_tp):
        heads = owned_heads(num_heads, case.prefill_tp, p, case.is_mla)
        layouts = layouts_of(len(heads), case.prefill_block, remote_total, case.prefill_pad)
        base = (p + 1) * GiB
        memory = rng.integers(0, 256, table_bytes(layouts), dtype=np.uint8)
        regions, offsets = region_table(f"p{p}.", base, layouts)
        reference.place(memory, layouts, offsets, heads, case.remote_ids)
        space = AddressSpace()
        space.add(base, memory)
        remote_spaces[p], remote_tables[p], snapshots[p] = space, regions, memory.copy()

    my_heads = owned_heads(num_heads, case.decode_tp, decode_rank, case.is_mla)
    local_layouts = layouts_of(len(my_heads), case.decode_block, local_total, case.decode_pad)
    local_memory = rng.integers(0, 256, table_bytes(local_layouts), dtype=np.uint8)
    expected = local_memory.copy()
    local_regions, local_offsets = region_table("d.", LOCAL_BASE, local_layouts)
    local_space = AddressSpace()
    local_space.add(LOCAL_BASE, local_memory)
    # Prefill ranks read in parallel share the staging buffer.
    parallel_reads = len({pull.prefill_rank for pull in topology.pulls_for(decode_rank, case.seed)})
    largest_prefill_block = max(
        len(owned_heads(num_heads, case.prefill_tp, p, case.is_mla)) for p in range(case.prefill_tp)
    ) * (case.prefill_block * case.head_token_bytes)
    staging_capacity = case.staging_blocks * parallel_reads * largest_prefill_block
    local_space.add(STAGING_BASE, np.zeros(staging_capacity, dtype=np.uint8))

    plan = plan_request(
        topology,
        decode_rank,
        case.seed,
        local_regions,
        remote_tables,
        case.local_ids,
        case.remote_ids,
        PlanOptions(
            max_descriptors_per_batch=case.cap,
            coalesce_runs=case.coalesce_runs,
            block_reads_from_bytes=case.block_reads_from_bytes,
            staging=StagingArea(STAGING_BASE, staging_capacity),
            max_descriptor_bytes=case.max_descriptor_bytes,
        ),
        num_tokens=case.prompt_tokens if case.tell_planner_num_tokens else None,
    )
    execute_plan(plan, local_space, remote_spaces)

    reference.place(
        expected,
        local_layouts,
        local_offsets,
        my_heads,
        case.local_ids,
        first_block=case.cached_blocks,
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
