"""Plan a request whose prefill and decode block sizes differ, one dividing the other (pure).

:func:`~.plan.plan_request` sends such requests here; equal block sizes never come. Tokens move in
pieces of ``min(Bp, Bd)`` tokens (:func:`align_tokens`), so a piece never straddles a block on
either side, and the descriptors, staging and swaps reuse the equal-size planner's machinery.
Head-major blocks qualify when their chunk packing is known and alike on both sides
(:mod:`.packing`, checked by :func:`~.layout.check_pairable`): each pulled prefill block is read
into staging and cut by token, row group by row group, into the decode blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .descriptors import (
    MoveKind,
    PeerDescriptors,
    assemble_plan,
    check_region_tables,
    move_kind,
)
from .layout import BlockOrder, Region, RegionLayout, effective_order
from .plan_types import PlanError, PlanOptions, RequestPlan, RequestPulls, RowCopies, SwapAxes
from .staging import Staged, StagedRun
from .topology import HeadPull


@dataclass(frozen=True)
class TokenPieces:
    """Pieces of ``tokens`` consecutive prompt tokens, the unit moved when block sizes differ.

    Piece ``i`` holds the tokens at slots ``remote_slots[i]..+tokens`` of prefill block
    ``remote_blocks[i]``, which land at slots ``local_slots[i]..+tokens`` of decode block
    ``local_blocks[i]``. ``local_filled[i]`` is how many leading slots of that decode block the
    transfer fills (fewer than its block size only in the last decode block).
    """

    tokens: int
    local_blocks: np.ndarray
    local_slots: np.ndarray
    remote_blocks: np.ndarray
    remote_slots: np.ndarray
    local_filled: np.ndarray

    def __len__(self) -> int:
        return len(self.local_blocks)


def align_tokens(
    local_block_ids: Sequence[int],
    remote_block_ids: Sequence[int],
    *,
    decode_block_size: int,
    prefill_block_size: int,
    num_tokens: int | None = None,
    remote_suffix: bool = False,
) -> TokenPieces:
    """Pair decode and prefill blocks token by token when one block size divides the other.

    Token ``t`` of the prompt sits in prefill block ``remote[t // Bp]`` at slot ``t % Bp`` and
    lands in decode block ``t // Bd`` at slot ``t % Bd``. The decode side may cache a prefix of
    whole decode blocks: ``local_block_ids`` are the last decode blocks of the prompt, and the
    tokens before them are not read. The pieces are ``min(Bp, Bd)`` tokens, so a piece never
    straddles a block on either side. Tokens past the end of the prompt that share a moved piece
    are moved too (as with equal block sizes, where whole blocks move); decode slots that no
    prefill block covers are left untouched.

    The number of decode blocks of the prompt follows from the prefill block count when the
    decode block is the larger one; otherwise ``num_tokens`` (the prompt length) is required.

    ``remote_suffix``: prefill holds only the last of the prompt's blocks (a sliding window
    dropped the others, :mod:`.groups`); needs ``num_tokens``. Tokens before prefill's first
    block are not moved: they lie below the window, which decode's attention never reads.
    """
    decode_size, prefill_size = decode_block_size, prefill_block_size
    if decode_size % prefill_size and prefill_size % decode_size:
        raise PlanError(
            f"block size {prefill_size} on prefill vs {decode_size} on decode: neither divides "
            f"the other"
        )
    local = np.asarray(local_block_ids, dtype=np.int64).reshape(-1)
    remote = np.asarray(remote_block_ids, dtype=np.int64).reshape(-1)
    prefill_blocks = len(remote)
    remote_first = 0
    if remote_suffix and num_tokens is None:
        raise PlanError("a suffix of the prefill blocks needs the prompt length to align")
    if num_tokens is not None:
        expected = -(-num_tokens // prefill_size)
        if remote_suffix and 0 <= prefill_blocks <= expected:
            remote_first = expected - prefill_blocks
            prefill_blocks = expected
        if num_tokens < 0 or prefill_blocks != expected:
            raise PlanError(
                f"the prefill side holds {prefill_blocks} blocks of {prefill_size} tokens, but a "
                f"{num_tokens}-token prompt fills {expected}"
            )
        decode_blocks = -(-num_tokens // decode_size)
    elif decode_size >= prefill_size:
        decode_blocks = -(-(prefill_blocks * prefill_size) // decode_size)
    else:
        raise PlanError(
            f"prefill block size {prefill_size} is larger than the decode block size "
            f"{decode_size}: the prompt length (num_tokens) is needed to know how many decode "
            f"blocks it fills"
        )
    if len(local) > decode_blocks:
        raise PlanError(
            f"decode side wants {len(local)} blocks of {decode_size} tokens but the prompt fills "
            f"only {decode_blocks} (prefill holds {prefill_blocks} blocks of {prefill_size} "
            f"tokens)"
        )
    cached = decode_blocks - len(local)
    piece = min(prefill_size, decode_size)
    end = min(prefill_blocks * prefill_size, decode_blocks * decode_size)
    first = max(cached * decode_size, remote_first * prefill_size)
    starts = np.arange(first, end, piece, dtype=np.int64)
    local_index = starts // decode_size - cached
    filled = np.minimum(decode_size, end - (local_index + cached) * decode_size)
    return TokenPieces(
        tokens=piece,
        local_blocks=local[local_index],
        local_slots=starts % decode_size,
        remote_blocks=remote[starts // prefill_size - remote_first],
        remote_slots=starts % prefill_size,
        local_filled=filled,
    )


def _coalesce(
    local: np.ndarray, remote: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge consecutive descriptors that are adjacent on both sides."""
    if len(local) < 2:
        return local, remote, lengths
    joins = (local[:-1] + lengths[:-1] == local[1:]) & (remote[:-1] + lengths[:-1] == remote[1:])
    starts = np.concatenate(([0], np.flatnonzero(~joins) + 1))
    sums = np.add.reduceat(lengths, starts)
    return local[starts], remote[starts], sums.astype(np.int64)


