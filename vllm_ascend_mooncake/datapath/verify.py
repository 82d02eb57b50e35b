"""The optional end-to-end integrity check of pulled KV (``verify_reads``), both sides.

After each read batch lands, decode asks prefill (:class:`~.wire.VerifyRead`) for the
:mod:`~..core.digest` checksum of the source ranges that batch read, computes the checksum of the
ranges they landed in, and fails the pull when the two differ (:class:`IntegrityError`). It runs
before any local copy or permutation moves the landed bytes, and before the read-done notice lets
prefill free the blocks.

What it covers, exactly: the transport's copy of each planned range. The bytes of the local
range a descriptor names equal, at the end of the batch, the bytes of the remote range it names,
so a corruption in flight, a transfer that wrote the planned destination short or not at all, or
source blocks that changed under the read become a counted failed pull (``integrity``).

What it does not cover: both checksums are taken over the ranges the *plan* chose, so a wrong
plan agrees with itself: a wrong offset inside a held prefill block (another head, token or
layer), a wrong local block or region, or bytes meant for one place landing in another the plan
also names all pass. Nor does it see what happens after landing: the row copies out of staging
and the axis swaps (:mod:`~..core.relayout`) that put the bytes where decode's attention reads
them, or a stray write by the transport outside the planned destination. Those are covered by the
planners' tests against the reference model (``tests/core``) and the byte-exact pulls of
``tests/datapath`` and ``tests/ascend``, not at run time.

Prefill answers only the reader holding the lease, and only about the blocks the transfer holds
(:func:`ranges_outside`, each range inside one region): nobody learns anything of memory that is
not theirs to read.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..core.digest import checksum_ranges
from ..core.layout import Region, kernel_block_ids
from ..core.relayout import LocalMemory
from .failures import FailureKind, PullError
from .wire import ReadDigest, VerifyRead


class IntegrityError(PullError):
    """Bytes that landed on decode differ from what prefill holds."""

    def __init__(self, message: str) -> None:
        super().__init__(FailureKind.INTEGRITY, message)


def verify_request(
    transfer_id: str, decode_rank: int, reader: str, addrs: np.ndarray, lengths: np.ndarray
) -> VerifyRead:
    """The question decode asks about one read batch's source ranges."""
    return VerifyRead(
        transfer_id,
        decode_rank,
        reader,
        np.ascontiguousarray(addrs, dtype="<i8").tobytes(),
        np.ascontiguousarray(lengths, dtype="<i8").tobytes(),
    )


def landed_checksum(memory: LocalMemory, addrs: np.ndarray, lengths: np.ndarray) -> int:
    """The checksum of the local ranges a batch landed in (decode's side)."""
    return checksum_ranges(memory.view, addrs, lengths)


def check_digest(reply: object, local: int, what: str) -> None:
    """Raise :class:`IntegrityError` unless prefill's ``reply`` matches ``local``."""
    if not isinstance(reply, ReadDigest):
        raise IntegrityError(f"{what}: prefill could not checksum the ranges read: {reply}")
    remote = int.from_bytes(reply.checksum, "little")
    if remote != local:
        raise IntegrityError(
            f"{what}: the bytes that landed differ from prefill's (checksum {local:#018x} on "
            f"decode, {remote:#018x} on prefill): KV corrupted in flight or changed under the read"
        )


def answer(
    message: VerifyRead,
    memory: LocalMemory | None,
    regions: Sequence[Region],
    held_blocks: tuple[int, ...] | str,
) -> ReadDigest | str:
    """Prefill's answer to ``message``: the checksum, or why not. ``held_blocks``: the transfer's
    blocks when ``message``'s reader holds the lease, else the reason it may not ask.

    A checksum reads the ranges at 0.5-1 GB/s on a CPU: prefill runs it off its side-channel
    thread (:class:`~.side_channel.Deferred`), and on a device on a stream of its own."""
    if memory is None:
        return "this prefill worker has no KV memory it can checksum"
    if isinstance(held_blocks, str):
        return held_blocks
    addrs = np.frombuffer(message.addrs, dtype="<i8")
    lengths = np.frombuffer(message.lengths, dtype="<i8")
    if len(addrs) != len(lengths):
        return f"{len(addrs)} addresses but {len(lengths)} lengths"
    outside = ranges_outside(addrs, lengths, regions, held_blocks)
    if outside:
        return outside
    with memory.own_streams():  # never behind the forward on the compute stream
        value = checksum_ranges(memory.view, addrs, lengths)
    return ReadDigest(value.to_bytes(8, "little"))


def ranges_outside(
    addrs: np.ndarray, lengths: np.ndarray, regions: Sequence[Region], blocks: Sequence[int]
) -> str:
    """Why some range is not inside ``blocks`` of ``regions`` ("" when every one is): each
    range's first and last byte must lie in blocks of the same region (a read never spans two
    regions: the planners cut every descriptor inside one), and every block of that region from
    the first to the last (a run of consecutive blocks) must be one of ``blocks``. A range from
    one region's held block into another region's was let through before, and with it the
    checksum of every block of the first region after it, held or not."""
    if not len(addrs):
        return ""
    if (lengths <= 0).any():
        return "a range of no bytes"
    bases = np.array([r.base for r in regions], dtype=np.int64)
    strides = np.array([r.layout.block_stride for r in regions], dtype=np.int64)
    lens = np.array([r.layout.block_len for r in regions], dtype=np.int64)
    counts = np.array([r.layout.num_blocks for r in regions], dtype=np.int64)
    if not len(bases):
        return "this worker serves no KV regions"
    cuts = {(r.layout.kernel_blocks, r.layout.tokens_per_block) for r in regions}
    if len(cuts) == 1:  # held engine blocks as the regions' own (kernel) blocks
        ((kernel_blocks, kernel_tokens),) = cuts
        blocks = kernel_block_ids(blocks, kernel_blocks, kernel_tokens, None)
    else:
        return "this worker's KV regions cut engine blocks in different ways"
    held = np.zeros(int(counts.max()) + 1, dtype=np.int64)
    known = np.asarray([b for b in blocks if 0 <= b < len(held) - 1], dtype=np.int64)
    held[known + 1] = 1
    held_before = np.cumsum(held)  # held_before[b]: held blocks among 0..b-1

    def locate(points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rel = points[:, None] - bases[None, :]
        inside = (rel >= 0) & (rel < counts * strides) & (rel % strides < lens)
        found = inside.any(axis=1)
        region = inside.argmax(axis=1)
        return np.where(found, region, -1), rel[np.arange(len(points)), region] // np.maximum(
            strides[region], 1
        )

    first_region, first = locate(addrs)
    last_region, last = locate(addrs + lengths - 1)
    if (first_region < 0).any() or (last_region < 0).any():
        return "a range outside this worker's KV blocks"
    if (first_region != last_region).any():
        return "a range that spans two KV regions"
    if (last < first).any():
        return "a range outside this worker's KV blocks"
    covered = held_before[last + 1] - held_before[first]
    if (covered != last - first + 1).any():
        return "a range outside the blocks this transfer holds"
    return ""
