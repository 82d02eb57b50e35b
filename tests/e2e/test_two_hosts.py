"""End to end across two emulated hosts: prefill and decode in network namespaces of their own.

The hosts are joined only through a router (:mod:`vam_testing.netns`): no
loopback between them, each instance advertises its own address (``VLLM_HOST_IP``), and every
byte between them, the proxy's HTTP to prefill, the side channel and Mooncake's reads, crosses a
link whose one-way delay and bandwidth the test sets. The proxy runs beside decode. Prefill TP 2,
decode TP 1, so decode merges the KV heads of two prefill ranks read from the other host.

Greedy float32 answers must equal a colocated instance's, token for token, with the link fast and
then slow (10 ms each way, 200 Mbit/s); every pull succeeds, nothing leaks, and the relay on the
router must have carried at least the bytes decode pulled, which proves the KV crossed the link.
The pull times of both phases are written to ``two_hosts_report.json`` in the deployment's log
directory (and printed): they are measurements to read, never asserted.
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest
from pd_checks import assert_clean_transfers, assert_same, complete, metric

from vam_testing.netns import TwoHostNetwork, missing_requirements
from vllm_ascend_mooncake.launch.deployment import DeploymentSpec, LocalDeployment
from vllm_ascend_mooncake.launch.servers import VllmServer
from vllm_ascend_mooncake.launch.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = [
    pytest.mark.engine,
    pytest.mark.netns,
    pytest.mark.skipif(missing_requirements() is not None, reason=str(missing_requirements())),
]

#: (label, one-way delay in ms, bandwidth cap in Mbit/s per direction or None)
LINKS = [("fast link", 0.0, None), ("10 ms each way, 200 Mbit/s", 10.0, 200.0)]

#: Per phase: the prompts sent one after the other, then two at once. Distinct per phase so
#: decode's prefix cache never serves a prompt the previous phase pulled.
PHASE_PROMPTS = {
    label: [
        f"{label}: hello world",
        f"{label}: " + " ".join(f"word{i} the quick brown fox" for i in range(20)),
        f"{label}: a disaggregated deployment pulls KV caches across hosts",
        f"{label}: " + " ".join(f"block{i} spans tokens" for i in range(30)),
    ]
    for label, _, _ in LINKS
}
ALL_PROMPTS = [prompt for prompts in PHASE_PROMPTS.values() for prompt in prompts]


def pull_totals(decode_url: str) -> dict[str, float]:
    return {
        "pulls": metric(decode_url, "vllm:mooncake_hetero_pull_seconds_count"),
        "pull_seconds": metric(decode_url, "vllm:mooncake_hetero_pull_seconds_sum"),
        "pulled_bytes": metric(decode_url, "vllm:mooncake_hetero_pulled_bytes_total"),
    }


def test_two_hosts_answer_like_colocated_over_a_fast_and_a_slow_link(tmp_path) -> None:
    model = str(build_tiny_model(TinyModelSpec(num_kv_heads=2, dtype="float32")))
    spec = DeploymentSpec(model=model, prefill_tp=2, decode_tp=1, log_dir=str(tmp_path))
    report: dict[str, dict[str, float]] = {}
    with TwoHostNetwork() as network:
        pd = LocalDeployment(spec, prefill_host=network.prefill, decode_host=network.decode)
        colocated = VllmServer(model, log_path=tmp_path / "colocated.log")
        try:
            # All three start at once; the colocated one stops as soon as it has answered.
            colocated.start()
            pd.start()
            colocated.wait_ready()
            name = httpx.get(f"{colocated.base_url}/v1/models").json()["data"][0]["id"]
            expected = {p: complete(colocated.base_url, name, p) for p in ALL_PROMPTS}
        finally:
            colocated.stop()
        try:
            for label, delay_ms, rate_mbit in LINKS:
                network.set_link(delay_ms, rate_mbit)
                before, relay_before = pull_totals(pd.decode.base_url), network.relay_stats()
                prompts = PHASE_PROMPTS[label]
                started = time.monotonic()
                for prompt in prompts[:2]:
                    assert_same(complete(pd.proxy_url, name, prompt), expected[prompt], label)
                with concurrent.futures.ThreadPoolExecutor(2) as pool:
                    answers = {p: pool.submit(complete, pd.proxy_url, name, p) for p in prompts[2:]}
                    for prompt, answer in answers.items():
                        assert_same(answer.result(), expected[prompt], f"{label}, concurrent")
                elapsed = time.monotonic() - started
                after, relay_after = pull_totals(pd.decode.base_url), network.relay_stats()
                pulls = after["pulls"] - before["pulls"]
                pulled = after["pulled_bytes"] - before["pulled_bytes"]
                relayed = relay_after["bytes_to_client"] - relay_before["bytes_to_client"]
                assert pulls == len(prompts), (label, before, after)
                # The KV came from the other host through the router, not over some shortcut.
                assert relayed >= pulled > 0, (label, relayed, pulled)
                report[label] = {
                    "delay_ms": delay_ms,
                    "rate_mbit": rate_mbit or 0.0,
                    "requests": len(prompts),
                    "mean_pull_ms": 1000 * (after["pull_seconds"] - before["pull_seconds"]) / pulls,
                    "mean_pulled_kib": pulled / pulls / 1024,
                    "mean_request_s": elapsed / len(prompts),
                    "relayed_kib": relayed / 1024,
                }
            assert_clean_transfers(pd, requests=len(ALL_PROMPTS))
            # Decode opened every connection across the link (the firewall table of
            # docs/deploy-several-hosts.md): nothing on the prefill host connected to the decode
            # host.
            destinations = network.relay_stats()["destinations"]
            assert destinations, "nothing crossed the link"
            assert all(not d.startswith(f"{network.decode.address}:") for d in destinations), (
                destinations
            )
            decode_log = pd.decode.log_path.read_text(errors="replace")
            assert "on the loopback address" not in decode_log
        finally:
            pd.stop()
    (tmp_path / "two_hosts_report.json").write_text(json.dumps(report, indent=2))
    for label, numbers in report.items():
        print(f"two hosts, {label}: " + ", ".join(f"{k}={v:.4g}" for k, v in numbers.items()))
