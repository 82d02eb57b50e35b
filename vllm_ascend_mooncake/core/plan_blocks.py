"""Plan a request whose prefill and decode blocks hold the same number of tokens (pure).

Decode blocks pair with the suffix of the prefill blocks (:func:`align_block_ids`: decode may
cache a prefix), in runs consecutive on both sides (:class:`BlockRuns`); each region pair moves as
its :class:`~.descriptors.MoveKind` says, as :mod:`.plan`'s docstring describes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .descriptors import (
    MoveKind,
    PeerDescriptors,
    assemble_plan,
    check_region_tables,
    move_kind,
    needs_staging,
    run_offsets,
)
from .layout import BlockOrder, Region, RegionLayout, effective_order
from .plan_types import PlanError, PlanOptions, RequestPlan, RequestPulls, SwapAxes
from .staging import Staged, StagedRun
from .topology import HeadPull


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
        offsets = run_offsets(self.lengths)
        return BlockRuns(
            np.repeat(self.local_starts, self.lengths) + offsets,
            np.repeat(self.remote_starts, self.lengths) + offsets,
            np.ones(int(self.lengths.sum()), dtype=np.int64),
        )

    def __len__(self) -> int:
        return len(self.lengths)


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


def plan_equal_block_sizes(
    request: RequestPulls,
    local_regions: Sequence[Region],
    remote_regions: Mapping[int, Sequence[Region]],
    local_block_ids: Sequence[int],
    remote_block_ids: Sequence[int],
    options: PlanOptions,
    num_tokens: int | None = None,
) -> RequestPlan:
    """Plan every read of one request whose block sizes are equal on both sides (the prompt
    length ``num_tokens`` is not needed: decode blocks pair with prefill's last blocks)."""
    local_ids, remote_ids = align_block_ids(local_block_ids, remote_block_ids)
    runs = BlockRuns.of(local_ids, remote_ids, coalesce=True)
    check_region_tables(request, local_regions, remote_regions, local_ids, remote_ids)

    per_peer = {rank: PeerDescriptors() for rank in request.prefill_ranks}
    staged: dict[int, list[Staged]] = {}
    fixups: list[SwapAxes] = []

    for i, local in enumerate(local_regions):
        pulls = request.by_region[i]
        num_pulls = len(pulls)
        peers = [remote_regions[p.prefill_rank][i] for p in pulls]
        kind = move_kind(local.layout, peers[0].layout, pulls[0])
        all_dense = local.layout.dense and all(r.layout.dense for r in peers)
        head_major = effective_order(local.layout, peers[0].layout) is BlockOrder.HEAD_MAJOR
        if kind == MoveKind.MERGE:
            coalesce = options.coalesce_runs and not (
                head_major
                and options.block_reads_from_bytes
                and peers[0].layout.block_len >= options.block_reads_from_bytes
            )
            region_runs = runs if all_dense and coalesce else runs.split_blocks()
            for pull, remote in zip(pulls, peers, strict=True):
                _add_merge(per_peer[pull.prefill_rank], local, remote, region_runs, pull)
            fixups.extend(_merge_fixups(local, peers[0].layout, region_runs, num_pulls, head_major))
        elif kind == MoveKind.WHOLE:
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

    return assemble_plan(request, per_peer, staged, fixups, options)


def _add_whole_blocks(out: PeerDescriptors, local: Region, remote: Region, runs: BlockRuns) -> None:
    out.add(
        local.base + runs.local_starts * local.layout.block_stride,
        remote.base + runs.remote_starts * remote.layout.block_stride,
        runs.lengths * local.layout.block_len,
    )


def _add_merge(
    out: PeerDescriptors, local: Region, remote: Region, runs: BlockRuns, pull: HeadPull
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
    out: PeerDescriptors, local: Region, remote: Region, blocks: BlockRuns, pull: HeadPull
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
