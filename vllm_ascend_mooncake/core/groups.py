"""KV cache groups: which of a request's block positions each kind of group holds (pure).

vLLM's hybrid KV cache manager gives every KV cache group a block table of its own, indexed by
position (entry ``i`` holds tokens ``[i*bs, (i+1)*bs)``), and frees what a kind no longer needs:

* full attention (and MLA) keeps every position: ``[0, cdiv(n, bs))``;
* a sliding window ``W`` drops the blocks entirely below token ``n - W + 1`` (plus
  ``extra_retained_tokens``): ``[skipped // bs, cdiv(n, bs))``
  (``SlidingWindowManager.get_num_skipped_tokens``);
* a Mamba / linear-attention state in vLLM's ``align`` cache mode keeps the state after token
  ``n - 1`` alone, in the block of that token: ``[(n - 1) // bs]`` (``MambaManager``);

after ``n`` computed tokens. Either way what a request holds is a *suffix* of its positions ending
at ``cdiv(n, bs)``, on prefill and on decode alike, so the planners pair decode's blocks with the
suffix of prefill's per group as they do for one group.

A request's blocks travel as one flat tuple of ids, group after group, and the groups' sizes
(:func:`split_groups`); no sizes means one group, the only form before hybrid models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


class GroupKind(str, Enum):
    FULL = "full"
    SLIDING = "sliding"
    STATE = "state"


@dataclass(frozen=True)
class GroupSpec:
    """One KV cache group as the transfer sees it: its kind, its tokens per block and, for a
    sliding window, the tokens it keeps (``sliding_window`` + ``extra_retained_tokens``)."""

    kind: GroupKind
    block_size: int
    window: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block size {self.block_size} of a KV cache group")
        if (self.kind is GroupKind.SLIDING) != (self.window > 0):
            raise ValueError(f"a {self.kind.value} group with window {self.window}")

    def describe(self) -> str:
        """What prefill and decode must agree on, e.g. ``sliding(64)``: the kind and window
        (block sizes may differ, the planners align tokens)."""
        return f"sliding({self.window})" if self.kind is GroupKind.SLIDING else self.kind.value

    def first_held(self, num_tokens: int) -> int:
        """The first position this group still holds after ``num_tokens`` computed tokens."""
        if self.kind is GroupKind.FULL:
            return 0
        if self.kind is GroupKind.STATE:
            return max(0, num_tokens - 1) // self.block_size
        return max(0, num_tokens - self.window + 1) // self.block_size

    def held_count(self, num_tokens: int) -> int:
        """How many trailing positions of a ``num_tokens``-token prompt the group holds."""
        return _cdiv(num_tokens, self.block_size) - self.first_held(num_tokens)

    def wanted_count(self, num_tokens: int, num_cached_tokens: int) -> int:
        """How many trailing positions decode reads for a ``num_tokens``-token load when it
        already caches the first ``num_cached_tokens`` (whole blocks) itself."""
        first = max(self.first_held(num_tokens), _cdiv(num_cached_tokens, self.block_size))
        return max(0, _cdiv(num_tokens, self.block_size) - first)


def describe_groups(specs: Sequence[GroupSpec]) -> list[str]:
    return [spec.describe() for spec in specs]


def split_groups(block_ids: Sequence[int], sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """The per-group block ids of a flat list, group after group (no sizes: one group)."""
    if not sizes:
        return [tuple(block_ids)]
    if sum(sizes) != len(block_ids) or any(size < 0 for size in sizes):
        raise ValueError(f"{len(block_ids)} block ids do not split into groups of {list(sizes)}")
    groups, start = [], 0
    for size in sizes:
        groups.append(tuple(block_ids[start : start + size]))
        start += size
    return groups


def block_groups(
    block_ids: Sequence[int], sizes: Sequence[int], groups: int
) -> list[tuple[int, ...]]:
    """A side's block ids per KV cache group, for a KV cache of ``groups`` groups (no ids and no
    sizes at all: every group empty); ValueError when they do not split into that many."""
    if not block_ids and not sizes:
        return [()] * groups
    split = split_groups(block_ids, sizes)
    if len(split) != groups:
        raise ValueError(
            f"the request's blocks come in {len(split)} KV cache group(s), this decode "
            f"worker's KV cache has {groups}: the two instances do not run the same model "
            f"(or not both with vLLM's hybrid KV cache manager)"
        )
    return split


def flatten_groups(groups: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The flat block ids and group sizes of per-group lists (one group: no sizes)."""
    ids = tuple(b for group in groups for b in group)
    sizes = tuple(len(group) for group in groups) if len(groups) > 1 else ()
    return ids, sizes


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
