"""KV cache groups (core/groups.py) and the grouped planner: which positions a group holds, the
flat form blocks travel in, and a sliding-window group's suffix planned token by token."""

from __future__ import annotations

import itertools

import pytest

from vllm_ascend_mooncake.core.groups import (
    GroupKind,
    GroupSpec,
    block_groups,
    flatten_groups,
    split_groups,
)
from vllm_ascend_mooncake.core.plan_tokens import align_tokens
from vllm_ascend_mooncake.core.plan_types import PlanError


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.mark.parametrize("block", [16, 32, 64])
@pytest.mark.parametrize("window", [1, 17, 64, 100])
def test_a_sliding_group_holds_the_blocks_its_window_reaches(block: int, window: int) -> None:
    group = GroupSpec(GroupKind.SLIDING, block, window)
    for n in range(1, 400):
        first = group.first_held(n)
        # the next token attends [n - W + 1, n]: the first held block has its first token
        assert first * block <= max(0, n - window + 1) < (first + 1) * block
        assert group.held_count(n) == cdiv(n, block) - first
    full = GroupSpec(GroupKind.FULL, block)
    assert [full.held_count(n) for n in (1, block, block + 1)] == [1, 1, 2]


def test_decode_wants_what_it_does_not_cache_of_what_the_window_keeps() -> None:
    sliding = GroupSpec(GroupKind.SLIDING, 32, 64)
    assert sliding.wanted_count(300, 0) == sliding.held_count(300) == 3  # 237..299: 7, 8, 9
    assert sliding.wanted_count(300, 256) == 2  # blocks 8 and 9
    assert sliding.wanted_count(300, 288) == 1
    assert sliding.wanted_count(300, 320) == 0
    full = GroupSpec(GroupKind.FULL, 32)
    assert full.wanted_count(300, 64) == 8


def test_group_specs_refuse_what_they_cannot_be() -> None:
    with pytest.raises(ValueError):
        GroupSpec(GroupKind.SLIDING, 32)
    with pytest.raises(ValueError):
        GroupSpec(GroupKind.FULL, 32, 64)
    with pytest.raises(ValueError):
        GroupSpec(GroupKind.FULL, 0)
    assert GroupSpec(GroupKind.SLIDING, 32, 64).describe() == "sliding(64)"


def test_blocks_travel_flat_with_their_groups_sizes() -> None:
    assert flatten_groups([(1, 2, 3)]) == ((1, 2, 3), ())
    assert flatten_groups([(7, 8), (1, 2, 3)]) == ((7, 8, 1, 2, 3), (2, 3))
    assert split_groups((7, 8, 1, 2, 3), (2, 3)) == [(7, 8), (1, 2, 3)]
    assert split_groups((1, 2), ()) == [(1, 2)]
    with pytest.raises(ValueError):
        split_groups((1, 2, 3), (2, 2))


def test_a_sides_blocks_split_into_as_many_groups_as_the_kv_cache_has() -> None:
    assert block_groups((7, 8, 1, 2, 3), (2, 3), 2) == [(7, 8), (1, 2, 3)]
    assert block_groups((1, 2), (), 1) == [(1, 2)]
    assert block_groups((), (), 3) == [(), (), ()]  # none at all: every group empty
    assert block_groups((), (0, 0), 2) == [(), ()]
    with pytest.raises(ValueError, match="do not split"):
        block_groups((1, 2, 3), (2, 2), 2)
    with pytest.raises(ValueError, match=r"come in 1 KV cache group\(s\), .* has 2"):
        block_groups((1, 2), (), 2)
    with pytest.raises(ValueError, match="come in 2 KV cache group"):
        block_groups((1, 2), (1, 1), 1)


