"""How far colocated instances of one random-geometry draw drift apart when only their TP differs.

No P/D, no transfer: the draw's model (:mod:`vam_testing.geometry_draw`) served
colocated at TP 1 and at the draw's prefill and decode TP sizes, each prompt of the draw (and
the random-geometry test's negative-control prompt) asked twice, the second answer kept (prefix-
cached, as the test's reference). Prints, per pair of TP sizes and per prompt, the largest
|logprob difference| of a token in both top-5 lists up to the first differing greedy token: what
bfloat16 reduction order alone moves, against which the test's bound is set.

    python -m benchmarks.e2e.tp_drift SEED
"""

from __future__ import annotations

import argparse
import itertools

import httpx

from vam_testing.answers import greedy_answer, prompt_ids
from vam_testing.geometry_draw import (
    PROMPT_TEXT,
    draw_geometry,
    negative_control_prompt,
)
from vllm_ascend_mooncake.launch.servers import VllmServer
from vllm_ascend_mooncake.launch.tiny_model import build_tiny_model

MAX_MODEL_LEN = 512
MAX_TOKENS = 12


def answer(url: str, name: str, prompt: list[int]) -> dict:
    """The greedy answer, asked twice (the second, prefix-cached, is kept)."""
    for _ in range(2):
        answered = greedy_answer(url, name, prompt, max_tokens=MAX_TOKENS, cache_salt="tp-drift")
    return answered


def largest_drift(a: dict, b: dict) -> float:
    worst = 0.0
    for position, (top_a, top_b) in enumerate(zip(a["top"], b["top"], strict=True)):
        worst = max([worst, *(abs(top_a[t] - v) for t, v in top_b.items() if t in top_a)])
        if a["tokens"][position] != b["tokens"][position]:
            break
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("seed", type=int, help="the draw's seed (a test id's seedN)")
    args = parser.parse_args()
    draw = draw_geometry(args.seed)
    print(draw, flush=True)
    model = str(build_tiny_model(draw.model_spec()))
    answers: dict[int, list[dict]] = {}
    prompts: list[list[int]] = []
    for tp in sorted({1, draw.prefill_tp, draw.decode_tp}):
        with VllmServer(
            model,
            tensor_parallel_size=tp,
            dtype=draw.dtype,
            block_size=draw.decode_block_size,
            max_model_len=MAX_MODEL_LEN,
        ) as server:
            name = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
            if not prompts:
                text = prompt_ids(server.base_url, name, PROMPT_TEXT)
                prompts = [text[:n] for n in draw.prompt_lengths()]
                prompts.append(negative_control_prompt(prompts[-1]))
            answers[tp] = [answer(server.base_url, name, p) for p in prompts]
    for a, b in itertools.combinations(sorted(answers), 2):
        drifts = [largest_drift(x, y) for x, y in zip(answers[a], answers[b], strict=True)]
        print(
            f"TP {a} vs TP {b}: largest |logprob difference| per prompt "
            f"{', '.join(f'{d:.3f}' for d in drifts)}"
        )


if __name__ == "__main__":
    main()
