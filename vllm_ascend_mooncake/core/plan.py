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

Different block sizes (one dividing the other, e.g. prefill 32 and decode 64 tokens) are planned
separately, token-aligned, by :mod:`.plan_tokens`; equal block sizes never take that path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .layout import (
    BlockOrder,
    LayoutError,
    Region,
    RegionLayout,
    check_pairable,
    effective_order,
)

# What a plan is made of lives in plan_types; it is part of this module's interface.
from .plan_types import (
    PeerPlan,
    PlanError,
    PlanOptions,
    RequestPlan,
    RowCopies,
    StagingArea,
    SwapAxes,
    TransferBatch,
)
from .staging import Staged, StagedRun, stage_batches, staging_share
from .topology import HeadPull, TransferTopology

__all__ = [
    "BlockRuns",
    "PeerPlan",
    "PlanError",
    "PlanOptions",
    "RequestPlan",
    "RowCopies",
    "StagingArea",
    "SwapAxes",
    "TransferBatch",
    "align_block_ids",
    "block_sizes_differ",
    "check_region_tables",
    "may_need_staging",
    "needs_staging",
    "plan_request",
    "request_needs_staging",
]


# ----------------------------------------------------------------------------------------------
# Block runs


@dataclass(frozen=True)
class BlockRuns:
    """Runs of blocks consecutive on both sides: ``local[i]..+lengths[i]`` <- ``remote[i]..``."""

    local_starts: np.ndarray
    remote_starts: np.ndarray
    lengths: np.ndarray

    @classmethod
    def of(cls, local_ids: np.ndarray, remote_ids: np.ndarray, coalesce: bool) -> BlockRuns:
        if len(local_ids) == 0:
            empty = np.zeros(0, dtype=np.int64)
            return cls(empty, empty, empty)
        if not coalesce:
            return cls(local_ids, remote_ids, np.ones(len(local_ids), dtype=np.int64))
        breaks = (np.diff(local_ids) != 1) | (np.diff(remote_ids) != 1)
        starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
        lengths = np.diff(np.concatenate((starts, [len(local_ids)])))
        return cls(local_ids[starts], remote_ids[starts], lengths.astype(np.int64))

    def split_blocks(self) -> BlockRuns:
        """The same blocks as runs of one."""
        offsets = _run_offsets(self.lengths)
        return BlockRuns(
            np.repeat(self.local_starts, self.lengths) + offsets,
            np.repeat(self.remote_starts, self.lengths) + offsets,
            np.ones(int(self.lengths.sum()), dtype=np.int64),
        )

    def __len__(self) -> int:
        return len(self.lengths)


def _run_offsets(lengths: np.ndarray) -> np.ndarray:
    """``[0..l0-1, 0..l1-1, ...]`` for run lengths ``l``."""
    total = int(lengths.sum())
    ends = np.cumsum(lengths)
    return np.arange(total, dtype=np.int64) - np.repeat(ends - lengths, lengths)


def _check_ids(ids: np.ndarray, num_blocks: int, side: str, region: str) -> None:
    if len(ids) and (ids.min() < 0 or ids.max() >= num_blocks):
        bad = ids[(ids < 0) | (ids >= num_blocks)][0]
        raise PlanError(
            f"{side} block id {int(bad)} is outside {region} (which has {num_blocks} blocks)"
        )


