"""End to end: real `vllm serve` prefill and decode instances, the proxy, Mooncake over TCP.

Greedy, float32: tokens and top-5 logprobs through P/D must equal those of one colocated
instance, for prefill->decode TP 1->1, 2->1 (decode merges the KV heads of two prefill ranks) and
1->2 (each decode rank reads a head slice of the prefill rank). The model has 2 KV heads so both
the merge and the slice run. A negative control proves the decode really generates from the
transferred KV: fed another prompt's KV, it continues that other prompt, also when decode was
admitted before prefill ran (the proxy's overlapped legs: the block ids come with the lease).

Every check runs with ``kv_load_failure_policy=fail`` and demands zero failed pulls and zero
releases by timeout: a pull that failed and was recomputed would give the right answer without
moving a byte, and blocks freed at prefill's deadline would hide a lost read-done notice.
"""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator

import httpx
import pytest
from pd_checks import (
    MAX_TOKENS,
    TIMEOUT,
    assert_clean_transfers,
    assert_same,
    colocated_reference_fixtures,
    complete,
    hand_off,
    metric,
    summary,
    wait_for_metric,
)

from vllm_ascend_mooncake.handoff import prefill_address
from vllm_ascend_mooncake.launch.deployment import DeploymentSpec, LocalDeployment
from vllm_ascend_mooncake.launch.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.engine


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


def colocated_answers(url: str) -> dict:
    name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    return {
        "name": name,
        "prompts": {p: complete(url, name, p) for p in PROMPTS + PREFIX_PROMPTS},
        "chat": chat(url, name),
    }


# One colocated TP 1 instance, booting beside the first deployment: the answers P/D must
# reproduce.
colocated, reference = colocated_reference_fixtures(colocated_answers)


@pytest.fixture(
    scope="module", params=[(1, 1, True), (2, 1, False), (1, 2, False)], ids=["1-1", "2-1", "1-2"]
)
def deployment(request, model, colocated, tmp_path_factory) -> Iterator[LocalDeployment]:
    """One P/D deployment per TP pair (prefill TP, decode TP), shared by the tests of that pair
    (an engine start is ~25 s): each counts only its own pulls (``since``), and the negative
    control salts its decode requests, so no answer of it comes from the other test's cache.
    The first starts while the colocated instance boots. The 1 -> 1 pair runs its models in
    worker processes, as vLLM's CPU platform does by default; the suite's other TP 1 instances
    run theirs in the engine-core process, as vLLM does on GPU."""
    prefill_tp, decode_tp, worker_process = request.param
    log_dir = tmp_path_factory.mktemp(f"pd-{prefill_tp}-{decode_tp}")
    spec = DeploymentSpec(
        model=model,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        worker_process=worker_process,
        log_dir=str(log_dir),
    )
    with LocalDeployment(spec) as pd:
        yield pd


def test_pd_matches_colocated(deployment: LocalDeployment, reference) -> None:
    name = reference["name"]
    pd = deployment
    before = pd.transfer_totals()
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

    # Each of the 11 requests above pulled on every decode rank (the second prefix prompt
    # its tail only); nothing failed, nothing leaked, nothing timed out.
    assert_clean_transfers(pd, requests=11, since=before)


def test_negative_control_decode_uses_the_transferred_kv(
    deployment: LocalDeployment, reference
) -> None:
    """Decode gets prompt X with the KV of prompt Y (same length): it must continue Y.

    If the decode instance silently recomputed the prompt, it would answer X instead. Checked
    with serial legs (decode gets prefill's block ids) and overlapped ones (decode is admitted
    first and learns the block ids from prefill's read lease once prefill is done).
    """
    name = reference["name"]
    pd = deployment
    before = pd.transfer_totals()
    x = httpx.post(
        f"{pd.prefill.base_url}/tokenize", json={"model": name, "prompt": PROMPTS[2]}
    ).json()["tokens"]
    y = list(x)
    y[4] = 3 + (y[4] + 1) % 400  # one early token differs; same length
    colocated_x = complete(pd.prefill.base_url, name, x)
    colocated_y = complete(pd.prefill.base_url, name, y)

    def serial(attempt: int) -> dict:
        params = hand_off(pd.prefill.base_url, name, y)  # Y's KV held for a decode
        address.update(prefill_address(params))
        return complete(
            pd.decode.base_url,
            name,
            x,
            kv_transfer_params=params,
            cache_salt=f"serial-{attempt}",  # never served from a recomputed X
        )

    def overlapped(attempt: int) -> dict:
        transfer_id = f"negative-control-{attempt}"
        waiting_before = metric(pd.decode.base_url, "vllm:num_requests_waiting")
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
            # decode admits the request, which waits for its KV, before prefill ever sees it
            wait_for_metric(
                pd.decode.base_url,
                "vllm:num_requests_waiting",
                waiting_before + 1,
                "decode never admitted the overlapped request",
            )
            hand_off(pd.prefill.base_url, name, y, transfer_id, cache_salt=f"overlapped-{attempt}")
            return decoding.result()

    address: dict = {}
    outputs = {kind: run(0) for kind, run in (("serial", serial), ("overlapped", overlapped))}
    assert_clean_transfers(pd, requests=2, since=before)
    for kind, decoded in outputs.items():
        assert len(decoded["choices"][0]["token_ids"]) == MAX_TOKENS, kind
        assert summary(decoded)[0] != summary(colocated_x)[0], kind
        assert summary(decoded)[0] == summary(colocated_y)[0], kind
