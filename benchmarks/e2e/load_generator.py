"""Closed-loop load: ``concurrency`` clients each send streamed completions back to back.

Every request is greedy, ignores EOS (so it always produces ``max_tokens`` tokens) and carries a
fresh ``cache_salt``: without it a repeated prompt would hit the prefix cache and skip the very
prefill (and, in P/D, the KV transfer) that the benchmark is meant to time. A cell is bounded both
in count (``len(prompts)`` requests) and in time: no new request starts after the cell's deadline
and each request is cut off after its own timeout, so one stuck system cannot hang the run.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from .sse_timing import SseTimingParser, StreamTiming


@dataclass(frozen=True)
class CellResult:
    """The requests of one (prompt length, concurrency) cell against one system."""

    timings: list[StreamTiming]
    not_started: int
    wall_s: float

    @property
    def failures(self) -> list[StreamTiming]:
        return [timing for timing in self.timings if not timing.succeeded]


def completion_body(
    model: str, prompt_token_ids: Sequence[int], max_tokens: int, *, stream: bool = True
) -> dict[str, Any]:
    """A greedy, fixed-length ``/v1/completions`` request with a never-repeated ``cache_salt``."""
    return {
        "model": model,
        "prompt": list(prompt_token_ids),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
        "return_token_ids": True,
        "cache_salt": uuid.uuid4().hex,
    }


async def stream_completion(
    client: httpx.AsyncClient, base_url: str, body: dict[str, Any], timeout_s: float
) -> StreamTiming:
    """Send one streamed completion and time every event line as it arrives."""
    parser = SseTimingParser(sent_at_s=time.perf_counter())

    async def consume() -> None:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                content = await response.aread()
                parser.timing.error = (
                    f"HTTP {response.status_code}: {content.decode(errors='replace')[:500]}"
                )
                return
            async for line in response.aiter_lines():
                parser.feed_line(line, time.perf_counter())

    try:
        await asyncio.wait_for(consume(), timeout=timeout_s)
    except asyncio.TimeoutError:
        parser.timing.error = f"no complete answer within {timeout_s:g} s"
    except httpx.HTTPError as error:
        parser.timing.error = f"{type(error).__name__}: {error}"
    return parser.timing


def _client(concurrency: int, timeout_s: float) -> httpx.AsyncClient:
    # trust_env=False: an HTTP(S)_PROXY in the environment must not route loopback traffic.
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s),
        limits=httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency),
        trust_env=False,
    )


async def run_cell(
    base_url: str,
    model: str,
    prompts: Sequence[Sequence[int]],
    *,
    concurrency: int,
    max_tokens: int,
    request_timeout_s: float,
    cell_timeout_s: float,
) -> CellResult:
    """Send every prompt once, ``concurrency`` at a time; keep prompt order in the result."""
    if concurrency <= 0:
        raise ValueError(f"concurrency must be positive, got {concurrency}")
    started = time.perf_counter()
    deadline = started + cell_timeout_s
    results: list[StreamTiming | None] = [None] * len(prompts)
    next_index = 0

    async with _client(concurrency, request_timeout_s) as client:

        async def worker() -> None:
            nonlocal next_index
            while next_index < len(prompts) and time.perf_counter() < deadline:
                index = next_index
                next_index += 1
                body = completion_body(model, prompts[index], max_tokens)
                results[index] = await stream_completion(client, base_url, body, request_timeout_s)

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    timings = [timing for timing in results if timing is not None]
    return CellResult(
        timings=timings,
        not_started=len(prompts) - len(timings),
        wall_s=time.perf_counter() - started,
    )


async def probe_token_ids(
    base_url: str, model: str, prompt: Sequence[int], max_tokens: int, timeout_s: float
) -> StreamTiming:
    """One greedy streamed request, for comparing outputs across systems."""
    async with _client(1, timeout_s) as client:
        return await stream_completion(
            client, base_url, completion_body(model, prompt, max_tokens), timeout_s
        )
