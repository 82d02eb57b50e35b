"""End to end: real `vllm serve` prefill and decode instances, the proxy, Mooncake over TCP.

Greedy, float32: tokens and top-5 logprobs through P/D must equal those of one colocated
instance, for prefill->decode TP 1->1, 2->1 (decode merges the KV heads of two prefill ranks) and
1->2 (each decode rank reads a head slice of the prefill rank). The model has 2 KV heads so both
the merge and the slice run. A negative control proves the decode really generates from the
transferred KV: fed another prompt's KV, it continues that other prompt, also when decode was
admitted before prefill ran (the proxy's overlapped legs: the block ids come with the lease).
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import time
import warnings

import httpx
import pytest

from vllm_ascend_mooncake.launch.deployment import DeploymentSpec, LocalDeployment
from vllm_ascend_mooncake.launch.servers import VllmServer
from vllm_ascend_mooncake.proxy.payloads import prefill_address
from vllm_ascend_mooncake.testing.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.engine

MAX_TOKENS = 12
LOGPROB_TOLERANCE = 1e-4
TIMEOUT = httpx.Timeout(600.0)

PROMPTS = [
    "hello world",
    "A disaggregated deployment runs the prompt on one instance and the decoding on another",
    " ".join(f"word{i} the quick brown fox" for i in range(20)),  # several KV blocks
]
SHARED_PREFIX = " ".join(f"shared{i} prefix text" for i in range(24))
PREFIX_PROMPTS = [SHARED_PREFIX + " first ending", SHARED_PREFIX + " a different second ending"]
CHAT = [{"role": "user", "content": "Tell me about KV caches and tensor parallelism."}]


@pytest.fixture(scope="module")
def model() -> str:
    return str(build_tiny_model(TinyModelSpec(num_kv_heads=2, dtype="float32")))


def complete(url: str, model_name: str, prompt: str, **extra) -> dict:
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


def chat(url: str, model_name: str) -> str:
    body = {"model": model_name, "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def stream_text(url: str, model_name: str, prompt: str) -> str:
    body = {
        "model": model_name,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    text = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


def summary(result: dict) -> tuple[list[int], list[dict[str, float]]]:
    choice = result["choices"][0]
    return choice["token_ids"], choice["logprobs"]["top_logprobs"]


def assert_same(actual: dict, expected: dict, what: str) -> None:
    tokens, top = summary(actual)
    ref_tokens, ref_top = summary(expected)
    assert tokens == ref_tokens, f"{what}: tokens {tokens} != colocated {ref_tokens}"
    for position, (got, want) in enumerate(zip(top, ref_top, strict=True)):
        assert got.keys() == want.keys(), f"{what}: top-5 differ at position {position}"
        for token, logprob in want.items():
            assert abs(got[token] - logprob) <= LOGPROB_TOLERANCE, (what, position, token)


@pytest.fixture(scope="module")
def reference(model: str) -> dict:
    """One colocated TP=1 instance: the answers P/D must reproduce."""
    with VllmServer(model) as server:
        name = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
        return {
            "name": name,
            "prompts": {p: complete(server.base_url, name, p) for p in PROMPTS + PREFIX_PROMPTS},
            "chat": chat(server.base_url, name),
        }


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values = [float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    assert values, f"{name} not exported by {url}"
    return sum(values)


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 1), (2, 1), (1, 2)])
def test_pd_matches_colocated(model, reference, prefill_tp, decode_tp, tmp_path) -> None:
    spec = DeploymentSpec(
        model=model,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        log_dir=str(tmp_path),
        decode_failure_policy="recompute",
    )
    name = reference["name"]
    with LocalDeployment(spec) as pd:
        url = pd.proxy_url
        for prompt in PROMPTS:
            assert_same(complete(url, name, prompt), reference["prompts"][prompt], prompt[:30])

        # Streaming and chat through the proxy.
        ref_text = reference["prompts"][PROMPTS[1]]["choices"][0]["text"]
        assert stream_text(url, name, PROMPTS[1]) == ref_text
        assert chat(url, name) == reference["chat"]

        # A second request sharing a long prefix: decode serves the prefix from its own cache and
        # pulls only the rest.
        hits_before = metric(pd.decode.base_url, "vllm:prefix_cache_hits_total")
        for prompt in PREFIX_PROMPTS:
            assert_same(complete(url, name, prompt), reference["prompts"][prompt], "prefix")
        assert metric(pd.decode.base_url, "vllm:prefix_cache_hits_total") > hits_before

        # Several requests at once.
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = {
                pool.submit(complete, url, name, p, cache_salt=f"c{i}"): p
                for i, p in enumerate(PROMPTS + PREFIX_PROMPTS[:1])
            }
            for future, prompt in futures.items():
                assert_same(future.result(), reference["prompts"][prompt], "concurrent")

        # Nothing leaks: every held prefill block is released, normally as soon as decode says it
        # read them, at the latest at the prefill's release deadline when those notices were lost
        # (this VM has been measured freezing for up to ~40 s under load; see docs/deployment.md).
        deadline = time.monotonic() + spec.release_timeout_s + 30
        while metric(pd.prefill.base_url, "vllm:kv_cache_usage_perc") > 0:
            assert time.monotonic() < deadline, "prefill still holds KV blocks"
            time.sleep(0.5)
        totals = pd.transfer_totals()
        assert totals["successful"] >= len(PROMPTS), totals
        if totals["failed"]:
            # A pull whose side-channel exchange or read timed out while this VM stalled (see
            # docs/deployment.md) is recomputed by decode, and the outputs above still had to
            # match. More than one such failure in a run is not a hiccup.
            warnings.warn(f"{totals['failed']} pull(s) failed and were recomputed", stacklevel=1)


def test_negative_control_decode_uses_the_transferred_kv(model, reference, tmp_path) -> None:
    """Decode gets prompt X with the KV of prompt Y (same length): it must continue Y.

    If the decode instance silently recomputed the prompt, it would answer X instead. Checked
    with serial legs (decode gets prefill's block ids) and overlapped ones (decode is admitted
    first and learns the block ids from prefill's read lease once prefill is done).
    """
    name = reference["name"]
    spec = DeploymentSpec(
        model=model,
        prefill_tp=2,
        decode_tp=1,
        log_dir=str(tmp_path),
        decode_failure_policy="recompute",
    )
    with LocalDeployment(spec) as pd:
        x = httpx.post(
            f"{pd.prefill.base_url}/tokenize", json={"model": name, "prompt": PROMPTS[2]}
        ).json()["tokens"]
        y = list(x)
        y[4] = 3 + (y[4] + 1) % 400  # one early token differs; same length
        colocated_x = complete(pd.prefill.base_url, name, x)
        colocated_y = complete(pd.prefill.base_url, name, y)

        def prefill_y(kv_transfer_params: dict, **extra) -> dict:
            """Prompt Y's one-token prefill, holding its KV for a decode."""
            response = httpx.post(
                f"{pd.prefill.base_url}/v1/completions",
                json={
                    "model": name,
                    "prompt": y,
                    "max_tokens": 1,
                    "temperature": 0,
                    "kv_transfer_params": {"do_remote_decode": True, **kv_transfer_params},
                    **extra,
                },
                timeout=TIMEOUT,
            )
            assert response.status_code == 200, response.text
            return response.json()

        def serial(attempt: int) -> dict:
            prefill = prefill_y({})
            address.update(prefill_address(prefill["kv_transfer_params"]))
            return complete(
                pd.decode.base_url,
                name,
                x,
                kv_transfer_params=prefill["kv_transfer_params"],
                cache_salt=f"serial-{attempt}",  # never served from a recomputed X
            )

        def overlapped(attempt: int) -> dict:
            transfer_id = f"negative-control-{attempt}"
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                decoding = pool.submit(
                    complete,
                    pd.decode.base_url,
                    name,
                    x,
                    kv_transfer_params={
                        "do_remote_prefill": True,
                        "remote_request_id": transfer_id,
                        **address,
                    },
                    cache_salt=f"overlapped-{attempt}",
                )
                time.sleep(1.0)  # decode admits the request and waits for the prefill
                prefill_y({"transfer_id": transfer_id}, cache_salt=f"overlapped-{attempt}")
                return decoding.result()

        address: dict = {}
        outputs = {}
        for kind, run in (("serial", serial), ("overlapped", overlapped)):
            for attempt in range(3):
                failed_before = pd.transfer_totals()["failed"]
                outputs[kind] = run(attempt)
                time.sleep(2)  # metrics are logged every second
                if pd.transfer_totals()["failed"] == failed_before:
                    break
                # The pull timed out while the VM stalled and decode recomputed X: try again.
            else:
                pytest.fail(f"every {kind} pull of the negative control failed")
    for kind, decoded in outputs.items():
        assert len(decoded["choices"][0]["token_ids"]) == MAX_TOKENS, kind
        assert summary(decoded)[0] != summary(colocated_x)[0], kind
        assert summary(decoded)[0] == summary(colocated_y)[0], kind
