"""Scheduler side of a model with two KV cache groups (vLLM's hybrid manager): a sliding-window
group beside a full-attention one, each held and pulled with its own block ids."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import RequestStatus

from vam_testing.scheduler_fakes import connector_scheduler, vllm_request
from vllm_ascend_mooncake.connector.scheduler import ConnectorScheduler
from vllm_ascend_mooncake.core.layout import LayoutError

BLOCK, WINDOW = 32, 64


def hybrid_config(second=None) -> KVCacheConfig:
    sliding = SlidingWindowSpec(
        block_size=BLOCK,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.bfloat16,
        sliding_window=WINDOW,
    )
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    return KVCacheConfig(
        num_blocks=512,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["layers.0.attn"], second or sliding),
            KVCacheGroupSpec(["layers.1.attn"], full),
        ],
    )


def scheduler(role: str, kv_cache_config=None) -> ConnectorScheduler:
    return connector_scheduler(
        role,
        prefill_tp=1,
        num_kv_heads=2,
        block_size=BLOCK,
        extra={"side_channel_port": 40000},
        kv_cache_config=kv_cache_config or hybrid_config(),
    )


def table(ids: list[int]) -> list[KVCacheBlock]:
    blocks = [KVCacheBlock(i) for i in ids]
    for block in blocks:
        block.is_null = block.block_id == 0
    return blocks


def prefill_params(num_tokens: int) -> dict:
    """A 150-token prompt: positions 0..4; the window (64) keeps tokens 87.. : positions 2..4."""
    p = scheduler("kv_producer")
    req = vllm_request("p-1", num_tokens, {"do_remote_decode": True})
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    sliding = [0, 0, 13, 14, 15]  # vLLM nulled the blocks below the window
    full = [21, 22, 23, 24, 25]
    delay, params = p.request_finished(req, (sliding, full))
    (held,) = p.build_step_orders().holds
    assert delay and held.block_ids == (13, 14, 15, 21, 22, 23, 24, 25)
    assert held.group_sizes == (3, 5)
    return params


def test_prefill_holds_each_groups_blocks_its_kind_keeps() -> None:
    params = prefill_params(150)
    assert params["remote_block_ids"] == [13, 14, 15, 21, 22, 23, 24, 25]
    assert params["remote_group_sizes"] == [3, 5]
    assert params["remote_kv_groups"] == ["sliding(64)", "full"]


def test_prefill_hands_off_nothing_when_vllm_freed_a_block_the_window_needs() -> None:
    p = scheduler("kv_producer")
    req = vllm_request("p-2", 150, {"do_remote_decode": True})
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert p.request_finished(req, ([0, 0, 0, 14, 15], [21, 22, 23, 24, 25])) == (False, None)
    assert not p.build_step_orders().holds


def test_decode_pulls_a_continued_prompt_group_by_group() -> None:
    params = prefill_params(150)
    params["remote_output_token_ids"] = [150]
    d = scheduler("kv_consumer")
    req = vllm_request("d-1", 151, params)
    assert d.get_num_new_matched_tokens(req, 0) == (150, True)
    allocated = KVCacheBlocks((table([0, 0, 33, 34, 35]), table([41, 42, 43, 44, 45])))
    d.update_state_after_alloc(req, allocated, 150)
    (pull,) = d.build_step_orders().pulls
    assert pull.local_block_ids == (33, 34, 35, 41, 42, 43, 44, 45)
    assert pull.local_group_sizes == (3, 5) and pull.remote_group_sizes == (3, 5)
    assert pull.remote_block_ids == (13, 14, 15, 21, 22, 23, 24, 25)


def test_decode_computes_a_whole_prompt_load_of_a_windowed_model() -> None:
    """vLLM would recompute the loaded prompt's last token, whose window may reach a block
    neither side holds: decode computes the prompt and releases prefill's hold."""
    d = scheduler("kv_consumer")
    req = vllm_request("d-2", 150, prefill_params(150))
    assert d.get_num_new_matched_tokens(req, 0) == (0, False)
    (release,) = d.build_step_orders().pulls
    assert release.release_only and release.transfer_id == "p-1"


