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
from typing import Protocol

import numpy as np

from .plan_types import PlanError, PlanOptions, RowCopies, StagingArea, TransferBatch


class Staged(Protocol):
    """Something read through staging: ``num_blocks`` units of ``block_len`` bytes, contiguous
    from ``remote_addr``, any number of which can be read at once, and the copies that move the
    units' needed bytes from where they were staged into the KV blocks."""

    remote_addr: int
    num_blocks: int
    block_len: int

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

    A batch's staging bytes are reused by the next batch, so its row copies must run (the
    receiver does) before the next batch is issued. A staged read spans at most
    ``max_descriptor_bytes`` (whole prefill blocks, at least one), as direct reads do.
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

    used = 0
    for run in runs:
        if run.block_len > staging.capacity:
            raise PlanError(
                f"staging area of {staging.capacity} B (the staging buffer, split between the "
                f"prefill ranks a request reads in parallel) cannot hold one prefill block of "
                f"{run.block_len} B; raise kv_connector_extra_config['staging_buffer_mib']"
            )
        done = 0
        while done < run.num_blocks:
            fit = min(run.num_blocks - done, (staging.capacity - used) // run.block_len)
            if options.max_descriptor_bytes:
                fit = min(fit, max(1, options.max_descriptor_bytes // run.block_len))
            if fit == 0 or len(local) == options.max_descriptors_per_batch:
                flush()
                used = 0
                continue
            staged_at = staging.base + used
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
