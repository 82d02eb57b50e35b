"""Topology against the reference rule of head ownership, over every supported size."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vam_testing.kv_reference import owned_heads
from vllm_ascend_mooncake.core.topology import (
    HeadPull,
    TopologyError,
    TransferTopology,
    request_seed,
)

HEADS = [1, 2, 4, 8, 16, 32]
TPS = [1, 2, 4, 8, 16]


def _valid(heads: int, prefill_tp: int, decode_tp: int, is_mla: bool) -> TransferTopology | None:
    try:
        return TransferTopology(heads, prefill_tp, decode_tp, is_mla=is_mla)
    except TopologyError:
        return None


ALL_CASES = [
    (h, tp, td, mla)
    for h, tp, td, mla in itertools.product(HEADS, TPS, TPS, [False, True])
    if not (mla and h != 1)
]


def test_every_power_of_two_pair_is_servable() -> None:
    """With power-of-two sizes every pair can be served, GQA replication and MLA included."""
    for heads, prefill_tp, decode_tp, mla in ALL_CASES:
        assert _valid(heads, prefill_tp, decode_tp, mla) is not None, (heads, prefill_tp, decode_tp)


@pytest.mark.parametrize("heads,prefill_tp,decode_tp,mla", ALL_CASES)
def test_pulls_assemble_exactly_the_decode_heads(heads, prefill_tp, decode_tp, mla) -> None:
    topo = TransferTopology(heads, prefill_tp, decode_tp, is_mla=mla)
    num_heads = 1 if mla else heads
    for seed in (0, 1, 2, 3, 12345):
        readers: dict[int, list[int]] = {}
        for d in range(decode_tp):
            wanted = owned_heads(num_heads, decode_tp, d, mla)
            assert list(topo.decode_heads(d)) == wanted
            assembled = [None] * len(wanted)
            pulls = topo.pulls_for(d, seed)
            assert len(pulls) == topo.pulls_per_decode_rank
            for pull in pulls:
                have = owned_heads(num_heads, prefill_tp, pull.prefill_rank, mla)
                assert len(pull.src_heads) == len(pull.dst_heads) > 0
                for s, t in zip(pull.src_heads, pull.dst_heads, strict=True):
                    assert assembled[t] is None, "two pulls write the same decode head"
                    assembled[t] = have[s]
                readers.setdefault(pull.prefill_rank, []).append(d)
            assert assembled == wanted
            # Pulls are ordered by destination head and each covers whole slices.
            starts = [p.dst_heads.start for p in pulls]
            assert starts == sorted(starts)
        for p in range(prefill_tp):
            assert topo.readers_of(p, seed) == tuple(sorted(readers.get(p, [])))


@pytest.mark.parametrize("heads,prefill_tp,decode_tp,mla", ALL_CASES)
def test_replicas_spread_reads(heads, prefill_tp, decode_tp, mla) -> None:
    """Decode ranks reading the same head group use distinct replicas while replicas last."""
    topo = TransferTopology(heads, prefill_tp, decode_tp, is_mla=mla)
    seed = 7
    load = {p: len(topo.readers_of(p, seed)) for p in range(prefill_tp)}
    by_group: dict[int, list[int]] = {}
    for p in range(prefill_tp):
        by_group.setdefault(topo.prefill_heads(p).start, []).append(load[p])
    for loads in by_group.values():
        assert max(loads) - min(loads) <= 1, (loads, topo.describe())


@given(
    heads=st.sampled_from(HEADS),
    prefill_tp=st.sampled_from(TPS),
    decode_tp=st.sampled_from(TPS),
    request_id=st.text(max_size=40),
)
def test_both_sides_agree_from_the_request_id(heads, prefill_tp, decode_tp, request_id) -> None:
    topo = TransferTopology(heads, prefill_tp, decode_tp)
    seed = request_seed(request_id)
    assert seed == request_seed(request_id)
    copy = TransferTopology(heads, prefill_tp, decode_tp)
    for d in range(decode_tp):
        assert topo.pulls_for(d, seed) == copy.pulls_for(d, seed)


def test_replica_choice_varies_with_the_request() -> None:
    topo = TransferTopology(2, 4, 1)
    chosen = {topo.pulls_for(0, request_seed(f"req-{i}"))[0].prefill_rank for i in range(32)}
    assert chosen == {0, 1}


def test_seed_is_stable_across_processes() -> None:
    """Prefill and decode compute the seed in different processes: it must not depend on hashing."""
    code = (
        "from vllm_ascend_mooncake.core.topology import request_seed; print(request_seed('req-1'))"
    )
    seeds = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": str(hash_seed)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for hash_seed in (1, 2)
    }
    assert seeds == {str(request_seed("req-1"))}
    assert request_seed("a") != request_seed("b")


def test_worked_example_h8_tp4_to_td2() -> None:
    topo = TransferTopology(8, 4, 2)
    assert topo.pulls_for(0, 0) == (
        HeadPull(0, range(0, 2), range(0, 2)),
        HeadPull(1, range(0, 2), range(2, 4)),
    )
    assert topo.pulls_for(1, 99) == (
        HeadPull(2, range(0, 2), range(0, 2)),
        HeadPull(3, range(0, 2), range(2, 4)),
    )


def test_worked_example_h2_tp4_to_td1_reads_two_replicas_of_different_heads() -> None:
    topo = TransferTopology(2, 4, 1)
    for seed in range(4):
        first, second = topo.pulls_for(0, seed)
        assert topo.prefill_heads(first.prefill_rank) == range(0, 1)
        assert topo.prefill_heads(second.prefill_rank) == range(1, 2)
        assert (first.dst_heads, second.dst_heads) == (range(0, 1), range(1, 2))
        unread = set(range(4)) - {first.prefill_rank, second.prefill_rank}
        for rank in unread:
            assert topo.readers_of(rank, seed) == ()


def test_slice_of_one_prefill_rank() -> None:
    topo = TransferTopology(8, 1, 4)
    assert topo.pulls_for(3, 0) == (HeadPull(0, range(6, 8), range(0, 2)),)
    assert topo.readers_of(0, 0) == (0, 1, 2, 3)


@pytest.mark.parametrize(
    "heads,prefill_tp,decode_tp,fragment",
    [
        (8, 3, 1, "prefill TP 3 does not divide the 8 KV heads"),
        (8, 1, 3, "decode TP 3 does not divide the 8 KV heads"),
        (4, 6, 2, "prefill TP 6 is larger than the 4 KV heads but not a multiple"),
        (12, 4, 3, "neither count divides the other"),
        (8, 0, 1, "prefill TP size must be >= 1"),
    ],
)
def test_unservable_pairs_are_rejected_with_the_sizes(heads, prefill_tp, decode_tp, fragment):
    with pytest.raises(TopologyError, match=fragment):
        TransferTopology(heads, prefill_tp, decode_tp)


def test_non_power_of_two_sizes_that_shard_evenly_are_served() -> None:
    # 6 heads: prefill TP 3 holds 2 heads per rank, decode TP 6 one: a slice of one rank each.
    topo = TransferTopology(6, 3, 6)
    assert topo.pulls_for(5, 0) == (HeadPull(2, range(1, 2), range(0, 1)),)