def test_decode_of_another_grouping_refuses_the_params() -> None:
    params = prefill_params(150)
    params["remote_output_token_ids"] = [150]
    one_group = connector_scheduler("kv_consumer", prefill_tp=1, num_kv_heads=2, block_size=BLOCK)
    req = vllm_request("d-3", 151, params)
    assert one_group.get_num_new_matched_tokens(req, 0) == (0, False)
    (release,) = one_group.build_step_orders().pulls
    assert release.release_only


def test_a_decode_that_caches_a_prefix_reads_the_rest_of_each_group() -> None:
    params = prefill_params(150)
    params["remote_output_token_ids"] = [150]
    d = scheduler("kv_consumer")
    req = vllm_request("d-4", 151, params)
    assert d.get_num_new_matched_tokens(req, 96) == (54, True)  # 3 blocks cached here
    allocated = KVCacheBlocks((table([0, 0, 53, 34, 35]), table([51, 52, 53, 44, 45])))
    d.update_state_after_alloc(req, allocated, 54)
    (pull,) = d.build_step_orders().pulls
    assert pull.local_block_ids == (34, 35, 44, 45) and pull.local_group_sizes == (2, 2)


def test_a_state_group_is_refused_naming_its_kind() -> None:
    state = MambaSpec(
        block_size=BLOCK,
        shapes=((3, 512), (4, 64, 64)),
        dtypes=(torch.bfloat16, torch.bfloat16),
    )
    with pytest.raises(LayoutError, match="MambaSpec"):
        scheduler("kv_producer", hybrid_config(state))


def test_prefill_computes_all_but_the_last_prompt_token_once() -> None:
    """A hybrid model's prefill drops its prompt's last token (decode computes it), once,
    however often vLLM re-admits the request; a plain request keeps its prompt."""
    p = scheduler("kv_producer")
    req = vllm_request("p-3", 150, {"do_remote_decode": True})
    p.on_new_request(req)
    p.on_new_request(req)  # preempted and admitted again
    assert req.num_prompt_tokens == 149 and len(req.prompt_token_ids) == 149
    plain = vllm_request("p-4", 150, None)
    p.on_new_request(plain)
    assert plain.num_prompt_tokens == 150
    req.status = RequestStatus.FINISHED_STOPPED  # an EOS after a prefix answers nothing
    delay, params = p.request_finished(req, ([0, 0, 13, 14, 15], [21, 22, 23, 24, 25]))
    assert delay and params["remote_prompt_prefix"] is True
    assert params["remote_num_tokens"] == 149


def test_decode_pulls_a_prompt_prefix_and_computes_the_last_token() -> None:
    p = scheduler("kv_producer")
    prefill = vllm_request("p-5", 150, {"do_remote_decode": True})
    p.on_new_request(prefill)
    prefill.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = p.request_finished(prefill, ([0, 0, 13, 14, 15], [21, 22, 23, 24, 25]))
    d = scheduler("kv_consumer")
    req = vllm_request("d-5", 150, params)
    assert d.get_num_new_matched_tokens(req, 0) == (149, True)
    allocated = KVCacheBlocks((table([0, 0, 33, 34, 35]), table([41, 42, 43, 44, 45])))
    d.update_state_after_alloc(req, allocated, 149)
    (pull,) = d.build_step_orders().pulls
    assert pull.num_prompt_tokens == 149 and pull.local_group_sizes == (3, 5)


def test_decode_admitted_before_prefill_expects_a_prompt_prefix() -> None:
    """Overlapped legs: no block ids yet; prefill of the same hybrid model stops one short."""
    d = scheduler("kv_consumer")
    early = {
        "do_remote_prefill": True,
        "remote_request_id": "t-9",
        "remote_engine_id": "engine-p",
        "remote_host": "127.0.0.1",
        "remote_port": 40000,
        "remote_tp_size": 1,
    }
    req = vllm_request("d-6", 150, early)
    assert d.get_num_new_matched_tokens(req, 0) == (149, True)