def plan_mixed_block_sizes(
    request: RequestPulls,
    local_regions: Sequence[Region],
    remote_regions: Mapping[int, Sequence[Region]],
    local_block_ids: Sequence[int],
    remote_block_ids: Sequence[int],
    options: PlanOptions,
    num_tokens: int | None,
    remote_suffix: bool = False,
) -> RequestPlan:
    """Plan a request whose prefill and decode block sizes differ (one divides the other).

    Everything moves in token pieces (:func:`align_tokens`):

    * head-major (chunk packing known, :func:`~.layout.check_pairable`): each pull's heads of
      each needed prefill block (runs of whole blocks when the pull takes every head) are read
      into staging, then every piece is copied row by row into its decode chunk, head by head
      and row group by row group; no fix-up after.

    * token-major (and MLA latent), whole heads or merge: a piece is contiguous on both sides;
      pull ``j`` lands its pieces at the ``j``-th slice of the filled part of the decode block,
      ``[k][filled tokens][n heads]``, which one swap per decode block turns into
      ``[filled tokens][k][n heads]``.
    * token-major slice: pieces are read through the staging buffer and their needed heads
      copied row by row, as with equal block sizes.

    Adjacent descriptors are merged when ``coalesce_runs`` is set.
    """
    local_ids = np.asarray(local_block_ids, dtype=np.int64).reshape(-1)
    remote_ids = np.asarray(remote_block_ids, dtype=np.int64).reshape(-1)
    check_region_tables(request, local_regions, remote_regions, local_ids, remote_ids)
    pieces_by_sizes: dict[tuple[int, int], TokenPieces] = {}
    for i, region in enumerate(local_regions):
        for pull in request.by_region[i]:
            remote = remote_regions[pull.prefill_rank][i]
            sizes = (region.layout.tokens_per_block, remote.layout.tokens_per_block)
            if sizes not in pieces_by_sizes:
                pieces_by_sizes[sizes] = align_tokens(
                    local_ids,
                    remote_ids,
                    decode_block_size=sizes[0],
                    prefill_block_size=sizes[1],
                    num_tokens=num_tokens,
                    remote_suffix=remote_suffix,
                )

    per_peer = {rank: PeerDescriptors() for rank in request.prefill_ranks}
    staged: dict[int, list[Staged]] = {}
    fixups: list[SwapAxes] = []

    def add(pull: HeadPull, local: np.ndarray, remote: np.ndarray, length: np.ndarray) -> None:
        if options.coalesce_runs:
            local, remote, length = _coalesce(local, remote, length)
        per_peer[pull.prefill_rank].add(local, remote, length)

    for i, local in enumerate(local_regions):
        pulls = request.by_region[i]
        num_pulls = len(pulls)
        peers = [remote_regions[p.prefill_rank][i] for p in pulls]
        local_layout, remote_layout = local.layout, peers[0].layout
        pieces = pieces_by_sizes[(local_layout.tokens_per_block, remote_layout.tokens_per_block)]
        if not len(pieces):
            continue
        piece_tokens = pieces.tokens
        if effective_order(local_layout, remote_layout) is BlockOrder.HEAD_MAJOR:
            for pull, remote in zip(pulls, peers, strict=True):
                staged.setdefault(pull.prefill_rank, []).extend(
                    _staged_head_chunks(local, remote, pull, pieces, options.coalesce_runs)
                )
            continue
        kind = move_kind(local_layout, remote_layout, pulls[0])
        local_blocks = local.base + pieces.local_blocks * local_layout.block_stride
        if kind == MoveKind.SLICE:
            pull, remote = pulls[0], peers[0]
            remote_layout = remote.layout
            remote_starts = (
                remote.base
                + pieces.remote_blocks * remote_layout.block_stride
                + pieces.remote_slots * remote_layout.token_bytes
            )
            dst_starts = local_blocks + pieces.local_slots * local_layout.token_bytes
            staged.setdefault(pull.prefill_rank, []).extend(
                _merge_staged(
                    [
                        StagedRun(
                            remote_addr=int(remote_start),
                            num_blocks=1,
                            block_len=piece_tokens * remote_layout.token_bytes,
                            rows_per_block=piece_tokens,
                            src_offset=pull.src_heads.start * remote_layout.head_token_bytes,
                            src_stride=remote_layout.token_bytes,
                            dst_addr=int(dst_start),
                            dst_stride=local_layout.token_bytes,
                            row_bytes=local_layout.token_bytes,
                        )
                        for remote_start, dst_start in zip(remote_starts, dst_starts, strict=True)
                    ],
                    options.coalesce_runs,
                )
            )
        else:  # token-major or latent, whole heads or a merge of whole prefill head groups
            unit = remote_layout.token_bytes  # the pull's heads of one token
            landing = _Landing.of(pieces, local, options.coalesce_runs and local_layout.dense)
            for pull, remote in zip(pulls, peers, strict=True):
                pull_index = pull.dst_heads.start // pull.num_heads if num_pulls > 1 else 0
                add(
                    pull,
                    landing.starts + (pull_index * landing.rows + landing.row) * unit,
                    remote.base
                    + pieces.remote_blocks * remote.layout.block_stride
                    + pieces.remote_slots * unit,
                    np.full(len(pieces), piece_tokens * unit, dtype=np.int64),
                )
            if num_pulls > 1:
                starts, first = np.unique(landing.starts, return_index=True)
                rows = landing.rows[first]
                for count in np.unique(rows):
                    fixups.append(
                        SwapAxes(
                            starts[rows == count], outer=num_pulls, inner=int(count), unit=unit
                        )
                    )
    return assemble_plan(request, per_peer, staged, fixups, options)


