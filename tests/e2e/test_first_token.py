"""End to end: the client's first token from prefill, decode continuing from it.

Real `vllm serve` engines (prefill TP 2, decode TP 1: decode merges two prefill ranks' heads) and
two proxies in front of them: the default one (overlapped legs where a request keeps decode's
first token) and one with ``--serial-legs``. Each request's answer through a proxy must equal one
colocated instance's, float32, token for token with top logprobs within ``LOGPROB_TOLERANCE``:
completions and chat, streamed and not, greedy (decode continues from prefill's token) and seeded
(it keeps decode's first token, see proxy/continuable.py), with logprobs, token ids and usage.
Unseeded sampling cannot be compared with another instance; instead every token's logprob in the
answer must be what colocated gives that token after the same prefix (the prompt and the tokens
the client saw before it), which a decode that continued from any other first token fails.

Answers that end at the first token never reach decode and leave no block held: one-token
answers, and a first token that is a stop token. Every pull succeeded, none expired, both
engines are alive and hold no block afterwards.
"""

from __future__ import annotations

import hashlib
import json

import httpx
import pytest
from pd_checks import (
    LOGPROB_TOLERANCE,
    TIMEOUT,
    assert_clean_transfers,
    colocated_reference_fixtures,
    metric,
    settled_totals,
)

from vam_testing.answers import prompt_ids
from vllm_ascend_mooncake.launch.deployment import DeploymentSpec, LocalDeployment
from vllm_ascend_mooncake.launch.tiny_model import TinyModelSpec, build_tiny_model

#: The proxy's count of first tokens decode sampled again, by reason; a first token that is part
#: of a character is one (proxy/formats/token_texts.py).
DECODE_FIRST_TOKENS = "vam_proxy_decode_first_tokens_total"
PARTIAL_CHARACTER = {"reason": "partial character"}
#: sampled requests sent at most until one continues prefill's first token
SAMPLED_ATTEMPTS = 12

pytestmark = pytest.mark.engine

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MAX_TOKENS = 10
PROMPTS = [
    "A disaggregated deployment runs the prompt on one instance and the decoding on another",
    " ".join(f"word{i} the quick brown fox" for i in range(20)),  # several KV blocks
    "hello world",
]
#: (name, extra request parameters): greedy continues from prefill's token; seeded keeps
#: decode's (vLLM's V1 sampler draws from one generator per request)
SAMPLING = {"greedy": {"temperature": 0}, "seeded": {"temperature": 1.0, "seed": 11}}


def salt(*parts: str) -> str:
    """A ``cache_salt`` of its own per request (vLLM allows no '/' in one): no prefix cache hit
    joins two compared requests."""
    return hashlib.sha256(" ".join(parts).encode()).hexdigest()[:32]


