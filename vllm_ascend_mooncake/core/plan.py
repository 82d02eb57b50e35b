"""Turn one request into byte descriptors and the local fix-up to run after they land (pure).

Inputs: the topology (who reads whom), the decode rank's regions and those of each prefill rank it
reads, and the request's block ids. Output, per prefill peer: batches of ``(local address, remote
address, length)`` descriptors for ``batch_transfer_sync_read``, capped in size because Mooncake's
TCP transport rejects batches past ~2,000 outstanding descriptors per peer; and, per request, the
in-place permutations to run once every pull has landed.

How each (decode region, pull) is moved, with ``n`` heads per pull, ``k`` pulls per decode rank:

* whole block (same heads on both sides, or MLA): block runs contiguous on both sides become one
  descriptor; no fix-up.
* merge (``n`` = prefill heads < decode heads, prefill TP > decode TP):
  - head-major, per block: pull ``j`` lands the prefill block at head offset ``j*n`` of the decode
    block; the block is then already in its final order, no fix-up.
  - head-major, run-level (``coalesce_runs``): pull ``j`` lands a whole run of prefill blocks
    contiguously at ``j/k`` of the decode run, giving ``[k][run][n heads]``; one swap of the first
    two axes gives ``[run][k][n heads]``. Descriptors scale with runs x pulls instead of blocks x
    pulls, at the cost of one local permutation. With large blocks (``block_reads_from_bytes``)
    the per-block reads are cheaper than that permutation, and are used instead.
  - token-major: per-token descriptors would be blocks x tokens x pulls tiny reads, so pull ``j``
    lands whole prefill blocks (or runs) contiguously and one swap turns ``[k][tokens][n heads]``
    into ``[tokens][k][n heads]``.
* slice (``n`` = decode heads < prefill heads, prefill TP < decode TP):
  - head-major: one descriptor per block reads exactly the needed heads; no fix-up.
  - token-major: the needed heads are scattered over every token. Per-token descriptors would cost
    ~0.1 ms each over TCP (blocks x tokens x layers of them), so instead whole prefill runs are read
    into a registered staging buffer (extra bytes: prefill/decode heads, bounded by the buffer) and
    the needed heads are copied row by row into the decode blocks as each batch lands.

Equal block sizes are planned by :mod:`.plan_blocks`; different block sizes (one dividing the
other, e.g. prefill 32 and decode 64 tokens), token-aligned, by :mod:`.plan_tokens`. Both classify
each (region pair, pull) once (:func:`~.descriptors.move_kind`) and build on
:mod:`.descriptors`; this module picks the planner and decides which pulls stage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial

from .descriptors import needs_staging
from .layout import BlockOrder, Region, RegionLayout, kernel_block_ids
from .plan_blocks import plan_equal_block_sizes
from .plan_tokens import plan_mixed_block_sizes

# What a plan is made of lives in plan_types; it is part of this module's interface.
from .plan_types import (
    PeerPlan,
    PlanError,
    PlanOptions,
    RequestPlan,
    RequestPulls,
    RowCopies,
    StagingArea,
    SwapAxes,
    TransferBatch,
)
from .topology import TransferTopology

__all__ = [
    "PeerPlan",
    "PlanError",
    "PlanOptions",
    "RequestPlan",
    "RequestPulls",
    "RowCopies",
    "StagingArea",
    "SwapAxes",
    "TransferBatch",
    "block_sizes_differ",
    "may_need_staging",
    "needs_staging",
    "plan_grouped_request",
    "plan_request",
    "request_needs_staging",
]


def plan_request(
    topology: TransferTopology,
    decode_rank: int,
    seed: int,
    local_regions: Sequence[Region],
    remote_regions: Mapping[int, Sequence[Region]],
    local_block_ids: Sequence[int],
    remote_block_ids: Sequence[int],
    options: PlanOptions | None = None,
    *,
    num_tokens: int | None = None,
    remote_suffix: bool = False,
) -> RequestPlan:
    """Plan every read decode rank ``decode_rank`` issues for one request.

    ``remote_regions`` maps each prefill rank the decode rank reads to its regions, in the same
    order as ``local_regions`` (layer by layer, K before V where they are separate). Each region
    is read with its head group's pulls (:class:`RequestPulls`); the plan has one peer for every
    prefill rank any group reads.

    ``num_tokens`` is the prompt length. Equal block sizes ignore it (decode blocks pair with the
    suffix of the prefill blocks); different block sizes (:func:`~.plan_tokens.align_tokens`)
    check the block counts against it, and need it when the prefill block is the larger one.
    ``remote_suffix``: prefill holds only the prompt's last blocks (a sliding-window group).
    """
    options = options or PlanOptions()
    request = RequestPulls.of(topology, decode_rank, seed, local_regions)
    planner = plan_equal_block_sizes
    if block_sizes_differ(local_regions, remote_regions, request.prefill_ranks):
        planner = partial(plan_mixed_block_sizes, remote_suffix=remote_suffix)
    local_ids = _in_kernel_blocks(local_block_ids, local_regions, num_tokens, "decode")
    # every peer of a request is a rank of one prefill instance: its regions are cut alike
    ranks = request.prefill_ranks
    first_peer = remote_regions.get(ranks[0], ()) if ranks else ()
    remote_ids = _in_kernel_blocks(remote_block_ids, first_peer, num_tokens, "prefill")
    return planner(
        request, local_regions, remote_regions, local_ids, remote_ids, options, num_tokens
    )


def plan_grouped_request(
    topology: TransferTopology,
    decode_rank: int,
    seed: int,
    local_regions: Sequence[Region],
    remote_regions: Mapping[int, Sequence[Region]],
    region_groups: Sequence[int],
    local_groups: Sequence[Sequence[int]],
    remote_groups: Sequence[Sequence[int]],
    options: PlanOptions | None = None,
    *,
    num_tokens: int | None = None,
) -> RequestPlan:
    """:func:`plan_request` for a model with several KV cache groups (:mod:`.groups`): region
    ``i`` belongs to group ``region_groups[i]`` and moves that group's blocks; each group is
    planned alone and the peers' batches are concatenated, group after group. No
    ``region_groups``: one group. A group whose prefill blocks are fewer than the prompt's
    (a sliding window) is the suffix of the prompt's blocks."""
    if not region_groups:
        (local_ids,), (remote_ids,) = local_groups, remote_groups
        return plan_request(
            topology,
            decode_rank,
            seed,
            local_regions,
            remote_regions,
            local_ids,
            remote_ids,
            options,
            num_tokens=num_tokens,
        )
    if len(region_groups) != len(local_regions) or len(local_groups) != len(remote_groups):
        raise PlanError(
            f"{len(local_regions)} regions in {len(region_groups)} group assignments, "
            f"{len(local_groups)} decode and {len(remote_groups)} prefill block groups"
        )
    if len(local_groups) <= max(region_groups, default=-1):
        raise PlanError(
            f"regions belong to {max(region_groups) + 1} KV cache groups, the request has "
            f"blocks for {len(local_groups)}"
        )
    peers: dict[int, PeerPlan] = {}
    fixups: list[SwapAxes] = []
    for group, (local_ids, remote_ids) in enumerate(zip(local_groups, remote_groups, strict=True)):
        members = [i for i, g in enumerate(region_groups) if g == group]
        if not members:
            continue
        plan = plan_request(
            topology,
            decode_rank,
            seed,
            [local_regions[i] for i in members],
            {rank: [regions[i] for i in members] for rank, regions in remote_regions.items()},
            local_ids,
            remote_ids,
            options,
            num_tokens=num_tokens,
            remote_suffix=True,
        )
        fixups.extend(plan.fixups)
        for peer in plan.peers:
            merged = peers.setdefault(peer.prefill_rank, PeerPlan(peer.prefill_rank, (), []))
            merged.pulls = tuple(dict.fromkeys((*merged.pulls, *peer.pulls)))
            merged.batches.extend(peer.batches)
    return RequestPlan(list(peers.values()), fixups)