def _merge_staged(runs: list[StagedRun], coalesce: bool) -> list[StagedRun]:
    """Join staged pieces that continue each other on both sides into longer runs."""
    if not coalesce:
        return runs
    merged: list[StagedRun] = []
    for run in runs:
        last = merged[-1] if merged else None
        if (
            last is not None
            and run.block_len == last.block_len
            and run.remote_addr == last.remote_addr + last.num_blocks * last.block_len
            and run.dst_addr
            == last.dst_addr + last.num_blocks * last.rows_per_block * last.dst_stride
        ):
            merged[-1] = StagedRun(
                remote_addr=last.remote_addr,
                num_blocks=last.num_blocks + run.num_blocks,
                block_len=last.block_len,
                rows_per_block=last.rows_per_block,
                src_offset=last.src_offset,
                src_stride=last.src_stride,
                dst_addr=last.dst_addr,
                dst_stride=last.dst_stride,
                row_bytes=last.row_bytes,
            )
        else:
            merged.append(run)
    return merged


@dataclass(frozen=True)
class _StagedChunks:
    """A run of prefill blocks whose pulled heads (``block_len`` bytes each) are read into
    staging, and the token pieces cut out of them into head-major decode chunks.

    The pieces of the run's block ``j`` are ``piece_starts[j]..piece_starts[j + 1]``;
    ``dst_chunks[p]`` is where piece ``p``'s decode block holds the pull's first head.
    """

    # Every staged byte is copied, in rows of one head and token: overlapping the copies with
    # the next read is what bench_transfer measured faster (head-major 64 -> 128 on 2 cores:
    # 7% at TP 1 -> 1, 16% at 2 -> 1).
    double_buffered: ClassVar[bool] = True

    remote_addr: int
    num_blocks: int
    block_len: int
    piece_starts: np.ndarray
    src_slots: np.ndarray
    dst_chunks: np.ndarray
    dst_slots: np.ndarray
    num_heads: int
    piece_tokens: int
    prefill_layout: RegionLayout
    decode_layout: RegionLayout

    def copies(self, staged_at: int, first: int, count: int) -> list[RowCopies]:
        lo, hi = int(self.piece_starts[first]), int(self.piece_starts[first + count])
        pieces_per_block = np.diff(self.piece_starts[first : first + count + 1])
        block_of_piece = np.repeat(np.arange(count, dtype=np.int64), pieces_per_block)
        src_chunks = staged_at + block_of_piece * self.block_len
        dst_chunks = self.dst_chunks[lo:hi]
        prefill_size, decode_size = (
            self.prefill_layout.tokens_per_block,
            self.decode_layout.tokens_per_block,
        )
        src_slots, dst_slots = self.src_slots[lo:hi], self.dst_slots[lo:hi]
        copies = []
        src_group = dst_group = 0  # where the row group starts inside a chunk, on each side
        for group in self.decode_layout.packing:
            token_bytes = group.token_bytes
            copies.append(  # one strided copy per piece: its heads are planes
                RowCopies(
                    src_addrs=src_chunks + src_group + src_slots * token_bytes,
                    dst_addrs=dst_chunks + dst_group + dst_slots * token_bytes,
                    src_stride=prefill_size * token_bytes,
                    dst_stride=decode_size * token_bytes,
                    rows=group.rows,
                    row_bytes=self.piece_tokens * token_bytes,
                    planes=self.num_heads,
                    src_plane_stride=self.prefill_layout.head_chunk_bytes,
                    dst_plane_stride=self.decode_layout.head_chunk_bytes,
                )
            )
            src_group += group.rows * prefill_size * token_bytes
            dst_group += group.rows * decode_size * token_bytes
        return copies


