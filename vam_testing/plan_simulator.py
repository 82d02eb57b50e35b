"""One simulator for the planner's tests: fill prefill memories from a reference prompt, plan a
pull, execute the plan on numpy memories and compare every decode byte.

A case may give the model's layers and a draft model's layers different total KV heads
(``draft_heads``): the draft layers' regions are then a head group of their own, sharded and
pulled by their own count, placed among the model's regions.

The expected decode bytes come from :class:`~.kv_reference.ReferencePrompt`: token ``t`` of the
prompt sits in a side's ``t // B``-th block of the request at slot ``t % B``, whatever the other
side's block size, so equal and different block sizes are checked by the same rule. Decode slots
past the last prefill-held token keep their bytes, and so does every other byte of decode's
memory, padding and other blocks included; prefill's memories are never written.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from vllm_ascend_mooncake.core.layout import RegionLayout
from vllm_ascend_mooncake.core.plan import PlanOptions, RequestPlan, StagingArea, plan_request
from vllm_ascend_mooncake.core.topology import TransferTopology

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
    # total KV heads of draft layers with a head group of their own (0: none), how many such
    # layers, and after how many of the model's layers they come
    draft_heads: int = 0
    draft_layers: int = 1
    draft_position: int = 0

    @property
    def is_mla(self) -> bool:
        return self.kind == "latent"

    def topology(self) -> TransferTopology:
        extra = (self.draft_heads,) if self.draft_heads else ()
        return TransferTopology(
            self.heads, self.prefill_tp, self.decode_tp, is_mla=self.is_mla, extra_kv_heads=extra
        )

    def region_groups(self) -> list[int]:
        """Each region's head group, its total KV heads (0: the model's), in region order."""
        per_layer = len(region_layouts(self.kind, 1, 1, 1, 1, 1, 0))
        model = [0] * (self.num_layers * per_layer)
        if not self.draft_heads:
            return model
        at = min(self.draft_position, self.num_layers) * per_layer
        return model[:at] + [self.draft_heads] * (self.draft_layers * per_layer) + model[at:]

    @property
    def prompt_tokens(self) -> int:
        if self.num_tokens is not None:
            return self.num_tokens
        return len(self.remote_ids) * self.prefill_block

    @property
    def cached_blocks(self) -> int:
        """Decode blocks of the prompt already cached on decode (not pulled)."""
        return cdiv(self.prompt_tokens, self.decode_block) - len(self.local_ids)


def equal_blocks(
    kind: str,
    heads: int,
    tps: tuple[int, int],
    block: int,
    remote_ids: Iterable[int],
    local_ids: Iterable[int],
    **fields: Any,
) -> PullCase:
    """A :class:`PullCase` at ``tps`` (prefill TP, decode TP) whose prefill and decode blocks
    both hold ``block`` tokens; ``fields``: the rest, where not :class:`PullCase`'s defaults."""
    ids = list(remote_ids), list(local_ids)
    return PullCase(heads, *tps, kind, block, block, *ids, **fields)


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
    topology = case.topology()
    groups = case.region_groups()
    num_regions = len(groups)
    remote_total = case.remote_blocks or max(case.remote_ids, default=-1) + 1
    local_total = case.local_blocks or max(case.local_ids, default=-1) + 1
    rng = np.random.default_rng(case.seed)
    reference = ReferencePrompt.random(
        num_regions,
        len(case.remote_ids) * case.prefill_block,
        1 if case.is_mla else max(case.heads, case.draft_heads),
        case.head_token_bytes,
        seed=case.seed + 7,
    )

    def heads_of(group: int, tp: int, rank: int) -> list[int]:
        return owned_heads(group or case.heads, tp, rank, case.is_mla)

    def layouts_of(tp: int, rank: int, block: int, total: int, pad: int) -> list[RegionLayout]:
        """One layout per region, each holding what its head group gives rank ``rank``."""
        return [
            replace(
                region_layouts(
                    case.kind,
                    1,
                    len(heads_of(group, tp, rank)),
                    block,
                    case.head_token_bytes,
                    total,
                    pad,
                    case.flip_single_head,
                    case.token_unit,
                )[0],
                kv_heads=group,
            )
            for group in groups
        ]

    def place(memory, layouts, offsets, tp: int, rank: int, ids, first_block: int = 0) -> None:
        for i, (layout, offset) in enumerate(zip(layouts, offsets, strict=True)):
            heads = heads_of(groups[i], tp, rank)
            reference.place(memory, [layout], [offset], heads, ids, first_block, first_region=i)

    remote_spaces, remote_tables, snapshots = {}, {}, {}
    largest_prefill_block = 0
    for p in range(case.prefill_tp):
        layouts = layouts_of(case.prefill_tp, p, case.prefill_block, remote_total, case.prefill_pad)
        largest_prefill_block = max([largest_prefill_block] + [x.block_len for x in layouts])
        base = (p + 1) * GiB
        memory = rng.integers(0, 256, table_bytes(layouts), dtype=np.uint8)
        regions, offsets = region_table(f"p{p}.", base, layouts)
        place(memory, layouts, offsets, case.prefill_tp, p, case.remote_ids)
        space = AddressSpace()
        space.add(base, memory)
        remote_spaces[p], remote_tables[p], snapshots[p] = space, regions, memory.copy()

    local_layouts = layouts_of(
        case.decode_tp, decode_rank, case.decode_block, local_total, case.decode_pad
    )
    local_memory = rng.integers(0, 256, table_bytes(local_layouts), dtype=np.uint8)
    expected = local_memory.copy()
    local_regions, local_offsets = region_table("d.", LOCAL_BASE, local_layouts)
    local_space = AddressSpace()
    local_space.add(LOCAL_BASE, local_memory)
    # Prefill ranks read in parallel share the staging buffer.
    parallel_reads = len(topology.prefill_ranks_for(decode_rank, case.seed))
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

    place(
        expected,
        local_layouts,
        local_offsets,
        case.decode_tp,
        decode_rank,
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
