"""End to end: prefill and decode instances with different block sizes, head-major CPU blocks.

Decode runs TP 1 with 64-token blocks. Two prefill instances stand behind one proxy: TP 2 with
32-token blocks (decode's blocks are larger: two prefill blocks, one from each of two ranks'
head groups, fill one decode block) and TP 1 with 128-token blocks (prefill's are larger: one
prefill block fills two decode blocks). vLLM CPU packs each (block, head) chunk per ISA kernel (K
column-major, V row-major for the vec kernel float32 uses), so each pulled block is cut by token,
row by row, through decode's staging buffer. Answers must equal decode's own colocated answers
token for token (float32), every pull succeed, both prefills compute prompts and free every block.
"""

from __future__ import annotations

import itertools

import httpx
import pytest
from pd_checks import (
    assert_clean_transfers,
    assert_extra_prefill_clean,
    assert_same,
    complete,
    complete_like_vllm_example_proxy,
    metric,
)

from vllm_ascend_mooncake.launch.deployment import DeploymentSpec, LocalDeployment
from vllm_ascend_mooncake.launch.ports import free_port_range
from vllm_ascend_mooncake.launch.servers import start_servers, stop_all
from vllm_ascend_mooncake.launch.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.engine

PROMPTS = [
    "hello world",
    " ".join(f"word{i} the quick brown fox" for i in range(20)),
    "one block of prefill is half a block of decode",
    " ".join(f"block{i} spans tokens" for i in range(40)),
    "a long prefill block fills two decode blocks",
    " ".join(f"rank{i} holds heads" for i in range(12)),
]


def test_decode_64_is_fed_by_prefills_with_32_and_128_token_blocks(tmp_path) -> None:
    model = str(build_tiny_model(TinyModelSpec(num_kv_heads=2, dtype="float32")))
    spec = DeploymentSpec(
        model=model,
        prefill_tp=2,
        decode_tp=1,
        block_size=64,
        prefill_block_size=32,
        log_dir=str(tmp_path),
    )
    pd = LocalDeployment(spec)
    large = pd.add_server(
        "kv_producer",
        name="prefill-128",
        prefill_tp=1,
        prefill_block_size=128,
        side_channel_port=free_port_range(1),
    )
    with pd:
        proxy = pd.add_proxy("--prefill", large.base_url)
        name = httpx.get(f"{pd.decode.base_url}/v1/models").json()["data"][0]["id"]
        expected = {p: complete(pd.decode.base_url, name, p) for p in PROMPTS}
        prefills = (pd.prefill.base_url, large.base_url)
        before = {url: metric(url, "vllm:prompt_tokens_total") for url in prefills}

        for prompt in PROMPTS:
            assert_same(complete(proxy, name, prompt), expected[prompt], "through P/D")

        computed = {url: metric(url, "vllm:prompt_tokens_total") - before[url] for url in prefills}
        assert all(tokens > 0 for tokens in computed.values()), computed
        assert_clean_transfers(pd, requests=len(PROMPTS))
        assert_extra_prefill_clean(large.base_url, "the 128-token prefill")
        decode_log = (tmp_path / "decode.log").read_text(errors="replace")
        assert "Traceback" not in decode_log
        assert "CPU_ATTN/vec" in decode_log, "decode did not run vLLM CPU's vec kernel"
    print(f"[block sizes] prompt tokens computed per prefill instance: {computed}")


#: Prefill instances feeding decode TP 2 / 64-token blocks: (TP, block size), both directions of
#: the size ratio at every prefill TP. The first is the deployment's own; the others start a group
#: at a time (start-ups overlap; a TP 4 instance holds ~7.9 GiB, so at most one at a time).
DECODE_TP2_OWN_PREFILL = (1, 32)
DECODE_TP2_FEEDER_GROUPS = [[(4, 32), (1, 128)], [(4, 128)], [(2, 32), (2, 128)]]
DECODE_TP2_FEEDERS = [DECODE_TP2_OWN_PREFILL, *itertools.chain(*DECODE_TP2_FEEDER_GROUPS)]


def test_decode_tp2_with_64_token_blocks_is_fed_by_prefills_of_every_tp_and_size(tmp_path) -> None:
    """Issue #26 item 2: decode TP 2 with 64-token blocks, 4 KV heads (2 per decode rank), fed in
    turn by prefills of TP 1, 2 and 4 (4, 2 and 1 heads per rank: read in place, from one rank,
    or gathered from two) with 32-token blocks (two prefill blocks fill one decode block) and
    128-token blocks (one prefill block fills two decode blocks). Each view states the vec
    packing, so every pull cuts blocks by token. Requests go the way vLLM's example proxy sends
    them (straight to the prefill under test, then to decode), a cache salt per prefill keeping
    decode's prefix cache out of the way: answers equal decode's colocated ones, every pull on
    both decode ranks succeeds and every prefill frees every block."""
    model = str(build_tiny_model(TinyModelSpec(num_kv_heads=4, dtype="float32")))
    first_tp, first_block = DECODE_TP2_OWN_PREFILL
    spec = DeploymentSpec(
        model=model,
        prefill_tp=first_tp,
        decode_tp=2,
        block_size=64,
        prefill_block_size=first_block,
        log_dir=str(tmp_path),
    )
    prompts = PROMPTS[:4]
    with LocalDeployment(spec) as pd:
        name = httpx.get(f"{pd.decode.base_url}/v1/models").json()["data"][0]["id"]
        expected = {p: complete(pd.decode.base_url, name, p) for p in prompts}

        def serve_through(prefill_url: str, what: str) -> None:
            before = metric(prefill_url, "vllm:prompt_tokens_total")
            # vLLM refuses '/' in a cache salt
            salt = what.replace(" ", "").replace("/", "-")
            for prompt in prompts:
                got = complete_like_vllm_example_proxy(
                    prefill_url, pd.decode.base_url, name, prompt, cache_salt=salt
                )
                assert_same(got, expected[prompt], what)
            assert metric(prefill_url, "vllm:prompt_tokens_total") > before, what

        serve_through(pd.prefill.base_url, f"prefill TP {first_tp} / {first_block}")
        for group in DECODE_TP2_FEEDER_GROUPS:
            prefills = {
                f"prefill TP {tp} / {block}": pd.make_server(
                    "kv_producer",
                    name=f"prefill-tp{tp}-b{block}",
                    prefill_tp=tp,
                    prefill_block_size=block,
                    side_channel_port=free_port_range(tp),
                )
                for tp, block in group
            }
            try:
                start_servers(list(prefills.values()), 600)
                for what, prefill in prefills.items():
                    serve_through(prefill.base_url, what)
                    assert_extra_prefill_clean(prefill.base_url, what)
            finally:
                stop_all((), prefills.values())
        assert_clean_transfers(pd, requests=len(prompts) * len(DECODE_TP2_FEEDERS))
        decode_log = (tmp_path / "decode.log").read_text(errors="replace")
        assert "Traceback" not in decode_log
        assert "attention CPU_ATTN/vec" in decode_log
        assert "treating its blocks as unsplittable" not in decode_log
        for tp, _ in DECODE_TP2_FEEDERS:  # each prefill TP size paired at its first handshake
            assert f"paired: prefill TP {tp} -> decode TP 2 (4 KV heads)" in decode_log, tp


