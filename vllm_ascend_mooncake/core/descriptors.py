"""What both planners build on (pure): how a region pair moves (and whether it stages), per-peer
descriptor lists, and the request plan they become.

:mod:`.plan_blocks` (equal block sizes) and :mod:`.plan_tokens` (block sizes that differ) each
classify every (decode region, pull) pair with :func:`move_kind`, emit descriptors into one
:class:`PeerDescriptors` per prefill peer and staged reads per peer, and hand them to
:func:`assemble_plan`, which caps the batches, shares the staging area between the peers that
stage and groups the fix-up swaps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from .layout import BlockOrder, LayoutError, Region, RegionLayout, check_pairable, effective_order
from .plan_types import (
    PeerPlan,
    PlanError,
    PlanOptions,
    RequestPlan,
    RequestPulls,
    SwapAxes,
    TransferBatch,
)
from .staging import Staged, stage_batches, staging_share
from .topology import HeadPull


class MoveKind(Enum):
    """How a (decode region, pull) pair moves (:mod:`.plan`'s docstring has each in full)."""

    WHOLE = "whole"  # the same heads on both sides, or an MLA latent: whole blocks
    MERGE = "merge"  # several prefill ranks' heads into one decode block
    SLICE = "slice"  # some of one prefill rank's heads


def move_kind(local: RegionLayout, remote: RegionLayout, pull: HeadPull) -> MoveKind:
    """The one place a pair's kind is decided: by the heads the pull takes on each side."""
    if local.block_order is BlockOrder.LATENT:
        return MoveKind.WHOLE
    n = pull.num_heads
    if n == remote.num_heads == local.num_heads:
        return MoveKind.WHOLE
    if n == remote.num_heads < local.num_heads:
        return MoveKind.MERGE
    if n == local.num_heads < remote.num_heads:
        return MoveKind.SLICE
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
    :func:`~.plan.request_needs_staging`) whether a request needs a staging area."""
    head_major = effective_order(local, remote) is BlockOrder.HEAD_MAJOR
    if head_major:
        return local.tokens_per_block != remote.tokens_per_block
    return move_kind(local, remote, pull) == MoveKind.SLICE


@dataclass
class PeerDescriptors:
    """The direct (unstaged) descriptors one prefill peer is read with, in emission order."""

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
            local, remote, lengths = split_descriptors(local, remote, lengths, max_bytes)
        return [
            TransferBatch(local[i : i + cap], remote[i : i + cap], lengths[i : i + cap].copy())
            for i in range(0, len(local), cap)
        ]


def split_descriptors(
    local: np.ndarray, remote: np.ndarray, lengths: np.ndarray, max_bytes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut every descriptor into pieces of at most ``max_bytes`` (contiguous on both sides)."""
    pieces = -(-lengths // max_bytes)
    offsets = run_offsets(pieces) * max_bytes
    starts_local = np.repeat(local, pieces) + offsets
    starts_remote = np.repeat(remote, pieces) + offsets
    sizes = np.minimum(np.repeat(lengths, pieces) - offsets, max_bytes)
    return starts_local, starts_remote, sizes


def run_offsets(lengths: np.ndarray) -> np.ndarray:
    """``[0..l0-1, 0..l1-1, ...]`` for run lengths ``l``."""
    total = int(lengths.sum())
    ends = np.cumsum(lengths)
    return np.arange(total, dtype=np.int64) - np.repeat(ends - lengths, lengths)


def check_region_tables(
    request: RequestPulls,
    local_regions: Sequence[Region],
    remote_regions: Mapping[int, Sequence[Region]],
    local_ids: np.ndarray,
    remote_ids: np.ndarray,
) -> None:
    """Refuse a request whose region tables or block ids cannot be planned: a prefill rank
    without a table, tables of different lengths, unpairable regions, ids out of range."""
    for rank in request.prefill_ranks:
        peer_regions = remote_regions.get(rank)
        if peer_regions is None:
            raise PlanError(f"no region table for prefill rank {rank}")
        if len(peer_regions) != len(local_regions):
            raise PlanError(
                f"prefill rank {rank} registered {len(peer_regions)} KV regions, "
                f"the decode rank {len(local_regions)}: the two instances do not run the same model"
            )
    for i, region in enumerate(local_regions):
        check_block_ids(
            local_ids, region.layout.num_blocks, "decode", f"local region {region.name}"
        )
        for pull in request.by_region[i]:
            remote = remote_regions[pull.prefill_rank][i]
            check_pairable(region.layout, remote.layout, name=f"region {region.name}")
            check_block_ids(
                remote_ids,
                remote.layout.num_blocks,
                "prefill",
                f"region {remote.name} of prefill rank {pull.prefill_rank}",
            )


def check_block_ids(ids: np.ndarray, num_blocks: int, side: str, region: str) -> None:
    if len(ids) and (ids.min() < 0 or ids.max() >= num_blocks):
        bad = ids[(ids < 0) | (ids >= num_blocks)][0]
        raise PlanError(
            f"{side} block id {int(bad)} is outside {region} (which has {num_blocks} blocks)"
        )


def assemble_plan(
    request: RequestPulls,
    per_peer: Mapping[int, PeerDescriptors],
    staged: Mapping[int, Sequence[Staged]],
    fixups: list[SwapAxes],
    options: PlanOptions,
) -> RequestPlan:
    """The request's plan: per prefill peer (every rank the request reads, one whose regions
    need nothing included: it must still be told) its direct descriptors in capped batches,
    then its staged reads (``staged``, by prefill rank). Peers are read in parallel, so each
    peer that stages gets its own equal share of the staging area."""
    peer_plans = [
        PeerPlan(
            prefill_rank=rank,
            pulls=request.of_rank(rank),
            batches=per_peer[rank].batches(
                options.max_descriptors_per_batch, options.max_descriptor_bytes
            ),
        )
        for rank in request.prefill_ranks
    ]
    staging_peers = [pp for pp in peer_plans if staged.get(pp.prefill_rank)]
    for share, peer_plan in enumerate(staging_peers):
        area = staging_share(options.staging, share, len(staging_peers))
        peer_plan.batches.extend(stage_batches(staged[peer_plan.prefill_rank], options, area))
    return RequestPlan(peers=peer_plans, fixups=group_swaps(fixups))


def group_swaps(swaps: list[SwapAxes]) -> list[SwapAxes]:
    """Merge swaps of identical shape (across layers) so the fix-up runs batched."""
    grouped: dict[tuple[int, int, int], list[np.ndarray]] = {}
    for swap in swaps:
        grouped.setdefault((swap.outer, swap.inner, swap.unit), []).append(swap.addrs)
    return [
        SwapAxes(np.concatenate(addrs), outer=o, inner=i, unit=u)
        for (o, i, u), addrs in grouped.items()
    ]
