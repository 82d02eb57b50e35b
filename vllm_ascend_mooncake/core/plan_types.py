"""What a plan is made of (pure): descriptor batches per prefill peer, the copies and swaps to
run locally, and the options and staging area a plan is made with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..options import POSITIVE, option
from .layout import Region
from .topology import HeadPull, TransferTopology


class PlanError(ValueError):
    """The request cannot be planned (bad block ids, unpairable regions, missing staging)."""


@dataclass(frozen=True)
class RequestPulls:
    """What one decode rank reads for one request: each local region's pulls (those of the
    region's head group, :meth:`~.topology.TransferTopology.group`) and every prefill rank read,
    each once, in the order of the groups' pulls. With one head group every region has the same
    pulls."""

    by_region: tuple[tuple[HeadPull, ...], ...]
    prefill_ranks: tuple[int, ...]

    @classmethod
    def of(
        cls, topology: TransferTopology, decode_rank: int, seed: int, regions: Sequence[Region]
    ) -> RequestPulls:
        pulls = {group: group.pulls_for(decode_rank, seed) for group in topology.head_groups}
        by_region = (pulls[topology.group(region.layout.kv_heads)] for region in regions)
        return cls(tuple(by_region), topology.prefill_ranks_for(decode_rank, seed))

    def of_rank(self, prefill_rank: int) -> tuple[HeadPull, ...]:
        """The distinct pulls that read ``prefill_rank``, over all regions."""
        pulls = (p for region in self.by_region for p in region if p.prefill_rank == prefill_rank)
        return tuple(dict.fromkeys(pulls))


@dataclass(frozen=True)
class StagingArea:
    """A registered local buffer that token-major slice pulls land in before being copied."""

    base: int
    capacity: int


@dataclass(frozen=True)
class PlanOptions:
    max_descriptors_per_batch: int = option(
        1024,
        summary="cap on descriptors per read call.",
        details=(
            "Mooncake's TCP transport rejects batches past about 2,000 outstanding descriptors per "
            "peer."
        ),
        bound=POSITIVE,
    )
    coalesce_runs: bool = option(
        True,
        summary=(
            "run-level coalescing for heterogeneous TP: one descriptor per block run and pull, "
            "followed by a local permutation."
        ),
        details="`false` reads block by block (no permutation for head-major caches).",
    )
    # Head-major merges read block by block, needing no fix-up, when each prefill block is at
    # least this many bytes (0: never). Per-block descriptors then cost less than the local
    # permutation that run-level coalescing needs afterwards.
    block_reads_from_bytes: int = 0
    staging: StagingArea | None = None
    # Split descriptors longer than this (0: never). Mooncake's TCP transport moves ~1 MiB
    # descriptors faster than much larger ones; RDMA slices large descriptors itself.
    max_descriptor_bytes: int = 0

    def __post_init__(self) -> None:
        if self.max_descriptors_per_batch < 1:
            raise PlanError(
                f"max_descriptors_per_batch must be >= 1, got {self.max_descriptors_per_batch}"
            )


@dataclass(frozen=True)
class SwapAxes:
    """In place at each address: bytes ``[outer][inner][unit]`` become ``[inner][outer][unit]``."""

    addrs: np.ndarray
    outer: int
    inner: int
    unit: int

    @property
    def span(self) -> int:
        return self.outer * self.inner * self.unit


@dataclass(frozen=True)
class RowCopies:
    """Local copies: per (src, dst) pair, ``planes`` planes (at the plane strides) of ``rows``
    rows of ``row_bytes`` (at the row strides): one strided copy per pair."""

    src_addrs: np.ndarray
    dst_addrs: np.ndarray
    src_stride: int
    dst_stride: int
    rows: int
    row_bytes: int
    planes: int = 1
    src_plane_stride: int = 0
    dst_plane_stride: int = 0

    @property
    def num_bytes(self) -> int:
        """Bytes copied."""
        return len(self.src_addrs) * self.planes * self.rows * self.row_bytes


@dataclass
class TransferBatch:
    """Descriptors for one ``batch_transfer_sync_read`` call, and copies to run once it landed."""

    local_addrs: np.ndarray
    remote_addrs: np.ndarray
    lengths: np.ndarray
    after_landing: list[RowCopies] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def num_bytes(self) -> int:
        return int(self.lengths.sum())


@dataclass
class PeerPlan:
    """Everything one decode rank reads from one prefill rank for a request, in batches."""

    prefill_rank: int
    pulls: tuple[HeadPull, ...]
    batches: list[TransferBatch]

    @property
    def num_descriptors(self) -> int:
        return sum(len(b) for b in self.batches)

    @property
    def num_bytes(self) -> int:
        return sum(b.num_bytes for b in self.batches)


@dataclass
class RequestPlan:
    """The reads of one request on one decode rank, and the fix-ups to run after all landed."""

    peers: list[PeerPlan]
    fixups: list[SwapAxes]

    @property
    def num_descriptors(self) -> int:
        return sum(p.num_descriptors for p in self.peers)

    @property
    def num_bytes(self) -> int:
        return sum(p.num_bytes for p in self.peers)
