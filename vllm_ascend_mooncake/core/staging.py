"""Reads through decode's staging buffer (pure): units of prefill bytes to stage, packed into
batches that fit a staging area and the descriptor cap, each batch carrying the row copies that
move the needed bytes out of staging once it landed.

Two kinds of staged units exist: runs of whole token-major prefill blocks of which decode keeps a
head slice (:class:`StagedRun`, :mod:`.plan`), and head-major chunks cut by token when block sizes
differ (:mod:`.plan_tokens`). Which pulls stage is decided in :func:`.plan.needs_staging`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np

from .plan_types import PlanError, PlanOptions, RowCopies, StagingArea, TransferBatch


class Staged(Protocol):
    """Something read through staging: ``num_blocks`` units of ``block_len`` bytes, contiguous
    from ``remote_addr``, any number of which can be read at once, and the copies that move the
    units' needed bytes from where they were staged into the KV blocks."""

    remote_addr: int
    num_blocks: int
    block_len: int
    #: whether batches of these units alternate between the two halves of the staging area, so
    #: that their copies overlap the next read (:func:`stage_batches`)
    double_buffered: ClassVar[bool]

    def copies(self, staged_at: int, first: int, count: int) -> list[RowCopies]:
        """Copies for units ``first..first+count-1``, staged contiguously from ``staged_at``."""
        ...


@dataclass(frozen=True)
class StagedRun:
    """A run of whole prefill blocks to read into staging, and where its needed heads go."""

    remote_addr: int
    num_blocks: int
    block_len: int
    rows_per_block: int
    src_offset: int  # of the needed heads within a staged token row
    src_stride: int
    dst_addr: int
    dst_stride: int
    row_bytes: int
    # A head slice is long rows, at most half of what was read: halving the batches cost more
    # than overlapping saved (bench_transfer, token-major 1 -> 2 on 2 cores: 5% slower, more CPU).
    double_buffered: ClassVar[bool] = False

    def copies(self, staged_at: int, first: int, count: int) -> list[RowCopies]:
        return [
            RowCopies(
                src_addrs=np.array([staged_at + self.src_offset], dtype=np.int64),
                dst_addrs=np.array(
                    [self.dst_addr + first * self.rows_per_block * self.dst_stride],
                    dtype=np.int64,
                ),
                src_stride=self.src_stride,
                dst_stride=self.dst_stride,
                rows=count * self.rows_per_block,
                row_bytes=self.row_bytes,
            )
        ]


def stage_batches(
    runs: Sequence[Staged], options: PlanOptions, staging: StagingArea | None
) -> list[TransferBatch]:
    """Pack staged reads into batches that fit the staging area and the descriptor cap.

    Units that are ``double_buffered``, where the area holds two of the largest, land batch by
    batch in its two halves in turn, so that one batch's row copies can run while the next batch
    is read (the receiver overlaps them where :func:`copies_must_finish_first` allows);
    otherwise every batch reuses the whole area and its copies must run before the next read.
    A staged read spans at most ``max_descriptor_bytes`` (whole prefill blocks, at least one),
    as direct reads do.
    """
    if staging is None:
        raise PlanError(
            "this request reads prefill blocks through a staging buffer (a slice of token-major "
            "blocks, prefill TP < decode TP, or head-major blocks of another block size), but "
            "none was configured"
        )
    batches: list[TransferBatch] = []
    local: list[int] = []
    remote: list[int] = []
    lengths: list[int] = []
    copies: list[RowCopies] = []

    def flush() -> None:
        if local:
            batches.append(
                TransferBatch(
                    np.array(local, dtype=np.int64),
                    np.array(remote, dtype=np.int64),
                    np.array(lengths, dtype=np.int64),
                    list(copies),
                )
            )
        local.clear()
        remote.clear()
        lengths.clear()
        copies.clear()

    largest = max((run.block_len for run in runs), default=0)
    if largest > staging.capacity:
        raise PlanError(
            f"staging area of {staging.capacity} B (the staging buffer, split between the "
            f"prefill ranks a request reads in parallel) cannot hold one prefill block of "
            f"{largest} B; raise kv_connector_extra_config['staging_buffer_mib']"
        )
    double = bool(runs) and all(run.double_buffered for run in runs)
    halves = 2 if double and staging.capacity >= 2 * largest else 1
    capacity = staging.capacity // halves
    used = 0
    for run in runs:
        done = 0
        while done < run.num_blocks:
            fit = min(run.num_blocks - done, (capacity - used) // run.block_len)
            if options.max_descriptor_bytes:
                fit = min(fit, max(1, options.max_descriptor_bytes // run.block_len))
            if fit == 0 or len(local) == options.max_descriptors_per_batch:
                flush()
                used = 0
                continue
            staged_at = staging.base + (len(batches) % halves) * capacity + used
            local.append(staged_at)
            remote.append(run.remote_addr + done * run.block_len)
            lengths.append(fit * run.block_len)
            copies.extend(run.copies(staged_at, done, fit))
            used += fit * run.block_len
            done += fit
    flush()
    return batches


def staging_share(staging: StagingArea | None, index: int, count: int) -> StagingArea | None:
    """Share ``index`` of ``count`` equal parts of the staging area."""
    if staging is None or count == 1:
        return staging
    size = staging.capacity // count
    return StagingArea(staging.base + index * size, size)


def copies_must_finish_first(landed: TransferBatch, following: TransferBatch) -> bool:
    """Whether ``following``'s read must wait for the row copies of ``landed`` (a batch that
    landed before it): it would write bytes those copies still read or write. Conservative:
    each copy pair counts as the whole span from its first byte to its last."""
    if not landed.after_landing or not len(following):
        return False
    starts = following.local_addrs
    ends = starts + following.lengths
    for group in landed.after_landing:
        extent = group.row_bytes + (group.rows - 1) * group.src_stride
        extent += (group.planes - 1) * group.src_plane_stride
        if _overlap(group.src_addrs, group.src_addrs + extent, starts, ends):
            return True
        extent = group.row_bytes + (group.rows - 1) * group.dst_stride
        extent += (group.planes - 1) * group.dst_plane_stride
        if _overlap(group.dst_addrs, group.dst_addrs + extent, starts, ends):
            return True
    return False


def _overlap(
    starts_a: np.ndarray, ends_a: np.ndarray, starts_b: np.ndarray, ends_b: np.ndarray
) -> bool:
    """Whether any interval ``[starts_a[i], ends_a[i])`` meets any ``[starts_b[j], ends_b[j])``."""
    if not len(starts_a) or not len(starts_b):
        return False
    order = np.argsort(starts_b, kind="stable")
    sorted_starts = starts_b[order]
    reach = np.maximum.accumulate(ends_b[order])  # furthest end among intervals starting so far
    # for each interval of a: those of b that start before it ends; does one end after it starts
    before = np.searchsorted(sorted_starts, ends_a, side="left")
    has_any = before > 0
    return bool(np.any(reach[np.maximum(before - 1, 0)][has_any] > starts_a[has_any]))