def align_block_ids(
    local_block_ids: Sequence[int], remote_block_ids: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Pair decode blocks with prefill blocks.

    The decode side may already hold a cached prefix, so it reads only the suffix of the prefill
    blocks.
    """
    local = np.asarray(local_block_ids, dtype=np.int64).reshape(-1)
    remote = np.asarray(remote_block_ids, dtype=np.int64).reshape(-1)
    if len(local) > len(remote):
        raise PlanError(
            f"decode side wants {len(local)} blocks but the prefill side holds only {len(remote)}"
        )
    return local, remote[len(remote) - len(local) :]


# ----------------------------------------------------------------------------------------------
# Planning


class _MoveKind:
    WHOLE = "whole"
    MERGE = "merge"
    SLICE = "slice"


def _move_kind(local: RegionLayout, remote: RegionLayout, pull: HeadPull) -> str:
    if local.block_order is BlockOrder.LATENT:
        return _MoveKind.WHOLE
    n = pull.num_heads
    if n == remote.num_heads == local.num_heads:
        return _MoveKind.WHOLE
    if n == remote.num_heads < local.num_heads:
        return _MoveKind.MERGE
    if n == local.num_heads < remote.num_heads:
        return _MoveKind.SLICE
    raise LayoutError(
        f"a pull of {n} heads fits neither the prefill region ({remote.num_heads} heads) nor "
        f"the decode region ({local.num_heads} heads)"
    )


def needs_staging(local: RegionLayout, remote: RegionLayout, pull: HeadPull) -> bool:
    """Whether ``pull`` of this region pair lands through a staging buffer:

    * a slice of the prefill heads from token-major blocks, whose head rows interleave per token
      (head-major blocks give one contiguous run per head, read in place);
    * head-major blocks of different sizes, whose chunks are cut by token row by row
      (:mod:`.plan_tokens`).

    The one place this is decided: the planner stages by it, and the receiver asks it (through
    :func:`request_needs_staging`) whether a request needs a staging area."""
    head_major = effective_order(local, remote) is BlockOrder.HEAD_MAJOR
    if head_major:
        return local.tokens_per_block != remote.tokens_per_block
    return _move_kind(local, remote, pull) == _MoveKind.SLICE


def request_needs_staging(
    local_regions: Sequence[Region],
    remote_regions: Mapping[int, Sequence[Region]],
    pulls: Sequence[HeadPull],
) -> bool:
    """Whether any (region, pull) of a request lands through staging (:func:`needs_staging`)."""
    return any(
        needs_staging(local.layout, remote_regions[pull.prefill_rank][i].layout, pull)
        for pull in pulls
        for i, local in enumerate(local_regions)
        if pull.prefill_rank in remote_regions and i < len(remote_regions[pull.prefill_rank])
    )


def may_need_staging(topology: TransferTopology, local: RegionLayout | None = None) -> bool:
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


@dataclass
class _PeerDescriptors:
    local: list[np.ndarray] = field(default_factory=list)
    remote: list[np.ndarray] = field(default_factory=list)
    lengths: list[np.ndarray] = field(default_factory=list)

    def add(self, local: np.ndarray, remote: np.ndarray, length: np.ndarray | int) -> None:
        local = np.asarray(local, dtype=np.int64)
        self.local.append(local)
        self.remote.append(np.asarray(remote, dtype=np.int64))
        self.lengths.append(np.broadcast_to(np.asarray(length, dtype=np.int64), local.shape))

    def batches(self, cap: int, max_bytes: int = 0) -> list[TransferBatch]:
        if not self.local:
            return []
        local = np.concatenate(self.local)
        remote = np.concatenate(self.remote)
        lengths = np.concatenate(self.lengths)
        if max_bytes and len(lengths) and lengths.max() > max_bytes:
            local, remote, lengths = _split_descriptors(local, remote, lengths, max_bytes)
        return [
            TransferBatch(local[i : i + cap], remote[i : i + cap], lengths[i : i + cap].copy())
            for i in range(0, len(local), cap)
        ]


def _split_descriptors(
    local: np.ndarray, remote: np.ndarray, lengths: np.ndarray, max_bytes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut every descriptor into pieces of at most ``max_bytes`` (contiguous on both sides)."""
    pieces = -(-lengths // max_bytes)
    offsets = _run_offsets(pieces) * max_bytes
    starts_local = np.repeat(local, pieces) + offsets
    starts_remote = np.repeat(remote, pieces) + offsets
    sizes = np.minimum(np.repeat(lengths, pieces) - offsets, max_bytes)
    return starts_local, starts_remote, sizes


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
) -> RequestPlan:
    """Plan every read decode rank ``decode_rank`` issues for one request.

    ``remote_regions`` maps each prefill rank the decode rank reads to its regions, in the same
    order as ``local_regions`` (layer by layer, K before V where they are separate).

    ``num_tokens`` is the prompt length. Equal block sizes ignore it (decode blocks pair with the
    suffix of the prefill blocks); different block sizes (:func:`align_tokens`) check the block
    counts against it, and need it when the prefill block is the larger one.
    """
    options = options or PlanOptions()
    pulls = topology.pulls_for(decode_rank, seed)
    if block_sizes_differ(local_regions, remote_regions, pulls):
        # Imported here: that module builds on this one's descriptor and staging helpers.
        from .plan_tokens import plan_mixed_block_sizes

        return plan_mixed_block_sizes(
            pulls,
            local_regions,
            remote_regions,
            local_block_ids,
            remote_block_ids,
            options,
            num_tokens,
        )
    local_ids, remote_ids = align_block_ids(local_block_ids, remote_block_ids)
    runs = BlockRuns.of(local_ids, remote_ids, coalesce=True)
    num_pulls = len(pulls)
    check_region_tables(pulls, local_regions, remote_regions, local_ids, remote_ids)

    per_peer = {pull.prefill_rank: _PeerDescriptors() for pull in pulls}
    staged: dict[int, list[Staged]] = {}
    fixups: list[SwapAxes] = []

    for i, local in enumerate(local_regions):
        peers = [remote_regions[p.prefill_rank][i] for p in pulls]
        kind = _move_kind(local.layout, peers[0].layout, pulls[0])
        all_dense = local.layout.dense and all(r.layout.dense for r in peers)
        head_major = effective_order(local.layout, peers[0].layout) is BlockOrder.HEAD_MAJOR
        if kind == _MoveKind.MERGE:
            coalesce = options.coalesce_runs and not (
                head_major
                and options.block_reads_from_bytes
                and peers[0].layout.block_len >= options.block_reads_from_bytes
            )
            region_runs = runs if all_dense and coalesce else runs.split_blocks()
            for pull, remote in zip(pulls, peers, strict=True):
                _add_merge(per_peer[pull.prefill_rank], local, remote, region_runs, pull)
            fixups.extend(_merge_fixups(local, peers[0].layout, region_runs, num_pulls, head_major))
        elif kind == _MoveKind.WHOLE:
            region_runs = runs if all_dense else runs.split_blocks()
            for pull, remote in zip(pulls, peers, strict=True):
                _add_whole_blocks(per_peer[pull.prefill_rank], local, remote, region_runs)
        else:
            pull, remote = pulls[0], peers[0]
            if needs_staging(local.layout, remote.layout, pull):
                region_runs = runs if all_dense and options.coalesce_runs else runs.split_blocks()
                staged.setdefault(pull.prefill_rank, []).extend(
                    _staged_slice_runs(local, remote, region_runs, pull)
                )
            else:
                _add_head_slice(
                    per_peer[pull.prefill_rank], local, remote, runs.split_blocks(), pull
                )

    return _request_plan(pulls, per_peer, staged, fixups, options)


def check_region_tables(
    pulls: Sequence[HeadPull],
    local_regions: Sequence[Region],
    remote_regions: Mapping[int, Sequence[Region]],
    local_ids: np.ndarray,
    remote_ids: np.ndarray,
) -> None:
    """Refuse a request whose region tables or block ids cannot be planned: a prefill rank
    without a table, tables of different lengths, unpairable regions, ids out of range."""
    for pull in pulls:
        peer_regions = remote_regions.get(pull.prefill_rank)
        if peer_regions is None:
            raise PlanError(f"no region table for prefill rank {pull.prefill_rank}")
        if len(peer_regions) != len(local_regions):
            raise PlanError(
                f"prefill rank {pull.prefill_rank} registered {len(peer_regions)} KV regions, "
                f"the decode rank {len(local_regions)}: the two instances do not run the same model"
            )
    for i, region in enumerate(local_regions):
        _check_ids(local_ids, region.layout.num_blocks, "decode", f"local region {region.name}")
        for pull in pulls:
            remote = remote_regions[pull.prefill_rank][i]
            check_pairable(region.layout, remote.layout, name=f"region {region.name}")
            _check_ids(
                remote_ids,
                remote.layout.num_blocks,
                "prefill",
                f"region {remote.name} of prefill rank {pull.prefill_rank}",
            )


def _request_plan(
    pulls: Sequence[HeadPull],
    per_peer: Mapping[int, _PeerDescriptors],
    staged: Mapping[int, Sequence[Staged]],
    fixups: list[SwapAxes],
    options: PlanOptions,
) -> RequestPlan:
    """The request's plan: per prefill peer its direct descriptors in capped batches, then its
    staged reads (``staged``, by prefill rank). Peers are read in parallel, so each peer that
    stages gets its own equal share of the staging area."""
    peer_plans: list[PeerPlan] = []
    for pull in pulls:
        if pull.prefill_rank in (pp.prefill_rank for pp in peer_plans):
            continue
        batches = per_peer[pull.prefill_rank].batches(
            options.max_descriptors_per_batch, options.max_descriptor_bytes
        )
        peer_plans.append(
            PeerPlan(
                prefill_rank=pull.prefill_rank,
                pulls=tuple(p for p in pulls if p.prefill_rank == pull.prefill_rank),
                batches=batches,
            )
        )
    staging_peers = [pp for pp in peer_plans if staged.get(pp.prefill_rank)]
    for share, peer_plan in enumerate(staging_peers):
        area = staging_share(options.staging, share, len(staging_peers))
        peer_plan.batches.extend(stage_batches(staged[peer_plan.prefill_rank], options, area))
    return RequestPlan(peers=peer_plans, fixups=_group_swaps(fixups))


def _add_whole_blocks(
    out: _PeerDescriptors, local: Region, remote: Region, runs: BlockRuns
) -> None:
    out.add(
        local.base + runs.local_starts * local.layout.block_stride,
        remote.base + runs.remote_starts * remote.layout.block_stride,
        runs.lengths * local.layout.block_len,
    )


def _add_merge(
    out: _PeerDescriptors, local: Region, remote: Region, runs: BlockRuns, pull: HeadPull
) -> None:
    """Pull ``j`` lands its run of prefill blocks at the ``j``-th slice of the decode run's bytes.

    For a single head-major block this is exactly the pull's head offset, so the block is already
    in final order; otherwise the run is ``[k][run][n heads]`` until the swap fix-up.
    """
    prefill_block = remote.layout.block_len
    pull_index = pull.dst_heads.start // pull.num_heads
    landing = (
        local.base
        + runs.local_starts * local.layout.block_stride
        + pull_index * runs.lengths * prefill_block
    )
    out.add(
        landing,
        remote.base + runs.remote_starts * remote.layout.block_stride,
        runs.lengths * prefill_block,
    )


def _merge_fixups(
    local: Region, remote: RegionLayout, runs: BlockRuns, num_pulls: int, head_major: bool
) -> list[SwapAxes]:
    if num_pulls == 1:
        return []
    starts = local.base + runs.local_starts * local.layout.block_stride
    swaps = []
    for run_len in np.unique(runs.lengths):
        run_len = int(run_len)
        addrs = starts[runs.lengths == run_len]
        if head_major:
            if run_len == 1:
                continue  # landed in place
            swaps.append(SwapAxes(addrs, outer=num_pulls, inner=run_len, unit=remote.block_len))
        else:
            swaps.append(
                SwapAxes(
                    addrs,
                    outer=num_pulls,
                    inner=run_len * remote.tokens_per_block,
                    unit=remote.token_bytes,
                )
            )
    return swaps


def _add_head_slice(
    out: _PeerDescriptors, local: Region, remote: Region, blocks: BlockRuns, pull: HeadPull
) -> None:
    chunk = local.layout.head_chunk_bytes
    out.add(
        local.base + blocks.local_starts * local.layout.block_stride,
        remote.base
        + blocks.remote_starts * remote.layout.block_stride
        + pull.src_heads.start * chunk,
        len(pull.src_heads) * chunk,
    )


def _staged_slice_runs(
    local: Region, remote: Region, runs: BlockRuns, pull: HeadPull
) -> list[StagedRun]:
    remote_layout, local_layout = remote.layout, local.layout
    return [
        StagedRun(
            remote_addr=remote.base + int(remote_start) * remote_layout.block_stride,
            num_blocks=int(length),
            block_len=remote_layout.block_len,
            rows_per_block=remote_layout.tokens_per_block,
            src_offset=pull.src_heads.start * remote_layout.head_token_bytes,
            src_stride=remote_layout.token_bytes,
            dst_addr=local.base + int(local_start) * local_layout.block_stride,
            dst_stride=local_layout.token_bytes,
            row_bytes=local_layout.token_bytes,
        )
        for local_start, remote_start, length in zip(
            runs.local_starts, runs.remote_starts, runs.lengths, strict=True
        )
    ]


def _group_swaps(swaps: list[SwapAxes]) -> list[SwapAxes]:
    """Merge swaps of identical shape (across layers) so the fix-up runs batched."""
    grouped: dict[tuple[int, int, int], list[np.ndarray]] = {}
    for swap in swaps:
        grouped.setdefault((swap.outer, swap.inner, swap.unit), []).append(swap.addrs)
    return [
        SwapAxes(np.concatenate(addrs), outer=o, inner=i, unit=u)
        for (o, i, u), addrs in grouped.items()
    ]


def block_sizes_differ(
    local_regions: Sequence[Region],
    remote_regions: Mapping[int, Sequence[Region]],
    pulls: Sequence[HeadPull],
) -> bool:
    """Whether any region pair of these pulls has different tokens per block on the two sides."""
    for pull in pulls:
        peer = remote_regions.get(pull.prefill_rank) or ()
        for local, remote in zip(local_regions, peer, strict=False):
            if local.layout.tokens_per_block != remote.layout.tokens_per_block:
                return True
    return False
