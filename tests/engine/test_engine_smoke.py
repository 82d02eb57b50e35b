"""A real vLLM CPU engine serves the tiny model, deterministically and prompt-sensitively.

Everything later (KV transfer between a prefill and a decode engine) is checked by comparing
greedy outputs, which only works if (1) the engine runs here at all, (2) greedy decoding is
repeatable, including when the prompt's blocks come from the prefix cache, and (3) the output
depends on tokens far back in the KV cache, not just on the last token. This test pins all three,
and checks that vLLM computes the same tokens as the transformers reference implementation.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from greedy_generate import RESULT_PREFIX

from vllm_ascend_mooncake.launch.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.engine

WORKER = Path(__file__).with_name("greedy_generate.py")
ENGINE_TIMEOUT_S = 600
MAX_TOKENS = 16
BLOCK_SIZE = 32

# Two prompts of more than two KV blocks that differ only in their first word: different outputs
# prove that attention reads the whole cached context.
_STORY = (
    " went to the market on a sunny morning to buy bread, apples and cheese for the whole"
    " family, and then walked back home along the river while the"
)
PROMPT_A = "Alice" + _STORY
PROMPT_B = "Bob" + _STORY


def run_greedy_engine(request: dict[str, Any], timeout_s: float = ENGINE_TIMEOUT_S) -> Any:
    """Run tests/engine/greedy_generate.py in its own process group and return its result.

    The group is killed on timeout so that no orphaned engine-core process keeps the CPUs busy.
    """
    process = subprocess.Popen(
        [sys.executable, str(WORKER), json.dumps(request)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"vLLM engine did not finish within {timeout_s} s:\n{output[-6000:]}")
    results = [line for line in output.splitlines() if line.startswith(RESULT_PREFIX)]
    assert process.returncode == 0 and len(results) == 1, (
        f"engine process exited with {process.returncode}:\n{output[-6000:]}"
    )
    return json.loads(results[0][len(RESULT_PREFIX) :])


def reference_greedy_tokens(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy continuations (of token-id prompts) computed by transformers' Llama."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    continuations = []
    with torch.no_grad():
        for prompt in prompts:
            tokens = list(prompt)
            for _ in range(MAX_TOKENS):
                logits = model(torch.tensor([tokens])).logits[0, -1]
                tokens.append(int(logits.argmax()))
            continuations.append(tokens[len(prompt) :])
    return continuations


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build_tiny_model(TinyModelSpec())


@pytest.fixture(scope="module")
def engine_result(model_dir: Path) -> Any:
    request = {
        "model": str(model_dir),
        # The second batch repeats PROMPT_A after the first filled the prefix cache with it.
        "batches": [[PROMPT_A, PROMPT_B], [PROMPT_A]],
        "max_tokens": MAX_TOKENS,
        "llm_kwargs": {
            "enforce_eager": True,
            "block_size": BLOCK_SIZE,
            "dtype": "float32",
            "max_model_len": 512,
            "seed": 0,
        },
    }
    return run_greedy_engine(request)


def test_prompts_span_several_kv_blocks(engine_result: Any) -> None:
    first_batch = engine_result["batches"][0]
    prompt_a, prompt_b = (item["prompt_token_ids"] for item in first_batch)
    assert len(prompt_a) > 2 * BLOCK_SIZE
    assert prompt_a[-2 * BLOCK_SIZE :] == prompt_b[-2 * BLOCK_SIZE :]


def test_same_prompt_gives_same_tokens(engine_result: Any) -> None:
    (first_a, _), (second_a,) = engine_result["batches"]
    assert len(first_a["token_ids"]) == MAX_TOKENS
    assert second_a["token_ids"] == first_a["token_ids"]


def test_output_depends_on_early_context(engine_result: Any) -> None:
    first_a, first_b = engine_result["batches"][0]
    assert first_a["token_ids"] != first_b["token_ids"]
    for item in (first_a, first_b):
        assert len(set(item["token_ids"])) > MAX_TOKENS // 2, "degenerate repeated tokens"


def test_vllm_matches_transformers_reference(engine_result: Any, model_dir: Path) -> None:
    first_batch = engine_result["batches"][0]
    prompts = [item["prompt_token_ids"] for item in first_batch]
    expected = reference_greedy_tokens(model_dir, prompts)
    assert [item["token_ids"] for item in first_batch] == expected