def _staged_head_chunks(
    local: Region, remote: Region, pull: HeadPull, pieces: TokenPieces, coalesce: bool
) -> list[_StagedChunks]:
    """Staged reads of the pull's heads of every prefill block the pieces touch, in token order:
    runs of consecutive blocks when the pull takes every head of dense blocks (and ``coalesce``),
    single blocks otherwise."""
    local_layout, remote_layout = local.layout, remote.layout
    num_heads = pull.num_heads
    # Pieces come in token order, so the pieces of one prefill block are consecutive.
    first_piece = np.flatnonzero(np.concatenate(([True], np.diff(pieces.remote_blocks) != 0)))
    blocks = pieces.remote_blocks[first_piece]
    piece_bounds = np.concatenate((first_piece, [len(pieces)]))
    if coalesce and num_heads == remote_layout.num_heads and remote_layout.dense:
        breaks = np.diff(blocks) != 1
    else:
        breaks = np.ones(max(len(blocks) - 1, 0), dtype=bool)
    run_bounds = np.concatenate(([0], np.flatnonzero(breaks) + 1, [len(blocks)]))
    dst_chunks = (
        local.base
        + pieces.local_blocks * local_layout.block_stride
        + pull.dst_heads.start * local_layout.head_chunk_bytes
    )
    runs = []
    for start, end in zip(run_bounds[:-1].tolist(), run_bounds[1:].tolist(), strict=True):
        lo, hi = int(piece_bounds[start]), int(piece_bounds[end])
        runs.append(
            _StagedChunks(
                remote_addr=remote.base
                + int(blocks[start]) * remote_layout.block_stride
                + pull.src_heads.start * remote_layout.head_chunk_bytes,
                num_blocks=end - start,
                block_len=num_heads * remote_layout.head_chunk_bytes,
                piece_starts=piece_bounds[start : end + 1] - lo,
                src_slots=pieces.remote_slots[lo:hi],
                dst_chunks=dst_chunks[lo:hi],
                dst_slots=pieces.local_slots[lo:hi],
                num_heads=num_heads,
                piece_tokens=pieces.tokens,
                prefill_layout=remote_layout,
                decode_layout=local_layout,
            )
        )
    return runs


