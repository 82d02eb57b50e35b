"""Staged reads: the two halves of a staging area, and when a read must wait for copies."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_ascend_mooncake.core.plan_types import PlanOptions, RowCopies, StagingArea, TransferBatch
from vllm_ascend_mooncake.core.staging import StagedRun, copies_must_finish_first, stage_batches


@dataclass(frozen=True)
class OverlappedRun(StagedRun):
    """A staged run whose copies overlap the next read, as head-major chunks' do."""

    double_buffered: ClassVar[bool] = True


def run(
    remote_addr: int, num_blocks: int, block_len: int, dst_addr: int, kind: type = OverlappedRun
) -> StagedRun:
    """A run whose blocks are copied out whole, one row per block."""
    return kind(
        remote_addr=remote_addr,
        num_blocks=num_blocks,
        block_len=block_len,
        rows_per_block=1,
        src_offset=0,
        src_stride=block_len,
        dst_addr=dst_addr,
        dst_stride=block_len,
        row_bytes=block_len,
    )


def staged_spans(batches: list[TransferBatch]) -> list[tuple[int, int]]:
    return [(int(b.local_addrs.min()), int((b.local_addrs + b.lengths).max())) for b in batches]


def test_an_area_of_two_blocks_or_more_alternates_its_halves() -> None:
    area = StagingArea(base=1000, capacity=4 * 64)
    batches = stage_batches([run(0, 8, 64, 10_000)], PlanOptions(), area)
    assert staged_spans(batches) == [(1000, 1128), (1128, 1256)] * 2
    # each read may start while the previous batch's copies run, never the one after
    for landed, following in itertools.pairwise(batches):
        assert not copies_must_finish_first(landed, following)
    assert copies_must_finish_first(batches[0], batches[2])


def test_an_area_of_one_block_is_reused_whole_and_reads_wait() -> None:
    area = StagingArea(base=1000, capacity=64 + 63)
    batches = stage_batches([run(0, 3, 64, 10_000)], PlanOptions(), area)
    assert staged_spans(batches) == [(1000, 1064)] * 3
    assert all(copies_must_finish_first(a, b) for a, b in itertools.pairwise(batches))


def test_units_that_are_not_double_buffered_use_the_whole_area() -> None:
    area = StagingArea(base=1000, capacity=4 * 64)
    batches = stage_batches([run(0, 8, 64, 10_000, kind=StagedRun)], PlanOptions(), area)
    assert staged_spans(batches) == [(1000, 1256)] * 2
    assert copies_must_finish_first(batches[0], batches[1])


def test_a_read_onto_bytes_the_copies_write_waits_too() -> None:
    landed = TransferBatch(
        np.array([0], dtype=np.int64),
        np.array([0], dtype=np.int64),
        np.array([64], dtype=np.int64),
        [RowCopies(np.array([0]), np.array([1000]), 16, 32, rows=4, row_bytes=8)],
    )

    def reading(addr: int, length: int) -> TransferBatch:
        return TransferBatch(
            np.array([addr], dtype=np.int64),
            np.array([0], dtype=np.int64),
            np.array([length], dtype=np.int64),
        )

    assert copies_must_finish_first(landed, reading(1000 + 3 * 32 + 7, 1))  # last byte written
    assert not copies_must_finish_first(landed, reading(1000 + 3 * 32 + 8, 100))
    assert copies_must_finish_first(landed, reading(3 * 16 + 7, 1))  # last byte read
    assert not copies_must_finish_first(landed, reading(3 * 16 + 8, 900))
    assert not copies_must_finish_first(reading(0, 64), reading(0, 64))  # no copies: no wait


intervals = st.lists(st.tuples(st.integers(0, 200), st.integers(1, 30)), min_size=1, max_size=8)


@settings(max_examples=300, deadline=None)
@given(intervals, intervals, st.integers(1, 3), st.integers(1, 3))
def test_the_wait_matches_a_byte_by_byte_check(copied, read, rows, planes) -> None:
    """Against the plainest check: the set of bytes each side touches."""
    row_bytes, stride, plane_stride = 3, 5, 17
    src = np.array([a for a, _ in copied], dtype=np.int64)
    dst = src + 500
    landed = TransferBatch(
        src,
        src,
        np.array([n for _, n in copied], dtype=np.int64),
        [RowCopies(src, dst, stride, stride, rows, row_bytes, planes, plane_stride, plane_stride)],
    )
    following = TransferBatch(
        np.array([a for a, _ in read], dtype=np.int64),
        np.zeros(len(read), dtype=np.int64),
        np.array([n for _, n in read], dtype=np.int64),
    )
    pairs = [start + offset for start in src.tolist() for offset in (0, 500)]
    touched = {
        pair + p * plane_stride + r * stride + b
        for pair in pairs
        for p in range(planes)
        for r in range(rows)
        for b in range(row_bytes)
    }
    extent = row_bytes + (rows - 1) * stride + (planes - 1) * plane_stride
    spans = {pair + i for pair in pairs for i in range(extent)}  # first byte to last
    written = {a + i for a, n in read for i in range(n)}
    waits = copies_must_finish_first(landed, following)
    if touched & written:
        assert waits, "a read onto bytes the copies touch did not wait"
    if not spans & written:
        assert not waits, "a read clear of every copy's span waited"