def _in_kernel_blocks(
    block_ids: Sequence[int], regions: Sequence[Region], num_tokens: int | None, side: str
) -> Sequence[int]:
    """Engine block ids as the ids of the regions' own (kernel) blocks (:func:`kernel_block_ids`);
    every region of a side is cut alike."""
    cuts = {(r.layout.kernel_blocks, r.layout.tokens_per_block) for r in regions}
    if len(cuts) > 1:
        raise PlanError(
            f"{side} regions cut engine blocks into kernel blocks in different ways "
            f"({sorted(cuts)}): one request's blocks cannot be planned for all of them"
        )
    if not cuts:
        return block_ids
    ((kernel_blocks, kernel_tokens),) = cuts
    if kernel_blocks > 1 and num_tokens is None:
        raise PlanError(
            f"{side} engine blocks are {kernel_blocks} kernel blocks each: planning needs the "
            f"prompt length to know which of the last block's kernel blocks hold tokens"
        )
    return kernel_block_ids(block_ids, kernel_blocks, kernel_tokens, num_tokens)


def request_needs_staging(
    local_regions: Sequence[Region],
    remote_regions: Mapping[int, Sequence[Region]],
    request: RequestPulls,
) -> bool:
    """Whether any (region, pull) of a request lands through staging (:func:`needs_staging`)."""
    return any(
        needs_staging(local.layout, remote_regions[pull.prefill_rank][i].layout, pull)
        for i, local in enumerate(local_regions)
        for pull in request.by_region[i]
        if pull.prefill_rank in remote_regions and i < len(remote_regions[pull.prefill_rank])
    )