@dataclass(frozen=True)
class _Landing:
    """Where token-row pieces land on decode, per piece: the start of its group (a decode block,
    or a run of consecutive decode blocks of a dense cache), the group's filled token rows, and
    the piece's first row in the group. A merge of ``k`` pulls lands pull ``j``'s pieces at rows
    ``j * rows + row``, ``[k][rows][n heads]``, which one swap per group makes
    ``[rows][k][n heads]``: per run, descriptors scale with runs instead of blocks."""

    starts: np.ndarray
    rows: np.ndarray
    row: np.ndarray

    @classmethod
    def of(cls, pieces: TokenPieces, local: Region, runs: bool) -> _Landing:
        layout = local.layout
        blocks = pieces.local_blocks
        new_block = np.concatenate(([True], np.diff(blocks) != 0))
        block_of_piece = np.cumsum(new_block) - 1
        first_piece = np.flatnonzero(new_block)
        block_ids, filled = blocks[first_piece], pieces.local_filled[first_piece]
        if runs:
            breaks = np.diff(block_ids) != 1
        else:
            breaks = np.ones(max(len(block_ids) - 1, 0), dtype=bool)
        group_of_block = np.concatenate(([0], np.cumsum(breaks)))
        group_first = np.flatnonzero(np.concatenate(([True], breaks)))
        # Only the prompt's last decode block is partly filled, so earlier blocks of a group
        # are full and a block's first row in its group is its position there times Bd.
        position = np.arange(len(block_ids)) - group_first[group_of_block]
        group_rows = np.add.reduceat(filled, group_first) if len(filled) else filled
        group = group_of_block[block_of_piece]
        return cls(
            starts=local.base + block_ids[group_first][group] * layout.block_stride,
            rows=group_rows[group],
            row=position[block_of_piece] * layout.tokens_per_block + pieces.local_slots,
        )
