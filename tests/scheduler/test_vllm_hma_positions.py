"""Pins what the HMA design (docs/design/hma.md, issue #45) relies on in vLLM's KV cache manager:
which block positions of each group hold a request's KV after ``n`` computed tokens, on prefill
(at finish, as ``request_finished_all_groups`` receives them) and on decode (right after admitting
``n`` external tokens, as ``update_state_after_alloc`` sees them).

* sliding window ``W``: positions ``[(n - W + 1) // bs, cdiv(n, bs))``, the same on both sides;
* Mamba state, ``align`` mode: the single position ``(n - 1) // bs``, the same on both sides;
* full attention: ``[0, cdiv(n, bs))``.

And the hazard that makes decode never recompute a loaded token with a window: recomputing token
``n - 1`` attends from token ``n - W``, which lies in a block both sides dropped whenever
``(n - W + 1) % bs == 0``.

No engine and no connector: vLLM's ``KVCacheManager`` over two groups, as the scheduler drives it.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from vam_testing.vllm_scheduler import make_request  # noqa: E402
from vllm_ascend_mooncake.core.groups import GroupKind, GroupSpec  # noqa: E402

BLOCK_SIZE = 32
WINDOW = 64
PROMPT_LENGTHS = (20, 63, 64, 100, 127, 128, 129, 159, 160, 191, 192, 300)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _specs(kind: str) -> tuple[KVCacheSpec, FullAttentionSpec]:
    """The second group (sliding window or GDN state) and the full-attention group, with equal
    pages as vLLM makes them (the Mamba page padded to the attention page or the other way)."""
    full = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64, dtype=torch.bfloat16
    )
    if kind == "sliding":
        sliding = SlidingWindowSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=2,
            head_size=64,
            dtype=torch.bfloat16,
            sliding_window=WINDOW,
        )
        return sliding, full
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    state_bytes = 3 * 512 * 2 + 4 * 64 * 64 * 2  # the tiny Qwen3-Next's TP 1 state
    page = max(full.page_size_bytes, state_bytes)
    state = MambaSpec(
        block_size=BLOCK_SIZE,
        shapes=((3, 512), (4, 64, 64)),
        dtypes=(torch.bfloat16, torch.bfloat16),
        page_size_padded=page,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode="align",
    )
    full = FullAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.bfloat16,
        page_size_padded=page if page != full.page_size_bytes else None,
    )
    return state, full


def _manager(kind: str) -> KVCacheManager:
    second, full = _specs(kind)
    config = KVCacheConfig(
        num_blocks=256,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["layer.0"], second),
            KVCacheGroupSpec(["layer.1"], full),
        ],
    )
    return KVCacheManager(
        config,
        max_model_len=1024,
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        enable_caching=True,
    )


def _expected(kind: str, n: int) -> range:
    """The positions the second group holds: the connector's rule (``GroupSpec``) for a
    sliding window, the design's single position for a state."""
    if kind == "sliding":
        group = GroupSpec(GroupKind.SLIDING, BLOCK_SIZE, WINDOW)
        end = _cdiv(n, BLOCK_SIZE)
        return range(end - group.held_count(n), end)
    return range((n - 1) // BLOCK_SIZE, (n - 1) // BLOCK_SIZE + 1)


def _real_positions(block_ids: list[int]) -> list[int]:
    return [position for position, block_id in enumerate(block_ids) if block_id != 0]


@pytest.mark.parametrize("kind", ["sliding", "mamba_align"])
@pytest.mark.parametrize("n", PROMPT_LENGTHS)
def test_prefill_holds_the_designed_positions_at_finish(kind: str, n: int) -> None:
    manager = _manager(kind)
    request = make_request(f"p-{n}", n, block_size=BLOCK_SIZE)
    assert manager.allocate_slots(request, n) is not None
    request.num_computed_tokens = n
    # what Scheduler._connector_finished does before request_finished_all_groups
    manager.remove_skipped_blocks(request.request_id, n, num_prompt_tokens=n)
    second, full = manager.get_block_ids_for_computed_tokens(request.request_id, n)
    assert _real_positions(second) == list(_expected(kind, n))
    assert _real_positions(full) == list(range(_cdiv(n, BLOCK_SIZE)))


@pytest.mark.parametrize("kind", ["sliding", "mamba_align"])
@pytest.mark.parametrize("n", PROMPT_LENGTHS)
def test_decode_allocates_the_same_positions_for_a_load(kind: str, n: int) -> None:
    """A decode request continuing prefill's ``n`` tokens by one (the design's rule: the load
    never covers the whole prompt) admitted for an asynchronous load of ``n`` tokens."""
    manager = _manager(kind)
    request = make_request(f"d-{n}", n + 1, block_size=BLOCK_SIZE)
    blocks = manager.allocate_slots(
        request, 0, num_external_computed_tokens=n, delay_cache_blocks=True
    )
    assert blocks is not None
    second, full = manager.get_blocks(request.request_id).get_block_ids()
    assert _real_positions(second) == list(_expected(kind, n))
    assert _real_positions(full) == list(range(_cdiv(n, BLOCK_SIZE)))


@pytest.mark.parametrize("n", PROMPT_LENGTHS)
def test_recomputing_the_last_loaded_token_needs_a_dropped_block_at_window_edges(n: int) -> None:
    """Why a load must not cover decode's whole prompt: the window of token ``n - 1`` starts at
    ``n - W``; its block is dropped exactly when ``(n - W + 1) % bs == 0``."""
    if n < WINDOW:
        return
    needed_first_block = (n - WINDOW) // BLOCK_SIZE
    dropped = needed_first_block not in _expected("sliding", n)
    assert dropped == ((n - WINDOW + 1) % BLOCK_SIZE == 0)
