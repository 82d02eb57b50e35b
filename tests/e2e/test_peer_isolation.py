"""End to end: one decode, three prefills; one is killed and one frozen, the third must not notice.

Issue #27 item 2: decode's pools (planning, claims, reads, read-done notices) are shared by every
prefill it reads. Requests naming a killed prefill (its port closed) and more requests than decode
has planning threads naming a frozen one (SIGSTOP: its ports accept, nothing answers) are sent to
decode at once, then requests read from the healthy prefill one after another. Each healthy
request must answer right (float32: equal to decode's colocated answer) with a successful pull,
and all of them must be done before the first request naming the frozen prefill gives up: a
shared pool blocked by the frozen peer would hold them behind its side-channel timeouts. This
compares orderings, not durations, so a stalled test machine cannot fail it. The other requests
end with an error (decode's policy is ``fail``), decode stays up, and once thawed the frozen
prefill frees its blocks by timeout; the healthy one frees every block by read-done notices.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx
import pytest
from pd_checks import (
    RELEASE_BOUND_S,
    TIMEOUT,
    assert_exact_ids,
    assert_extra_prefill_clean,
    complete_ids,
    hand_off,
    metric,
    settled_totals,
)

from vam_testing.answers import prompt_ids
from vam_testing.waiting import wait_until
from vllm_ascend_mooncake.launch.deployment import DeploymentSpec, LocalDeployment
from vllm_ascend_mooncake.launch.ports import free_port_range
from vllm_ascend_mooncake.launch.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.engine

SIDE_CHANNEL_TIMEOUT_S = 10.0  # the default: a request behind the frozen peer would wait this
RELEASE_TIMEOUT_S = 20.0
#: more than decode's planning threads (receiver_threads, 4 by default)
FROZEN_REQUESTS = 6
KILLED_REQUESTS = 3
HEALTHY_REQUESTS = 6
TEXT = " ".join(f"isolated{i} prefill peers" for i in range(40))


def decode_with(url: str, name: str, prompt: list[int], params: dict, salt: str) -> tuple:
    """Decode's answer to ``prompt`` reading ``params``' KV: (status, body, when it ended)."""
    body = {
        "model": name,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "kv_transfer_params": params,
        "cache_salt": salt,
    }
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)
    return response.status_code, response.text, time.monotonic()


def test_a_killed_and_a_frozen_prefill_cost_a_healthy_one_nothing(tmp_path) -> None:
    model = str(build_tiny_model(TinyModelSpec(num_kv_heads=2, dtype="float32")))
    spec = DeploymentSpec(
        model=model,
        prefill_tp=1,
        decode_tp=1,
        release_timeout_s=RELEASE_TIMEOUT_S,
        extra_connector_config={"side_channel_timeout_s": SIDE_CHANNEL_TIMEOUT_S},
        log_dir=str(tmp_path),
    )
    pd = LocalDeployment(spec)
    extra = {
        role: pd.add_server("kv_producer", name=role, side_channel_port=free_port_range(1))
        for role in ("killed", "frozen")
    }
    frozen = False
    with pd:
        try:
            decode, healthy = pd.decode.base_url, pd.prefill.base_url
            name = httpx.get(f"{decode}/v1/models", timeout=60).json()["data"][0]["id"]
            text = prompt_ids(decode, name, TEXT)
            prompts = [text[: 40 + 7 * i] for i in range(HEALTHY_REQUESTS)]
            reference = {
                tuple(p): complete_ids(decode, name, p, cache_salt="colocated") for p in prompts
            }
            # KV held on the two prefills before they fail
            doomed = [
                (role, hand_off(extra[role].base_url, name, text[:50], cache_salt=f"{role}{i}"))
                for role, count in (("killed", KILLED_REQUESTS), ("frozen", FROZEN_REQUESTS))
                for i in range(count)
            ]
            before = settled_totals(pd)
            kinds_before = pd.failed_pulls_by_kind()
            os.killpg(extra["killed"].pid, signal.SIGKILL)
            os.killpg(extra["frozen"].pid, signal.SIGSTOP)
            frozen = True

            with concurrent.futures.ThreadPoolExecutor(len(doomed)) as pool:
                pending = {
                    pool.submit(decode_with, decode, name, text[:50], params, f"d{i}"): role
                    for i, (role, params) in enumerate(doomed)
                }
                time.sleep(1.0)  # every doomed request is in decode's pools
                healthy_done = []
                for i, prompt in enumerate(prompts):
                    params = hand_off(healthy, name, prompt, cache_salt=f"healthy{i}")
                    got = complete_ids(
                        decode, name, prompt, kv_transfer_params=params, cache_salt=f"healthy{i}"
                    )
                    assert_exact_ids(got, reference[tuple(prompt)], f"healthy request {i}")
                    healthy_done.append(time.monotonic())
                outcomes = {role: [] for role in extra}
                for future in concurrent.futures.as_completed(pending):
                    outcomes[pending[future]].append(future.result())

            frozen_ended = min(ended for _, _, ended in outcomes["frozen"])
            assert max(healthy_done) < frozen_ended, (
                "healthy requests waited behind the frozen prefill's requests"
            )
            for role, results in outcomes.items():
                for status, body, _ in results:
                    assert status != 200, f"a request reading the {role} prefill answered: {body}"
            assert httpx.get(f"{decode}/health", timeout=30).status_code == 200

            os.killpg(extra["frozen"].pid, signal.SIGCONT)
            frozen = False
            totals = settled_totals(pd)
            assert totals["failed"] - before["failed"] == len(doomed), totals
            kinds = pd.failed_pulls_by_kind()
            new_kinds = {k: n - kinds_before.get(k, 0) for k, n in kinds.items()}
            # a dead and a frozen prefill both leave their claims unanswered
            assert {k: n for k, n in new_kinds.items() if n} == {"peer_unavailable": len(doomed)}, (
                kinds
            )
            assert totals["successful"] - before["successful"] == HEALTHY_REQUESTS, totals
            assert totals["expired"] == 0, totals  # the healthy prefill freed by read-done
            assert_extra_prefill_clean(healthy, "the healthy prefill")
            assert metric(decode, "vllm:kv_cache_usage_perc") == 0
            wait_until(
                lambda: metric(extra["frozen"].base_url, "vllm:kv_cache_usage_perc") <= 0,
                "the thawed prefill frees every KV block (by its release timeout)",
                timeout_s=RELEASE_TIMEOUT_S + RELEASE_BOUND_S,
                interval_s=0.5,
            )
        finally:
            if frozen:
                os.killpg(extra["frozen"].pid, signal.SIGCONT)