@pytest.mark.parametrize(
    ("prefill_block", "decode_block"), [(16, 32), (32, 16), (16, 64), (64, 16), (32, 32)]
)
def test_a_windowed_suffix_moves_every_token_the_window_keeps(
    prefill_block: int, decode_block: int
) -> None:
    """Token ``t`` sits at prefill block ``t // Bp`` and decode block ``t // Bd``; prefill holds
    only its window's trailing blocks. Every token decode's window needs moves, to its slot,
    from its slot; none from a block prefill dropped."""
    window = 48
    for n, cached in itertools.product(range(1, 260, 7), (0, 64)):
        if cached >= n:
            continue
        prefill = GroupSpec(GroupKind.SLIDING, prefill_block, window)
        decode = GroupSpec(GroupKind.SLIDING, decode_block, window)
        held = prefill.held_count(n)
        p_first = cdiv(n, prefill_block) - held
        remote = [1000 + p_first + i for i in range(held)]  # id 1000 + position
        wanted = decode.wanted_count(n, cached)
        d_end = cdiv(n, decode_block)
        local = [2000 + d_end - wanted + i for i in range(wanted)]
        if not wanted:
            continue
        pieces = align_tokens(
            local,
            remote,
            decode_block_size=decode_block,
            prefill_block_size=prefill_block,
            num_tokens=n,
            remote_suffix=True,
        )
        moved = set()
        for i in range(len(pieces)):
            for k in range(pieces.tokens):
                t = (pieces.remote_blocks[i] - 1000) * prefill_block + pieces.remote_slots[i] + k
                assert t == (pieces.local_blocks[i] - 2000) * decode_block + (
                    pieces.local_slots[i] + k
                )
                moved.add(int(t))
        needed = set(range(max(cached, n - window + 1, 0), n))
        assert needed <= moved, (n, cached, sorted(needed - moved)[:4])
        assert min(moved) >= p_first * prefill_block  # nothing from a dropped block


def test_a_suffix_needs_the_prompt_length() -> None:
    with pytest.raises(PlanError):
        align_tokens([1], [2], decode_block_size=32, prefill_block_size=16, remote_suffix=True)


@pytest.mark.parametrize("decode_tp", [1, 2])
def test_each_region_moves_its_own_groups_blocks(decode_tp: int) -> None:
    """Regions of two groups (aliased layer slots, as vLLM lays a hybrid model out) each read
    their group's blocks: the sliding group's two held blocks, the full group's three."""
    import numpy as np

    from vam_testing.kv_reference import region_layouts, region_table
    from vllm_ascend_mooncake.core.plan import plan_grouped_request
    from vllm_ascend_mooncake.core.topology import TransferTopology

    block, n = 16, 40  # 3 blocks; a window of 20 keeps tokens 21.. : blocks 1 and 2
    topology = TransferTopology(2, 1, decode_tp)
    remote_layouts = region_layouts("fused_head_major", 2, 2, block, 4, 64, 0)
    local_layouts = region_layouts("fused_head_major", 2, 2 // decode_tp, block, 4, 64, 0)
    remote, _ = region_table("p.", 1 << 30, remote_layouts)
    local, _ = region_table("d.", 1 << 34, local_layouts)
    sliding, full = (GroupSpec(GroupKind.SLIDING, block, 20), GroupSpec(GroupKind.FULL, block))
    assert (sliding.held_count(n), full.held_count(n)) == (2, 3)
    plan = plan_grouped_request(
        topology,
        0,
        0,
        local,
        {0: remote},
        [0, 1],
        [(31, 32), (41, 42, 43)],
        [(11, 12), (21, 22, 23)],
        num_tokens=n,
    )
    read = {"local": set(), "remote": set()}
    for peer in plan.peers:
        for batch in peer.batches:
            for side, addrs, regions in (
                ("local", batch.local_addrs, local),
                ("remote", batch.remote_addrs, remote),
            ):
                for addr, length in zip(np.asarray(addrs), batch.lengths, strict=True):
                    for r, region in enumerate(regions):
                        start = int(addr) - region.base
                        if 0 <= start < region.layout.span_bytes:
                            stride = region.layout.block_stride
                            last = (start + int(length) - 1) // stride
                            read[side].update((r, b) for b in range(start // stride, last + 1))
    assert read["remote"] == {(0, 11), (0, 12), (1, 21), (1, 22), (1, 23)}
    assert read["local"] == {(0, 31), (0, 32), (1, 41), (1, 42), (1, 43)}
