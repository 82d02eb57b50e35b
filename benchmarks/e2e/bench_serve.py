"""One cell's latencies measured by vLLM's own client, ``vllm bench serve``.

Every system of a run is measured with the client vLLM users measure with, against its one
OpenAI endpoint (our proxy, vLLM's example proxy, vllm-router, or the colocated instance):
``--dataset-name random`` prompts of the cell's length (random tokens, decoded to text by the
model's tokenizer, the same for every system of a run through ``--seed``; a seed per cell, so no
prompt of one cell hits the prefix cache of another), ``--ignore-eos`` and greedy sampling, at
most ``concurrency`` requests at once, one after another as each finishes (``--request-rate
inf``). Its per-request record (``--save-detailed``: TTFT, each inter-token gap, output length,
error) becomes :class:`~benchmarks.e2e.sse_timing.StreamTiming`s, so the cells are summarised and
compared exactly like the home-made load generator's (which still warms the systems up and sends
the greedy probe whose tokens every system must agree on: ``vllm bench serve`` keeps no token ids).

vLLM's client counts a chunk with any choice as a token: the time to the first one is TTFT, the
gaps between the next ones are the inter-token latencies, as the proxy-side parser does.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from .load_generator import CellResult
from .sse_timing import StreamTiming

CLI_MODULE = "vllm_ascend_mooncake.launch.vllm_cli"


def command(
    url: str,
    model: str,
    *,
    prompt_len: int,
    max_tokens: int,
    concurrency: int,
    num_prompts: int,
    seed: int,
    result_path: Path,
) -> list[str]:
    """The ``vllm bench serve`` command line of one cell."""
    return [
        sys.executable,
        "-m",
        CLI_MODULE,
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--tokenizer",
        model,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(prompt_len),
        "--random-output-len",
        str(max_tokens),
        "--random-range-ratio",
        "0",
        "--num-prompts",
        str(num_prompts),
        "--max-concurrency",
        str(concurrency),
        "--request-rate",
        "inf",
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        str(seed),
        "--ready-check-timeout-sec",
        "0",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result_path.parent),
        "--result-filename",
        result_path.name,
    ]


def timings_from_result(result: dict[str, Any]) -> list[StreamTiming]:
    """One :class:`StreamTiming` per request of ``vllm bench serve``'s detailed result.

    Times are relative to each request's start; token ids are not reported, only how many the
    server counted (``output_lens``, from the usage chunk), so the ids are placeholders (-1)."""
    timings = []
    for ttft, gaps, output_len, error in zip(
        result["ttfts"], result["itls"], result["output_lens"], result["errors"], strict=True
    ):
        timing = StreamTiming(sent_at_s=0.0)
        if error or not ttft:
            timing.error = error or "no token arrived"
        else:
            timing.content_chunk_times_s = list(itertools.accumulate([ttft, *gaps]))
            timing.token_ids = [-1] * int(output_len or 0)
            timing.done = True
        timings.append(timing)
    return timings


def run_cell(
    url: str,
    model: str,
    *,
    prompt_len: int,
    max_tokens: int,
    concurrency: int,
    num_prompts: int,
    seed: int,
    result_path: Path,
    timeout_s: float,
) -> CellResult:
    """Run ``vllm bench serve`` for one cell and read its per-request record."""
    argv = command(
        url,
        model,
        prompt_len=prompt_len,
        max_tokens=max_tokens,
        concurrency=concurrency,
        num_prompts=num_prompts,
        seed=seed,
        result_path=result_path,
    )
    result_path.parent.mkdir(parents=True, exist_ok=True)
    log_path = result_path.with_suffix(".log")
    with log_path.open("wb") as log:
        completed = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
    if completed.returncode != 0 or not result_path.exists():
        tail = log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"vllm bench serve failed (exit {completed.returncode}):\n{tail}")
    result = json.loads(result_path.read_text())
    timings = timings_from_result(result)
    return CellResult(timings=timings, not_started=0, wall_s=float(result.get("duration", 0.0)))
