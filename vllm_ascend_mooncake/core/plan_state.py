"""Plan one request's state-group reads for one decode rank (pure): which prefill ranks it
reads and the byte runs, so that every byte of the decode rank's state lands in place.

A decode rank reads every prefill rank whose shard of the global state intersects its own (all of
``[d*P/D, (d+1)*P/D)`` when ``P > D``, the one rank ``d*P//D`` when ``P <= D``); a replicated
state (``tp_replicated``) is read whole from one rank, ``(seed + d) % P``, spreading decode ranks
over the replicas. Per (component, prefill rank), the intersection of the two ranks' global
column ranges gives byte runs inside one block: SSM one run (a run of value heads), conv one per
sub-projection (``DS``) or per sub-projection and row (``SD``). Runs contiguous on both sides are
merged. No staging and no fix-up; padding past the components is never moved.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .descriptors import PeerDescriptors
from .plan_types import PeerPlan, PlanError, PlanOptions
from .state_layout import StateComponent, StateLayout

#: Per layer, each component's base address (vLLM CPU: the page view's address, repeated).
LayerBases = Sequence[Sequence[int]]


@dataclass(frozen=True)
class ComponentRuns:
    """Byte runs of one component between a decode rank and a prefill rank, as offsets from
    each side's component start in a block."""

    local: np.ndarray
    remote: np.ndarray
    lengths: np.ndarray


def state_prefill_ranks(
    local: StateLayout, decode_rank: int, remote: StateLayout, seed: int = 0
) -> tuple[int, ...]:
    """The prefill ranks (ascending) decode rank ``decode_rank`` reads state from."""
    _check_pairable(local, remote)
    if not 0 <= decode_rank < local.tp_size:
        raise PlanError(f"decode rank {decode_rank} is outside decode TP {local.tp_size}")
    ranks = set()
    for c, component in enumerate(local.components):
        if component.axis.replicated:
            ranks.add((seed + decode_rank) % remote.tp_size)
            continue
        wanted = local.segments(c, decode_rank)
        ranks.update(
            p
            for p in range(remote.tp_size)
            if any(_overlap(w, h) for w in wanted for h in remote.segments(c, p))
        )
    return tuple(sorted(ranks))


def component_runs(
    local: StateLayout, decode_rank: int, remote: StateLayout, prefill_rank: int, component: int
) -> ComponentRuns:
    """The runs of ``component`` that decode rank ``decode_rank`` reads from ``prefill_rank``
    (all of them, however the replica is chosen), merged where contiguous on both sides."""
    local_component = local.components[component]
    remote_component = remote.components[component]
    wanted = local.segments(component, decode_rank)
    held = remote.segments(component, prefill_rank)
    pieces = []  # (local column, remote column, columns)
    local_column = 0
    for w in wanted:
        remote_column = 0
        for h in held:
            start, stop = max(w.start, h.start), min(w.stop, h.stop)
            if start < stop:
                pieces.append(
                    (local_column + start - w.start, remote_column + start - h.start, stop - start)
                )
            remote_column += len(h)
        local_column += len(w)
    column_bytes = local_component.column_bytes
    local_row = local_component.row_bytes(local.tp_size)
    remote_row = remote_component.row_bytes(remote.tp_size)
    runs = [
        (
            row * local_row + lc * column_bytes,
            row * remote_row + rc * column_bytes,
            n * column_bytes,
        )
        for row in range(local_component.rows)
        for lc, rc, n in pieces
    ]
    as_array = np.array(runs, dtype=np.int64).reshape(-1, 3)
    return ComponentRuns(*merge_contiguous(as_array[:, 0], as_array[:, 1], as_array[:, 2]))


