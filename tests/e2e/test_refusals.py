"""End to end: a decode instance told of a prefill it cannot read refuses to start, naming both
sides' values and what to change, and the prefill is unharmed.

Every refusal the handshake makes has a unit test (tests/datapath/test_compat.py, one per
mismatch; tests/datapath/test_pairing.py for the start-up pairing that runs it); this runs the
whole path once through ``vllm serve``: prefill bfloat16 with 96-token blocks, decode float32
with 64-token blocks (neither block size divides the other). Without start-up pairing the same
deployment would start and fail its first request with HTTP 500.
"""

from __future__ import annotations

import httpx
import pytest
from pd_checks import (
    assert_extra_prefill_clean,
    assert_same,
    complete,
    complete_like_vllm_example_proxy,
    metric,
)

from vam_testing.waiting import wait_until
from vllm_ascend_mooncake.launch.deployment import DeploymentSpec, LocalDeployment
from vllm_ascend_mooncake.launch.servers import ServerError
from vllm_ascend_mooncake.launch.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.engine


def test_decode_refuses_to_start_beside_a_prefill_of_another_dtype_and_block_size(
    tmp_path,
) -> None:
    model = str(build_tiny_model(TinyModelSpec(num_kv_heads=2)))
    spec = DeploymentSpec(
        model,
        prefill_tp=1,
        decode_tp=1,
        block_size=64,
        prefill_block_size=96,
        log_dir=str(tmp_path),
    )
    pd = LocalDeployment(spec)
    pd.prefill = pd.make_server("kv_producer", dtype="bfloat16")
    try:
        # Started together, as a deployment is: decode's start-up pairing waits for prefill.
        pd.prefill.start()
        pd.decode.start()
        pd.prefill.wait_ready(600)
        with pytest.raises(ServerError, match="exited with code"):
            pd.decode.wait_ready(600)
        log = (tmp_path / "decode.log").read_text(errors="replace")
        refusal = next(
            (line for line in log.splitlines() if "cannot read the prefill instance" in line), ""
        )
        assert f"prefill instance at 127.0.0.1:{pd.side_channel_port}" in refusal, log[-4000:]
        assert "dtype 'torch.bfloat16' on prefill vs 'torch.float32' on decode" in refusal
        assert "block_size 96 on prefill vs 64 on decode: neither divides the other" in refusal
        # what to change; a CPU with AMX also names the attention backend (bfloat16 takes
        # CPU_ATTN/amx there, float32 CPU_ATTN/vec), so each fix is looked for on its own
        assert "start both instances with the same --dtype" in refusal
        assert "--block-size values where one divides the other" in refusal
        # the refused prefill is unharmed: nothing claimed, nothing held
        assert httpx.get(f"{pd.prefill.base_url}/health", timeout=30).status_code == 200
        assert_extra_prefill_clean(pd.prefill.base_url, "the refused prefill")
    finally:
        pd.stop()


def test_an_incompatible_prefill_not_paired_at_start_costs_no_request(tmp_path) -> None:
    """Issue #44 item 3: a prefill of another dtype (bfloat16 beside a float32 decode, same
    block size: nothing in its ``kv_transfer_params`` tells) that decode was not told of at
    start-up (no ``prefill_side_channels``). Its first pull used to find the pair unpairable and
    fail (HTTP 500 under vLLM's default ``kv_load_failure_policy=fail``). Now decode pairs with
    a prefill engine before its first pull (``pair_before_pull``): that request and every later
    one are computed on decode, equal to decode's own colocated answers, prefill's holds
    released, and no pull fails. Both instances stay up and every block comes back."""
    model = str(build_tiny_model(TinyModelSpec(num_kv_heads=2)))
    spec = DeploymentSpec(
        model, prefill_tp=1, decode_tp=1, block_size=64, pair_at_start=False, log_dir=str(tmp_path)
    )
    pd = LocalDeployment(spec)
    pd.prefill = pd.make_server("kv_producer", dtype="bfloat16")
    prompts = ["an unpairable prefill", " ".join(f"word{i} of a longer prompt" for i in range(30))]
    with pd:
        name = httpx.get(f"{pd.decode.base_url}/v1/models").json()["data"][0]["id"]
        expected = {p: complete(pd.decode.base_url, name, p, cache_salt="colo") for p in prompts}
        for prompt in [*prompts, prompts[0]]:
            got = complete_like_vllm_example_proxy(
                pd.prefill.base_url, pd.decode.base_url, name, prompt
            )
            assert_same(got, expected[prompt], "computed on decode, the prefill refused")
        assert pd.failed_pulls_by_kind() == {}
        for server in (pd.prefill, pd.decode):
            assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200
        assert_extra_prefill_clean(pd.prefill.base_url, "the unpairable prefill")
        assert metric(pd.decode.base_url, "vllm:kv_cache_usage_perc") == 0
        log = (tmp_path / "decode.log").read_text(errors="replace")
        assert log.count("cannot pair with this decode instance:") == 1
        assert "dtype 'torch.bfloat16' on prefill vs 'torch.float32' on decode" in log

        # vam-proxy learns the prefill's engine id from an answer, reads decode's report of it
        # (/metrics) after a health round, and routes around that prefill: with no other
        # prefill left, requests go to decode alone (no wasted prefill), answers unchanged
        through_proxy = complete(pd.proxy_url, name, prompts[0])
        assert_same(through_proxy, expected[prompts[0]], "through vam-proxy")

        def prefill_entry() -> dict:
            return httpx.get(f"{pd.proxy_url}/ready", timeout=30).json()["prefill"][0]

        wait_until(
            lambda: prefill_entry()["state"] == "unpairable",
            "vam-proxy marks the prefill unpairable",
            timeout_s=60,
        )
        assert "no decode instance can read its KV" in prefill_entry()["unpairable"]
        prefilled = metric(pd.prefill.base_url, "vllm:request_success_total")
        alone = complete(pd.proxy_url, name, prompts[1])
        assert_same(alone, expected[prompts[1]], "decode alone through vam-proxy")
        assert metric(pd.prefill.base_url, "vllm:request_success_total") == prefilled
        assert metric(pd.proxy_url, "vam_proxy_requests_total", {"legs": "decode_alone"}) >= 1
        assert pd.failed_pulls_by_kind() == {}
