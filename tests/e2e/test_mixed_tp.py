"""End to end: one decode instance fed by prefill instances of two TP sizes at once.

Decode runs TP 1 and is configured for prefill TP 2; a TP 2 and a TP 1 prefill instance stand
behind one proxy, which spreads requests over both. Each request's ``kv_transfer_params`` name
its prefill's TP size, and decode builds the topology for each size at its first handshake with
it: from the TP 2 prefill it merges the two head groups, from the TP 1 prefill it reads whole
blocks. Answers must equal decode's own colocated answers token for token (float32), every
request pulled once and none failed, both prefills computing prompts and freeing every block.
"""

from __future__ import annotations

import httpx
import pytest
from pd_checks import (
    assert_clean_transfers,
    assert_extra_prefill_clean,
    assert_same,
    complete,
    metric,
)

from vllm_ascend_mooncake.launch.deployment import DeploymentSpec, LocalDeployment
from vllm_ascend_mooncake.launch.ports import free_port_range
from vllm_ascend_mooncake.launch.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.engine

PROMPTS = [
    "hello world",
    " ".join(f"word{i} the quick brown fox" for i in range(20)),
    "prefill instances of two sizes feed one decode",
    " ".join(f"block{i} spans tokens" for i in range(30)),
    "the topology is built once per prefill size",
    " ".join(f"rank{i} holds heads" for i in range(12)),
]


def prompt_tokens(url: str) -> float:
    return metric(url, "vllm:prompt_tokens_total")


def test_one_decode_is_fed_by_a_tp2_and_a_tp1_prefill_through_one_proxy(tmp_path) -> None:
    model = str(build_tiny_model(TinyModelSpec(num_kv_heads=2, dtype="float32")))
    spec = DeploymentSpec(model=model, prefill_tp=2, decode_tp=1, log_dir=str(tmp_path))
    pd = LocalDeployment(spec)
    # A TP 1 prefill beside the deployment's TP 2 one, on side-channel ports of its own.
    small = pd.add_server(
        "kv_producer", name="prefill-tp1", prefill_tp=1, side_channel_port=free_port_range(1)
    )
    with pd:
        proxy = pd.add_proxy("--prefill", small.base_url)
        name = httpx.get(f"{pd.decode.base_url}/v1/models").json()["data"][0]["id"]
        expected = {p: complete(pd.decode.base_url, name, p) for p in PROMPTS}
        before = {url: prompt_tokens(url) for url in (pd.prefill.base_url, small.base_url)}

        for prompt in PROMPTS:
            assert_same(complete(proxy, name, prompt), expected[prompt], "through P/D")

        computed = {url: prompt_tokens(url) - before[url] for url in before}
        assert all(tokens > 0 for tokens in computed.values()), computed
        assert_clean_transfers(pd, requests=len(PROMPTS))  # decode's pulls, the TP 2 prefill
        assert_extra_prefill_clean(small.base_url, "the TP 1 prefill")
        decode_log = (tmp_path / "decode.log").read_text(errors="replace")
        assert "Traceback" not in decode_log
    print(f"[mixed tp] prompt tokens computed per prefill instance: {computed}")