def plan_state_request(
    local: StateLayout,
    decode_rank: int,
    local_bases: LayerBases,
    remote: StateLayout,
    remote_bases: Mapping[int, LayerBases],
    block_pairs: Sequence[tuple[int, int]],
    *,
    seed: int = 0,
    options: PlanOptions | None = None,
) -> list[PeerPlan]:
    """Per prefill rank read, the descriptor batches that move the state of every layer from
    prefill block to decode block, for each ``(decode block, prefill block)`` pair. Peers carry
    no head pulls (``pulls`` is empty): a state is sharded by columns, not KV heads."""
    options = options or PlanOptions()
    ranks = state_prefill_ranks(local, decode_rank, remote, seed)
    pairs = np.array(block_pairs, dtype=np.int64).reshape(-1, 2)
    _check_blocks(pairs[:, 0], local.num_blocks, "decode")
    if len(np.unique(pairs[:, 0])) != len(pairs):
        raise PlanError(
            f"decode state blocks {pairs[:, 0].tolist()} repeat: one would be overwritten"
        )
    _check_blocks(pairs[:, 1], remote.num_blocks, "prefill")
    _check_bases(local_bases, local, "the decode rank")
    plans = []
    for rank in ranks:
        bases = remote_bases.get(rank)
        if bases is None:
            raise PlanError(f"no state base addresses for prefill rank {rank}")
        _check_bases(bases, remote, f"prefill rank {rank}")
        if len(bases) != len(local_bases):
            raise PlanError(
                f"prefill rank {rank} has {len(bases)} state layers, the decode rank "
                f"{len(local_bases)}: the two instances do not run the same model"
            )
        peer = PeerDescriptors()
        per_layer = [
            _layer_runs(local, decode_rank, remote, rank, c, seed)
            for c in range(len(local.components))
        ]
        dst, src, lengths = [], [], []
        for local_layer, remote_layer in zip(local_bases, bases, strict=True):
            for d_block, p_block in pairs:
                for c, runs in enumerate(per_layer):
                    if runs is None:
                        continue
                    dst.append(_block_start(local, local_layer, c, d_block) + runs.local)
                    src.append(_block_start(remote, remote_layer, c, p_block) + runs.remote)
                    lengths.append(runs.lengths)
        if dst:
            peer.add(*merge_contiguous(*map(np.concatenate, (dst, src, lengths))))
        batches = peer.batches(options.max_descriptors_per_batch, options.max_descriptor_bytes)
        plans.append(PeerPlan(prefill_rank=rank, pulls=(), batches=batches))
    return plans


def merge_contiguous(
    local: np.ndarray, remote: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge each descriptor into the previous one where both sides continue it."""
    if len(lengths) < 2:
        return local, remote, lengths
    ends_local = local[:-1] + lengths[:-1]
    ends_remote = remote[:-1] + lengths[:-1]
    breaks = (local[1:] != ends_local) | (remote[1:] != ends_remote)
    starts = np.flatnonzero(np.concatenate(([True], breaks)))
    return local[starts], remote[starts], np.add.reduceat(lengths, starts)


def _layer_runs(
    local: StateLayout, decode_rank: int, remote: StateLayout, rank: int, component: int, seed: int
) -> ComponentRuns | None:
    """The component's runs from ``rank``, None where another rank is read for it (a replicated
    component is read from one chosen rank only)."""
    chosen = (seed + decode_rank) % remote.tp_size
    if local.components[component].axis.replicated and rank != chosen:
        return None
    runs = component_runs(local, decode_rank, remote, rank, component)
    return runs if len(runs.lengths) else None


def _block_start(layout: StateLayout, bases: Sequence[int], component: int, block: int) -> int:
    offset = layout.components[component].offset
    return int(bases[component]) + int(block) * layout.block_stride + offset


def _check_pairable(local: StateLayout, remote: StateLayout) -> None:
    names = [c.name for c in local.components], [c.name for c in remote.components]
    same = len(local.components) == len(remote.components) and all(
        StateComponent.same_global_state(a, b)
        for a, b in zip(local.components, remote.components, strict=True)
    )
    if not same:
        raise PlanError(
            f"state components {names[1]} on prefill and {names[0]} on decode are not shards of "
            f"the same state (sizes, dtypes, conv layout or replication differ): "
            f"{remote.components} vs {local.components}"
        )


def _check_blocks(ids: np.ndarray, num_blocks: int, side: str) -> None:
    bad = ids[(ids < 0) | (ids >= num_blocks)]
    if len(bad):
        raise PlanError(f"{side} state block id {int(bad[0])} is outside 0..{num_blocks - 1}")


def _check_bases(bases: LayerBases, layout: StateLayout, side: str) -> None:
    for layer, layer_bases in enumerate(bases):
        if len(layer_bases) != len(layout.components):
            raise PlanError(
                f"{side}'s state layer {layer} has {len(layer_bases)} base addresses for "
                f"{len(layout.components)} components"
            )


def _overlap(a: range, b: range) -> bool:
    return max(a.start, b.start) < min(a.stop, b.stop)
