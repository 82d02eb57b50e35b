"""End to end with a data-parallel prefill: two engines behind one API server, overlapped legs.

Each engine of ``vllm serve --data-parallel-size 2`` holds its KV on side-channel ports of its
own under its own engine id (``<id>_dp<rank>``). With overlapped legs the proxy names the
prefill engine to decode before prefill has answered, so it pins every prefill leg to that engine
(``X-data-parallel-rank``) and learns each engine's address from a pinned serial leg first. A
wrong guess would make decode wait for a KV that never comes until ``prefill_wait_s``; a short
one here turns any such wait into a failed pull, which the clean-transfer check counts.

Prefill DP 2 x TP 1, decode TP 2: each decode rank reads its KV head from whichever engine
computed the request. The answers must equal what the prefill engines answer colocated, token
for token (float32), sequential and concurrent, with every request on both engines pulled once
per decode rank, no decode leg resent, nothing leaked.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
from pd_checks import assert_clean_transfers, assert_same, complete, metric

from vllm_ascend_mooncake.launch.deployment import DeploymentSpec, LocalDeployment
from vllm_ascend_mooncake.launch.prometheus import metric_samples, metrics_text
from vllm_ascend_mooncake.launch.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.engine

PROMPTS = [
    "hello world",
    " ".join(f"word{i} the quick brown fox" for i in range(20)),
    "data parallel prefill engines hold their own caches",
    " ".join(f"block{i} spans tokens" for i in range(30)),
    "the proxy pins each prefill leg to one engine",
    " ".join(f"engine{i} answers" for i in range(12)),
]
SEQUENTIAL = 4  # the rest go at once


def per_engine(url: str, name: str) -> dict[str, float]:
    """A vLLM counter by its ``engine`` label (the DP engine index)."""
    totals: dict[str, float] = {}
    for labels, value in metric_samples(metrics_text(url), name):
        totals[labels["engine"]] = totals.get(labels["engine"], 0.0) + value
    return totals


def test_a_dp2_prefill_serves_overlapped_legs_from_both_engines(tmp_path) -> None:
    model = str(build_tiny_model(TinyModelSpec(num_kv_heads=2, dtype="float32")))
    spec = DeploymentSpec(
        model=model,
        prefill_tp=1,
        prefill_dp=2,
        decode_tp=2,
        log_dir=str(tmp_path),
        # A decode told the wrong engine would wait this long, then fail the pull (counted).
        extra_connector_config={"prefill_wait_s": 20.0},
        # Overlapped legs are for requests whose first token decode samples.
        proxy_args=("--first-token", "decode"),
    )
    with LocalDeployment(spec) as pd:
        name = httpx.get(f"{pd.prefill.base_url}/v1/models").json()["data"][0]["id"]
        expected = {p: complete(pd.prefill.base_url, name, p) for p in PROMPTS}
        engines_before = per_engine(pd.prefill.base_url, "vllm:prompt_tokens_total")
        assert set(engines_before) == {"0", "1"}, engines_before

        for prompt in PROMPTS[:SEQUENTIAL]:  # one at a time: vLLM alone would pick engine 0
            assert_same(complete(pd.proxy_url, name, prompt), expected[prompt], "sequential")
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS) - SEQUENTIAL) as pool:
            concurrent_prompts = PROMPTS[SEQUENTIAL:]
            answers = {p: pool.submit(complete, pd.proxy_url, name, p) for p in concurrent_prompts}
            for prompt, answer in answers.items():
                assert_same(answer.result(), expected[prompt], "concurrent")

        assert_clean_transfers(pd, requests=len(PROMPTS))
        engines_after = per_engine(pd.prefill.base_url, "vllm:prompt_tokens_total")
        computed = {e: engines_after[e] - engines_before.get(e, 0.0) for e in engines_after}
        assert all(tokens > 0 for tokens in computed.values()), computed
        assert metric(pd.proxy_url, "vam_proxy_decode_resends_total") == 0
        # The first request and engine 1's first (pinned, to learn its address) go serial.
        overlapped = metric(pd.proxy_url, "vam_proxy_requests_total", {"legs": "overlapped"})
        assert overlapped == len(PROMPTS) - 2, overlapped
        proxy_log = pd.proxy_log.read_text(errors="replace")
        for rank in (0, 1):
            assert f"(data-parallel engine {rank} of 2) serves its KV cache" in proxy_log
    print(f"[prefill dp] prompt tokens computed per prefill engine through P/D: {computed}")