def body(name: str, path: str, prompt: str, **extra) -> dict:
    if path == CHAT:
        request = {"messages": [{"role": "user", "content": prompt}], "logprobs": True}
        request["top_logprobs"] = 3
    else:
        request = {"prompt": prompt, "logprobs": 3}
    return {
        "model": name,
        **request,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


def ask(url: str, path: str, request: dict) -> dict:
    """The answer as a client assembles it: text, token ids, per-token logprobs (top ones as
    {token: logprob}), finish reason and usage, from a whole or a streamed response."""
    if not request.get("stream"):
        response = httpx.post(f"{url}{path}", json=request, timeout=TIMEOUT)
        assert response.status_code == 200, response.text
        answer = response.json()
        choice = answer["choices"][0]
        text = choice["message"]["content"] if path == CHAT else choice["text"]
        return _assembled(path, [choice], text, answer.get("usage"), choice["finish_reason"])
    choices, text, usage, finish = [], "", None, None
    with httpx.stream("POST", f"{url}{path}", json=request, timeout=TIMEOUT) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            assert "error" not in chunk, chunk
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                choices.append(choice)
                text += (choice["delta"].get("content") or "") if path == CHAT else choice["text"]
                finish = choice.get("finish_reason") or finish
    return _assembled(path, choices, text, usage, finish)


def _assembled(path: str, choices: list[dict], text: str, usage, finish) -> dict:
    token_ids, logprobs = [], []
    for choice in choices:
        token_ids += choice.get("token_ids") or []
        entries = choice.get("logprobs") or {}
        if path == CHAT:
            logprobs += [
                {top["token"]: top["logprob"] for top in entry["top_logprobs"]}
                for entry in entries.get("content") or []
            ]
        else:
            logprobs += entries.get("top_logprobs") or []
    if usage is not None:
        usage = {key: usage[key] for key in ("prompt_tokens", "completion_tokens")}
    return {"text": text, "ids": token_ids, "top": logprobs, "usage": usage, "finish": finish}


def assert_same(got: dict, want: dict, what: str) -> None:
    assert got["ids"] == want["ids"], f"{what}: tokens {got['ids']} != colocated {want['ids']}"
    assert got["text"] == want["text"], what
    assert (got["finish"], got["usage"]) == (want["finish"], want["usage"]), what
    assert len(got["top"]) == len(want["top"]), what
    for position, (mine, theirs) in enumerate(zip(got["top"], want["top"], strict=True)):
        assert mine.keys() == theirs.keys(), f"{what}: top logprobs differ at {position}"
        for token, logprob in theirs.items():
            assert abs(mine[token] - logprob) <= LOGPROB_TOLERANCE, (what, position, token)


CASES = [
    (path, stream, sampling)
    for path in (COMPLETIONS, CHAT)
    for stream in (False, True)
    for sampling in SAMPLING
]


def case_requests(name: str) -> list[tuple[str, str, dict]]:
    """(label, path, request) of every compared request."""
    requests = []
    for path, stream, sampling in CASES:
        for index, prompt in enumerate(PROMPTS):
            extra = dict(SAMPLING[sampling], stream=stream)
            if stream:
                extra["stream_options"] = {"include_usage": True}
            label = f"{path} {'streamed' if stream else 'whole'} {sampling} prompt {index}"
            requests.append((label, path, body(name, path, prompt, **extra)))
    return requests


@pytest.fixture(scope="module")
def model() -> str:
    return str(build_tiny_model(TinyModelSpec(num_kv_heads=2, dtype="float32")))


def colocated_answers(url: str) -> dict:
    name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    answers = {
        label: ask(url, path, {**request, "cache_salt": salt(label)})
        for label, path, request in case_requests(name)
    }
    return {"name": name, "answers": answers}


# A colocated TP 1 instance, booting beside the deployment, and every compared request's answer
# there (fresh cache per request).
colocated, reference = colocated_reference_fixtures(colocated_answers)


@pytest.fixture(scope="module")
def deployment(model: str, colocated, tmp_path_factory):
    spec = DeploymentSpec(
        model=model, prefill_tp=2, decode_tp=1, log_dir=str(tmp_path_factory.mktemp("first"))
    )
    with LocalDeployment(spec) as pd:
        yield pd, pd.add_proxy("--serial-legs")


def test_answers_equal_colocated_through_both_proxies(deployment, reference) -> None:
    pd, serial_url = deployment
    name = reference["name"]
    pulls = settled_pulls(pd)
    for url in (pd.proxy_url, serial_url):
        for label, path, request in case_requests(name):
            got = ask(url, path, {**request, "cache_salt": salt(url, label)})
            assert_same(got, reference["answers"][label], f"{url}: {label}")
            pulls += 1
        # Greedy requests continued from prefill's token, unless it was part of a character
        # (proxy/formats/token_texts.py); seeded ones kept decode's.
        continued = metric(url, "vam_proxy_requests_total", {"legs": "continued"})
        partial = metric(
            url, "vam_proxy_decode_first_tokens_total", {"reason": "partial character"}
        )
        seeded = metric(url, DECODE_FIRST_TOKENS, {"reason": "seed"})
        assert seeded == len(CASES) // 2 * len(PROMPTS)
        assert continued + partial == len(CASES) // 2 * len(PROMPTS)
        assert continued > 0
    assert_clean_transfers(pd, requests=pulls)


def test_sampled_answers_continue_the_token_the_client_saw(deployment, reference) -> None:
    """Unseeded sampling: each token's logprob in the answer equals colocated's logprob of that
    token after the prompt and the answer's earlier tokens (prompt logprobs of one colocated
    pass over them): decode continued from exactly the first token the client got.

    A sampled first token that is part of a character keeps decode's instead
    (proxy/formats/token_texts.py), and this byte-level tokenizer samples one often (both of two
    first tokens were, once): requests are sent until one continued, each checked the same way."""
    pd, _ = deployment
    name = reference["name"]
    pulls_before = settled_pulls(pd)
    continued_before = metric(pd.proxy_url, "vam_proxy_requests_total", {"legs": "continued"})
    partial_before = metric(pd.proxy_url, DECODE_FIRST_TOKENS, PARTIAL_CHARACTER)

    def continued() -> float:
        return (
            metric(pd.proxy_url, "vam_proxy_requests_total", {"legs": "continued"})
            - continued_before
        )

    answers = []
    for attempt in range(SAMPLED_ATTEMPTS):
        prompt = PROMPTS[attempt % 2]
        request = body(name, COMPLETIONS, prompt, temperature=1.0, logprobs=0, stream=True)
        request["cache_salt"] = f"sampled {attempt}"
        answers.append((prompt, ask(pd.proxy_url, COMPLETIONS, request)))
        if len(answers) >= 2 and continued() >= 1:
            break
    for prompt, answer in answers:
        ids = prompt_ids(pd.prefill.base_url, name, prompt)
        scoring = {
            "model": name,
            "prompt": ids + answer["ids"],
            "max_tokens": 1,
            "prompt_logprobs": 0,
            "cache_salt": "scoring",
        }
        response = httpx.post(f"{pd.prefill.base_url}{COMPLETIONS}", json=scoring, timeout=TIMEOUT)
        scored = response.json()["choices"][0]["prompt_logprobs"][len(ids) :]
        for position, (token, top) in enumerate(zip(answer["ids"], answer["top"], strict=True)):
            (logprob,) = top.values()
            colocated = scored[position][str(token)]["logprob"]
            assert abs(logprob - colocated) <= LOGPROB_TOLERANCE, (prompt[:20], position)
    partial = metric(pd.proxy_url, DECODE_FIRST_TOKENS, PARTIAL_CHARACTER) - partial_before
    # every request continued or kept decode's first token, and at least one continued
    assert continued() + partial == len(answers), (continued(), partial, len(answers))
    assert continued() >= 1, f"all {len(answers)} sampled first tokens were partial characters"
    assert_clean_transfers(pd, requests=pulls_before + len(answers))


def settled_pulls(pd: LocalDeployment) -> int:
    """Successful pulls so far (the deployment is shared by this module's tests)."""
    return settled_totals(pd)["successful"] // pd.spec.decode_tp


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_answers_that_end_at_their_first_token_never_reach_decode(
    deployment, reference, path: str, stream: bool
) -> None:
    """A one-token answer, and one whose first token is a stop token: prefill's answer is the
    client's, decode is never asked and prefill keeps no block for it."""
    pd, _ = deployment
    name = reference["name"]
    pulls_before = settled_pulls(pd)
    decode_requests = metric(pd.decode.base_url, "vllm:request_success_total")
    one = body(name, path, PROMPTS[0], temperature=0, max_tokens=1, stream=stream)
    first_token = ask(pd.prefill.base_url, path, {**one, "stream": False})["ids"][0]
    stopped = body(name, path, PROMPTS[0], temperature=0, stream=stream)
    del stopped["ignore_eos"]
    stopped["stop_token_ids"] = [first_token]
    for request in (one, stopped):
        got = ask(pd.proxy_url, path, request)
        want = ask(pd.prefill.base_url, path, request)  # without hand-off: a colocated answer
        assert_same(got, want, f"{path} {request}")
        assert len(got["ids"]) == 1
    assert metric(pd.decode.base_url, "vllm:request_success_total") == decode_requests
    assert_clean_transfers(pd, requests=pulls_before)
