"""Clients that hang up mid-request leave nothing held (issue #43, "Also seen"): 240 mixed
requests at concurrency 16 through ``vam-proxy``, some of whose clients leave while their answer
streams or before it comes. Before the proxy told prefill to drop what a departed client's
request held (``DropHold``), prefill kept one or two blocks until its ``release_timeout_s``.

Every request whose client stayed is answered in full, its text equal to decode's own colocated
answer (float32, TP 1 -> 1: greedy text is equal); both engines stay alive; every block comes
back well before the release timeout, none by it; no pull fails.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import random

import httpx
from pd_checks import RELEASE_BOUND_S, TIMEOUT, assert_clean_transfers, metric

from vllm_ascend_mooncake.launch.deployment import DeploymentSpec, LocalDeployment
from vllm_ascend_mooncake.launch.tiny_model import TinyModelSpec, build_tiny_model

REQUESTS = 240
CONCURRENCY = 16
#: far above how long any block may stay held here (RELEASE_BOUND_S): a block freed only by
#: this timeout is a hold nobody released
RELEASE_TIMEOUT_S = 4 * RELEASE_BOUND_S


def requests(seed: int = 43) -> list[dict]:
    """The mix: prompts of 5-120 words, 4-24 tokens, a third streamed; one in forty clients
    leaves (after its first streamed event, or 0.3 s into a whole answer)."""
    rng = random.Random(seed)
    mix = []
    for index in range(REQUESTS):
        words = rng.randint(5, 120)
        mix.append(
            {
                "prompt": " ".join(f"r{index} w{rng.randint(0, 999)}" for _ in range(words)),
                "max_tokens": rng.randint(4, 24),
                "stream": rng.random() < 1 / 3,
                "leaves": index % 40 == 7,
            }
        )
    return mix


def body(model: str, request: dict, **extra) -> dict:
    return {
        "model": model,
        "prompt": request["prompt"],
        "max_tokens": request["max_tokens"],
        "temperature": 0,
        "ignore_eos": True,
        "stream": request["stream"],
        **extra,
    }


def text_of(response: httpx.Response, streamed: bool) -> str:
    """The completion's text, from its JSON or its SSE events."""
    if not streamed:
        return response.json()["choices"][0]["text"]
    pieces = []
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            pieces += [choice["text"] for choice in event["choices"]]
    return "".join(pieces)


def send(url: str, model: str, request: dict, **extra) -> str | None:
    """The answer's text; None for a client that leaves."""
    with httpx.Client(timeout=TIMEOUT) as client:
        if not request["leaves"]:
            response = client.post(f"{url}/v1/completions", json=body(model, request, **extra))
            assert response.status_code == 200, response.text[:500]
            return text_of(response, request["stream"])
        if request["stream"]:
            with client.stream("POST", f"{url}/v1/completions", json=body(model, request)) as r:
                next(r.iter_bytes())  # the first event, then the client is gone
            return None
        with contextlib.suppress(httpx.TimeoutException):  # no answer within 0.3 s: gone
            client.post(f"{url}/v1/completions", json=body(model, request), timeout=0.3)
        return None


def test_clients_that_hang_up_leave_no_block_held(tmp_path) -> None:
    model = str(build_tiny_model(TinyModelSpec(num_kv_heads=2)))
    spec = DeploymentSpec(
        model,
        prefill_tp=1,
        decode_tp=1,
        block_size=32,
        max_model_len=1024,
        release_timeout_s=RELEASE_TIMEOUT_S,
        log_dir=str(tmp_path),
    )
    mix = requests()
    staying = [request for request in mix if not request["leaves"]]
    with LocalDeployment(spec) as pd:
        name = httpx.get(f"{pd.decode.base_url}/v1/models").json()["data"][0]["id"]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            colocated = list(
                pool.map(
                    lambda r: send(
                        pd.decode.base_url, name, {**r, "stream": False}, cache_salt="colo"
                    ),
                    staying,
                )
            )
        before = pd.transfer_totals()

        with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
            texts = list(pool.map(lambda request: send(pd.proxy_url, name, request), mix))

        answered = [text for text, request in zip(texts, mix, strict=True) if not request["leaves"]]
        assert answered == colocated
        # every request was pulled once (a leaving client's pull may be cut short: cancelled,
        # not failed), no pull failed, nothing expired, every block back within the bound
        assert_clean_transfers(pd, len(staying), since=before, left=len(mix) - len(staying))
        assert metric(pd.prefill.base_url, "vllm:kv_cache_usage_perc") == 0
