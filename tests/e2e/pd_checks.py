"""Checks shared by the end-to-end tests: requests, answer comparison, clean-transfer checks.

A P/D answer is compared token for token, top-5 logprobs within ``LOGPROB_TOLERANCE``, against a
colocated instance (float32 models). A deployment is clean when both engines are alive, every
request pulled once on every decode rank and succeeded (a failed pull recomputed by decode would
give the right answer without moving a byte), and every block was freed by a read-done notice
well before prefill's release timeout (a release by timeout would hide a lost notice).
"""

from __future__ import annotations

import re
import time

import httpx

from vllm_ascend_mooncake.launch.deployment import LocalDeployment

MAX_TOKENS = 12
LOGPROB_TOLERANCE = 1e-4
TIMEOUT = httpx.Timeout(600.0)
# Blocks are freed by decode's read-done notices within moments; far below release_timeout_s.
RELEASE_BOUND_S = 30.0


def complete(url: str, model_name: str, prompt: str | list[int], **extra) -> dict:
    body = {
        "model": model_name,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 5,
        "return_token_ids": True,
        **extra,
    }
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    return response.json()


def complete_like_vllm_example_proxy(
    prefill_url: str, decode_url: str, model_name: str, prompt: str | list[int], **extra
) -> dict:
    """What vLLM's example disaggregation proxy does, and nothing more: a one-token prefill asking
    to hand off, then decode with prefill's ``kv_transfer_params`` copied verbatim."""
    handoff = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    prefilled = complete(
        prefill_url, model_name, prompt, **{**extra, "max_tokens": 1, "kv_transfer_params": handoff}
    )
    return complete(
        decode_url,
        model_name,
        prompt,
        **extra,
        kv_transfer_params=prefilled["kv_transfer_params"],
    )


def summary(result: dict) -> tuple[list[int], list[dict[str, float]]]:
    choice = result["choices"][0]
    return choice["token_ids"], choice["logprobs"]["top_logprobs"]


def _deviations(top: list[dict[str, float]], ref_top: list[dict[str, float]]) -> list[str]:
    """Per position, the largest |logprob - colocated| over the colocated top-5 (for messages)."""
    return [
        f"{max(abs(got.get(t, float('inf')) - v) for t, v in want.items()):.1e}"
        for got, want in zip(top, ref_top, strict=True)
    ]


def assert_same(actual: dict, expected: dict, what: str) -> None:
    tokens, top = summary(actual)
    ref_tokens, ref_top = summary(expected)
    assert tokens == ref_tokens, f"{what}: tokens {tokens} != colocated {ref_tokens}"
    for position, (got, want) in enumerate(zip(top, ref_top, strict=True)):
        assert got.keys() == want.keys(), f"{what}: top-5 differ at position {position}"
        for token, logprob in want.items():
            assert abs(got[token] - logprob) <= LOGPROB_TOLERANCE, (
                what,
                position,
                token,
                f"logprob {got[token]!r} vs colocated {logprob!r}",
                f"largest deviation per position: {_deviations(top, ref_top)}",
            )


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values = [float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    assert values, f"{name} not exported by {url}"
    return sum(values)


def settled_totals(pd: LocalDeployment) -> dict[str, int]:
    """The deployment's transfer counters once the last engine step's statistics are in: the API
    server records them just after that step's outputs, which a client may already hold."""
    time.sleep(1)
    return pd.transfer_totals()


def assert_clean_transfers(pd: LocalDeployment, requests: int) -> None:
    """Both engines alive; every request pulled exactly once on every decode rank and no pull
    failed; every block freed by a read-done notice well before prefill's release timeout,
    none by that timeout."""
    for server in (pd.prefill, pd.decode):
        assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200
    for server in (pd.prefill, pd.decode):
        deadline = time.monotonic() + RELEASE_BOUND_S
        while metric(server.base_url, "vllm:kv_cache_usage_perc") > 0:
            assert time.monotonic() < deadline, f"{server.base_url} still holds KV blocks"
            time.sleep(0.5)
    totals = settled_totals(pd)
    logs = f"see {pd.log_dir}"
    assert totals["failed"] == 0, (totals, logs)
    assert totals["expired"] == 0, (totals, logs)
    assert totals["successful"] == requests * pd.spec.decode_tp, (totals, logs)


def assert_extra_prefill_clean(url: str, what: str) -> None:
    """A prefill instance beside the deployment's own (which :func:`assert_clean_transfers`
    checks): alive, every block freed within the bound, none released by its timeout."""
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200, what
    deadline = time.monotonic() + RELEASE_BOUND_S
    while metric(url, "vllm:kv_cache_usage_perc") > 0:
        assert time.monotonic() < deadline, f"{what} still holds KV blocks"
        time.sleep(0.5)
    text = httpx.get(f"{url}/metrics", timeout=30).text
    expired = re.findall(r"^vllm:mooncake_hetero_expired_releases_total\S* (\S+)$", text, re.M)
    assert sum(float(v) for v in expired) == 0, f"{what} released blocks by timeout"
