"""The soak's mixed load: unique prompts of 20-200 tokens, 4-24 generated, a third streamed.

Requests are drawn from a seeded generator, so every system of a run gets the same requests in
the same order. Every prompt is unique (its tail is drawn from its index); by default half of
them begin with one of a few shared 64-token prefixes, as chat requests share a system prompt,
so that with prefix caching on the cache is hit, on P/D on both instances (decode then pulls
only the tail). No ``cache_salt``: the prefix cache acts as it would in production. Greedy and
``ignore_eos``, so a request's answer is exactly ``max_tokens`` tokens long; one that is not
(or not 200, or a stream without ``[DONE]``) counts as failed.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from .load_generator import stream_completion
from .prompts import make_prompt

#: tokens of each shared prefix (two blocks of 32)
PREFIX_TOKENS = 64
#: how many shared prefixes the prefixed requests spread over
SHARED_PREFIXES = 4
PROMPT_TOKENS = (20, 200)
MAX_TOKENS = (4, 24)
STREAMED_SHARE = 1 / 3
#: prompt indices of the shared prefixes (the requests' own tails use 0, 1, 2, ...)
_PREFIX_INDEX = 3_000_000


@dataclass(frozen=True)
class SoakRequest:
    index: int
    prompt_tokens: int
    max_tokens: int
    stream: bool
    #: which shared prefix the prompt begins with; None: the whole prompt is its own
    prefix: int | None


def draw_requests(
    count: int, seed: int = 0, shared_prefix_share: float = 0.5, first_index: int = 0
) -> list[SoakRequest]:
    """``count`` requests of the mix, indices from ``first_index`` (deterministic in seed and
    index: the same request for every system)."""
    requests = []
    for index in range(first_index, first_index + count):
        rng = random.Random(f"soak:{seed}:{index}")
        prefixed = rng.random() < shared_prefix_share
        low = PREFIX_TOKENS + PROMPT_TOKENS[0] if prefixed else PROMPT_TOKENS[0]
        requests.append(
            SoakRequest(
                index=index,
                prompt_tokens=rng.randint(low, PROMPT_TOKENS[1]),
                max_tokens=rng.randint(*MAX_TOKENS),
                stream=rng.random() < STREAMED_SHARE,
                prefix=rng.randrange(SHARED_PREFIXES) if prefixed else None,
            )
        )
    return requests


def prompt_ids(request: SoakRequest, vocabulary: list[int], seed: int = 0) -> list[int]:
    """The request's prompt as token ids: its shared prefix, if any, then its own tail."""
    if request.prefix is None:
        return make_prompt(vocabulary, request.prompt_tokens, request.index, seed)
    prefix = make_prompt(vocabulary, PREFIX_TOKENS, _PREFIX_INDEX + request.prefix, seed)
    tail = make_prompt(vocabulary, request.prompt_tokens - PREFIX_TOKENS, request.index, seed)
    return prefix + tail


def request_body(model: str, prompt: list[int], request: SoakRequest) -> dict[str, Any]:
    """A greedy ``/v1/completions`` body of exactly ``max_tokens`` generated tokens."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": request.stream,
        "return_token_ids": True,
    }


async def send(
    client: httpx.AsyncClient, base_url: str, body: dict[str, Any], timeout_s: float
) -> str | None:
    """Send one request; None when it was answered in full, else what went wrong."""
    expected = body["max_tokens"]
    if body["stream"]:
        timing = await stream_completion(client, base_url, body, timeout_s)
        if not timing.succeeded:
            return timing.error or "the stream ended without [DONE] or tokens"
        got = len(timing.token_ids)
    else:
        try:
            response = await client.post(f"{base_url}/v1/completions", json=body)
        except httpx.HTTPError as error:
            return f"{type(error).__name__}: {error}"
        if response.status_code != 200:
            return f"HTTP {response.status_code}: {response.text[:300]}"
        got = response.json().get("usage", {}).get("completion_tokens", 0)
    return None if got == expected else f"{got} tokens generated, {expected} asked"


@dataclass
class LoadResult:
    completed: int
    errors: list[str]
    wall_s: float


async def run_load(
    base_url: str,
    bodies: Sequence[dict[str, Any]],
    *,
    concurrency: int,
    request_timeout_s: float,
    on_completed: Callable[[int], None] = lambda done: None,
) -> LoadResult:
    """Send every body once, ``concurrency`` at a time (closed loop); ``on_completed(n)`` is
    called as the ``n``-th request ends (answered or not), on the event loop."""
    if concurrency <= 0:
        raise ValueError(f"concurrency must be positive, got {concurrency}")
    started = time.perf_counter()
    errors: list[str] = []
    next_index = 0
    completed = 0
    # trust_env=False: an HTTP(S)_PROXY in the environment must not route loopback traffic.
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(request_timeout_s),
        limits=httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency),
        trust_env=False,
    ) as client:

        async def worker() -> None:
            nonlocal next_index, completed
            while next_index < len(bodies):
                body = bodies[next_index]
                next_index += 1
                error = await send(client, base_url, body, request_timeout_s)
                if error is not None:
                    errors.append(error)
                completed += 1
                on_completed(completed)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return LoadResult(completed, errors, time.perf_counter() - started)