def test_bfloat16_blocks_of_the_amx_kernel_are_cut_by_token(tmp_path) -> None:
    """bf16 on a CPU with AMX tiles runs vLLM's amx kernel, whose chunks group K by 16 tokens
    and V by 2: prefill 32 / decode 64, TP 1 on both. bf16 logprobs are not compared (the two
    block sizes split the prompt's attention differently); the tokens must be equal (they were
    when this was written). Without AMX the vec kernel runs, and the test checks that instead."""
    import torch

    isa = "amx" if torch.cpu._is_amx_tile_supported() else "vec"
    model = str(build_tiny_model(TinyModelSpec(num_kv_heads=2, dtype="bfloat16")))
    spec = DeploymentSpec(
        model=model,
        prefill_tp=1,
        decode_tp=1,
        dtype="bfloat16",
        block_size=64,
        prefill_block_size=32,
        log_dir=str(tmp_path),
    )
    with LocalDeployment(spec) as pd:
        name = httpx.get(f"{pd.decode.base_url}/v1/models").json()["data"][0]["id"]
        for prompt in PROMPTS[:4]:
            colocated = complete(pd.decode.base_url, name, prompt)
            through = complete(pd.proxy_url, name, prompt)
            assert through["choices"][0]["token_ids"] == colocated["choices"][0]["token_ids"], (
                prompt
            )
        assert_clean_transfers(pd, requests=4)
        decode_log = (tmp_path / "decode.log").read_text(errors="replace")
        assert f"attention CPU_ATTN/{isa}" in decode_log


def test_a_config_head_dim_the_attention_ignores_plans_from_the_layers(tmp_path) -> None:
    """Issue #44's geometry: a Qwen2 checkpoint whose config says ``head_dim`` 64 while vLLM's
    Qwen2 attention computes ``hidden_size // num_attention_heads`` = 32 (16 query heads, 4 KV
    heads, hidden 512, float32). Decode TP 2 with 64-token blocks is fed through one ``vam-proxy``
    by a TP 1 prefill with 32-token blocks and a TP 4 prefill with 128-token blocks: the packing
    that lets blocks be cut by token must come from the layers (32), not the config (64), or
    every pull is refused as incompatible. Answers equal decode's colocated ones, every pull
    succeeds, both prefills compute prompts and free every block."""
    model_spec = TinyModelSpec(
        architecture="qwen2",
        num_attention_heads=16,
        num_kv_heads=4,
        head_dim=32,
        config_head_dim=64,
        dtype="float32",
    )
    assert model_spec.hidden == 512
    spec = DeploymentSpec(
        model=str(build_tiny_model(model_spec)),
        prefill_tp=1,
        decode_tp=2,
        block_size=64,
        prefill_block_size=32,
        log_dir=str(tmp_path),
    )
    pd = LocalDeployment(spec)
    wide = pd.add_server(
        "kv_producer",
        name="prefill-tp4-128",
        prefill_tp=4,
        prefill_block_size=128,
        side_channel_port=free_port_range(4),
    )
    prompts = PROMPTS[:4]
    with pd:
        proxy = pd.add_proxy("--prefill", wide.base_url)
        name = httpx.get(f"{pd.decode.base_url}/v1/models").json()["data"][0]["id"]
        expected = {p: complete(pd.decode.base_url, name, p) for p in prompts}
        prefills = (pd.prefill.base_url, wide.base_url)
        before = {url: metric(url, "vllm:prompt_tokens_total") for url in prefills}
        for prompt in prompts + prompts:  # twice: the balancer sends each prefill some
            assert_same(complete(proxy, name, prompt), expected[prompt], "through P/D")
        computed = {url: metric(url, "vllm:prompt_tokens_total") - before[url] for url in prefills}
        assert all(tokens > 0 for tokens in computed.values()), computed
        assert_clean_transfers(pd, requests=2 * len(prompts))
        assert_extra_prefill_clean(wide.base_url, "the TP 4 / 128-token prefill")
        decode_log = (tmp_path / "decode.log").read_text(errors="replace")
        assert "Traceback" not in decode_log
        assert "treating its blocks as unsplittable" not in decode_log
        assert "holds 2 KV head(s) of size 32 on this rank, where the model config" in decode_log
