"""Asking a served model for the answers end-to-end tests and benchmarks compare: greedy, top-5
logprobs keyed by token id (token text is ambiguous: many ids decode to the same replacement
character), so that two instances' answers compare token for token and logprob for logprob."""

from __future__ import annotations

import httpx

TIMEOUT = httpx.Timeout(600.0)


class AnswerError(RuntimeError):
    """The instance answered with an error status."""


def _post(url: str, body: dict) -> dict:
    response = httpx.post(url, json=body, timeout=TIMEOUT)
    if response.status_code != 200:
        raise AnswerError(f"POST {url}: HTTP {response.status_code}: {response.text}")
    return response.json()


def prompt_ids(url: str, name: str, text: str) -> list[int]:
    """``text`` as the served model's token ids (BOS included)."""
    return _post(f"{url}/tokenize", {"model": name, "prompt": text})["tokens"]


def greedy_answer(url: str, name: str, prompt: list[int], *, max_tokens: int, **extra) -> dict:
    """``{"tokens": [...], "top": [{"token_id:N": logprob}, ...]}`` for ``max_tokens`` greedy
    tokens (EOS ignored); ``extra`` joins the request body (``cache_salt``,
    ``kv_transfer_params``)."""
    body = {
        "model": name,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 5,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        **extra,
    }
    choice = _post(f"{url}/v1/completions", body)["choices"][0]
    return {"tokens": choice["token_ids"], "top": choice["logprobs"]["top_logprobs"]}