def may_need_staging(topology: TransferTopology, layouts: Sequence[RegionLayout] = ()) -> bool:
    """Whether any pull of this decode instance can need staging (:func:`needs_staging`), in
    any of its head groups, each judged by the first of ``layouts`` (the worker's regions; none:
    unknown) in that group (:func:`_group_may_need_staging`)."""
    first: dict[TransferTopology, RegionLayout] = {}
    for layout in layouts:
        first.setdefault(topology.group(layout.kv_heads), layout)
    return any(_group_may_need_staging(g, first.get(g)) for g in topology.head_groups)


def _group_may_need_staging(topology: TransferTopology, local: RegionLayout | None) -> bool:
    """Whether any pull of this decode instance can need staging (:func:`needs_staging`),
    decided before any peer is known. A decode instance may be fed by prefill instances of any
    TP size and block size it can pair with, so:

    * when its blocks are head-major with a known chunk packing: a prefill instance with another
      block size cuts them by token through staging;
    * when some prefill rank can hold more heads than a decode rank reads (a decode rank holds
      fewer than all heads), unless the local blocks are head-major with several heads (which
      read slices in place).

    A decode worker allocates its staging buffer by this."""
    if local is not None and local.block_order is BlockOrder.HEAD_MAJOR and local.packing:
        return True
    if topology.is_mla or topology.decode_heads_per_rank >= topology.heads:
        return False
    return local is None or local.num_heads == 1 or local.block_order is not BlockOrder.HEAD_MAJOR


def block_sizes_differ(
    local_regions: Sequence[Region],
    remote_regions: Mapping[int, Sequence[Region]],
    prefill_ranks: Sequence[int],
) -> bool:
    """Whether any region pair with these prefill ranks has different tokens per block on the
    two sides."""
    for rank in prefill_ranks:
        peer = remote_regions.get(rank) or ()
        for local, remote in zip(local_regions, peer, strict=False):
            if local.layout.tokens_per_block != remote.layout.tokens_per_block:
                return True
    return False
