"""Which prefill ranks each decode rank reads, and which KV heads (pure; no I/O).

Heads are sharded the way vLLM shards them. With ``H`` KV heads and tensor-parallel size ``T``:

* ``T <= H`` (``H % T == 0``): rank ``r`` owns the contiguous heads ``[r*H/T, (r+1)*H/T)``;
* ``T > H`` (``T % H == 0``): each head is replicated on ``T/H`` ranks and rank ``r`` owns head
  ``r // (T/H)``;
* MLA: one latent cache replicated on every rank (treated as ``H = 1``).

A model's layers may shard different head counts: a draft (EAGLE/MTP) layer may have a KV-head
count of its own. Each count is a head group with its own sharding, so its own pulls; a region
names its group (``RegionLayout.kv_heads``), and a decode rank reads, for a request, the union of
the prefill ranks its groups' pulls name (:meth:`TransferTopology.prefill_ranks_for`).

Prefill (TP ``Tp``) and decode (TP ``Td``) shard the same heads differently. Each decode rank
assembles its heads from whole prefill "head slices" (the heads one prefill rank owns) when a
prefill rank owns fewer heads than a decode rank, or reads part of one prefill slice when it owns
more. When a slice is replicated on several prefill ranks, the replica is chosen from a seed derived
from the request id, so that both sides compute the same choice independently and load spreads over
the replicas.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property


class TopologyError(ValueError):
    """The prefill/decode TP pair cannot be served for this model."""


@dataclass(frozen=True)
class HeadPull:
    """One read of a decode rank: heads of one prefill rank landing in the decode rank's cache.

    ``src_heads`` is in the prefill rank's local head numbering, ``dst_heads`` in the decode rank's.
    Both ranges have the same length.
    """

    prefill_rank: int
    src_heads: range
    dst_heads: range

    @property
    def num_heads(self) -> int:
        return len(self.src_heads)


def request_seed(request_id: str) -> int:
    """A stable 64-bit seed for replica choice, identical in every process for the same id."""
    digest = hashlib.sha256(request_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little")


def _heads_per_rank(num_heads: int, tp: int) -> int:
    return max(1, num_heads // tp)


def _check_side(side: str, num_heads: int, tp: int) -> None:
    if tp < 1:
        raise TopologyError(f"{side} TP size must be >= 1, got {tp}")
    if tp <= num_heads and num_heads % tp != 0:
        raise TopologyError(
            f"{side} TP {tp} does not divide the {num_heads} KV heads: vLLM cannot shard them "
            f"evenly; use a {side} TP that divides {num_heads}"
        )
    if tp > num_heads and tp % num_heads != 0:
        raise TopologyError(
            f"{side} TP {tp} is larger than the {num_heads} KV heads but not a multiple of it: "
            f"vLLM replicates KV heads only when TP is a multiple of the head count"
        )


@dataclass(frozen=True)
class TransferTopology:
    """Head ownership on both sides and the pulls each decode rank issues.

    Args:
        num_kv_heads: total KV heads of the model (ignored for MLA).
        prefill_tp: tensor-parallel size of the prefill instance.
        decode_tp: tensor-parallel size of the decode instance.
        is_mla: the model uses an MLA latent cache (one replicated latent per rank).
        extra_kv_heads: total KV heads of each further head group (a draft model's layers with
            a KV-head count of their own); ignored for MLA, whose latents are one unit anyway.
    """

    num_kv_heads: int
    prefill_tp: int
    decode_tp: int
    is_mla: bool = False
    extra_kv_heads: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_kv_heads < 1 and not self.is_mla:
            raise TopologyError(
                f"the model must have at least one KV head, got {self.num_kv_heads}"
            )
        heads = self.heads
        _check_side("prefill", heads, self.prefill_tp)
        _check_side("decode", heads, self.decode_tp)
        hp, hd = self.prefill_heads_per_rank, self.decode_heads_per_rank
        if hd % hp != 0 and hp % hd != 0:
            raise TopologyError(
                f"prefill TP {self.prefill_tp} and decode TP {self.decode_tp} with "
                f"{heads} KV heads: a prefill rank holds {hp} heads and a decode rank {hd}; "
                f"neither count divides the other, so heads cannot be moved as whole slices"
            )
        for extra in self.extra_kv_heads:
            if self.is_mla:
                break
            try:
                TransferTopology(extra, self.prefill_tp, self.decode_tp)
            except TopologyError as exc:
                raise TopologyError(
                    f"the draft (EAGLE/MTP) layers' {extra} KV heads: {exc}"
                ) from exc

    @cached_property
    def head_groups(self) -> tuple[TransferTopology, ...]:
        """One single-group topology per distinct head count, the model's first (``self`` when
        there is one group)."""
        others = dict.fromkeys(h for h in self.extra_kv_heads if h != self.num_kv_heads)
        if self.is_mla or not others:
            return (self,)
        main = TransferTopology(self.num_kv_heads, self.prefill_tp, self.decode_tp)
        return (main, *(TransferTopology(h, self.prefill_tp, self.decode_tp) for h in others))

    def group(self, kv_heads: int) -> TransferTopology:
        """The head group of ``kv_heads`` total KV heads (0: the model's, as a region that names
        no group of its own)."""
        groups = self.head_groups
        if kv_heads in (0, self.num_kv_heads) or self.is_mla:
            return groups[0]
        for group in groups[1:]:
            if group.num_kv_heads == kv_heads:
                return group
        known = ", ".join(str(g.num_kv_heads) for g in groups)
        raise TopologyError(
            f"no head group of {kv_heads} KV heads: this instance plans groups of {known}"
        )

    @property
    def replicates_on_prefill(self) -> bool:
        """Some head group is replicated over the prefill ranks (TP larger than its heads)."""
        return any(g.prefill_tp > g.heads for g in self.head_groups)

    @property
    def heads(self) -> int:
        """Number of distinct KV head units being sharded (1 for MLA)."""
        return 1 if self.is_mla else self.num_kv_heads

    @property
    def prefill_heads_per_rank(self) -> int:
        return _heads_per_rank(self.heads, self.prefill_tp)

    @property
    def decode_heads_per_rank(self) -> int:
        return _heads_per_rank(self.heads, self.decode_tp)

    @property
    def pulls_per_decode_rank(self) -> int:
        """How many prefill ranks every decode rank reads (the ``k`` of the head merge)."""
        return max(1, self.decode_heads_per_rank // self.prefill_heads_per_rank)

    def prefill_heads(self, rank: int) -> range:
        """Global heads owned by a prefill rank."""
        return self._owned(rank, self.prefill_tp)

    def decode_heads(self, rank: int) -> range:
        """Global heads owned by a decode rank."""
        return self._owned(rank, self.decode_tp)

    def _owned(self, rank: int, tp: int) -> range:
        if not 0 <= rank < tp:
            raise TopologyError(f"rank {rank} is outside TP size {tp}")
        per_rank = _heads_per_rank(self.heads, tp)
        if tp <= self.heads:
            return range(rank * per_rank, (rank + 1) * per_rank)
        head = rank // (tp // self.heads)
        return range(head, head + 1)

    def _prefill_replicas(self, first_head: int) -> tuple[int, ...]:
        """Prefill ranks owning the head slice that starts at ``first_head`` (ascending)."""
        return self._replicas_by_group[first_head]

    @cached_property
    def _replicas_by_group(self) -> dict[int, tuple[int, ...]]:
        groups: dict[int, list[int]] = {}
        for rank in range(self.prefill_tp):
            groups.setdefault(self.prefill_heads(rank).start, []).append(rank)
        return {start: tuple(ranks) for start, ranks in groups.items()}

    def _group_readers(self, first_head: int) -> list[int]:
        """Decode ranks that read from the prefill head slice starting at ``first_head``."""
        group = range(first_head, first_head + self.prefill_heads_per_rank)
        return [d for d in range(self.decode_tp) if _overlaps(self.decode_heads(d), group)]

    def pulls_for(self, decode_rank: int, seed: int) -> tuple[HeadPull, ...]:
        """The reads decode rank ``decode_rank`` issues for a request with replica seed ``seed``.

        Pulls are ordered by destination head, so pull ``j`` fills the ``j``-th slice of the
        decode rank's heads.
        """
        wanted = self.decode_heads(decode_rank)
        hp = self.prefill_heads_per_rank
        pulls = []
        if hp <= len(wanted):
            group_starts: Sequence[int] = range(wanted.start, wanted.stop, hp)
        else:  # the decode rank reads a slice of one prefill group
            group_starts = [wanted.start - wanted.start % hp]
        for group_start in group_starts:
            replicas = self._prefill_replicas(group_start)
            readers = self._group_readers(group_start)
            position = readers.index(decode_rank)
            prefill_rank = replicas[(seed + position) % len(replicas)]
            overlap_start = max(group_start, wanted.start)
            overlap_stop = min(group_start + hp, wanted.stop)
            pulls.append(
                HeadPull(
                    prefill_rank=prefill_rank,
                    src_heads=range(overlap_start - group_start, overlap_stop - group_start),
                    dst_heads=range(overlap_start - wanted.start, overlap_stop - wanted.start),
                )
            )
        return tuple(pulls)

    def prefill_ranks_for(self, decode_rank: int, seed: int) -> tuple[int, ...]:
        """Every prefill rank decode rank ``decode_rank`` reads for a request, over all head
        groups (in the order of the groups' pulls, each rank once)."""
        ranks = (p.prefill_rank for g in self.head_groups for p in g.pulls_for(decode_rank, seed))
        return tuple(dict.fromkeys(ranks))

    def readers_of(self, prefill_rank: int, seed: int) -> tuple[int, ...]:
        """Decode ranks that will read prefill rank ``prefill_rank`` for a request, over all
        head groups (ascending).

        A prefill rank that nobody reads can report the request finished at once.
        """
        if len(self.head_groups) > 1:
            readers = {d for g in self.head_groups for d in g.readers_of(prefill_rank, seed)}
            return tuple(sorted(readers))
        group_start = self.prefill_heads(prefill_rank).start
        return tuple(
            d
            for d in self._group_readers(group_start)
            if any(p.prefill_rank == prefill_rank for p in self.pulls_for(d, seed))
        )

    def describe(self) -> str:
        """One line for logs: sizes, heads per rank and the pull count."""
        kind = "MLA latent" if self.is_mla else f"{self.num_kv_heads} KV heads"
        text = (
            f"prefill TP {self.prefill_tp} -> decode TP {self.decode_tp} ({kind}): "
            f"{self.prefill_heads_per_rank} head(s) per prefill rank, "
            f"{self.decode_heads_per_rank} per decode rank, "
            f"{self.pulls_per_decode_rank} pull(s) per decode rank"
        )
        for g in self.head_groups[1:]:
            text += (
                f"; draft layers' {g.num_kv_heads} KV heads: {g.prefill_heads_per_rank} per "
                f"prefill rank, {g.decode_heads_per_rank} per decode rank, "
                f"{g.pulls_per_decode_rank} pull(s)"
            )
        return text


#: The largest remote TP size a peer may name: bounds what a peer can make an instance build.
MAX_TP_SIZE = 1 << 12


class Topologies:
    """The topology for each remote TP size this instance meets, built once per size.

    A decode instance may be fed by prefill instances of several TP sizes (each request names its
    prefill's), and a prefill instance may be read by decode instances of several; the local side
    is fixed. ``prefill_tp`` / ``decode_tp`` of the configuration give the first entry. A size
    that cannot be paired with the local one raises :class:`TopologyError` naming both; sizes
    are bounded by :data:`MAX_TP_SIZE`, so a peer cannot grow the cache without end.
    """

    def __init__(self, configured: TransferTopology, *, local_is_decode: bool) -> None:
        self._configured = configured
        self._local_is_decode = local_is_decode
        self._by_remote_tp: dict[int, TransferTopology] = {self.remote_tp(configured): configured}

    @property
    def configured(self) -> TransferTopology:
        return self._configured

    def remote_tp(self, topology: TransferTopology) -> int:
        return topology.prefill_tp if self._local_is_decode else topology.decode_tp

    def with_remote_tp(self, remote_tp: int) -> TransferTopology:
        """The topology pairing this instance with a peer instance of TP ``remote_tp``."""
        topology = self._by_remote_tp.get(remote_tp)
        if topology is not None:
            return topology
        if not 1 <= remote_tp <= MAX_TP_SIZE:
            raise TopologyError(f"a remote TP size of {remote_tp} is outside 1..{MAX_TP_SIZE}")
        c = self._configured
        topology = TransferTopology(
            c.num_kv_heads,
            remote_tp if self._local_is_decode else c.prefill_tp,
            c.decode_tp if self._local_is_decode else remote_tp,
            is_mla=c.is_mla,
            extra_kv_heads=c.extra_kv_heads,
        )
        self._by_remote_tp[remote_tp] = topology  # a dict store: safe across threads
        return topology


def _overlaps(a: range, b: range) -> bool:
    return a.start < b.stop and b.start < a.stop
