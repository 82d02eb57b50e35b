"""Run a real vLLM engine in this process and print the greedy token ids it generates.

``vllm.LLM`` starts its engine core in a spawned child process, which re-imports ``__main__``;
pytest's ``__main__`` cannot be re-imported that way, so tests run this file as a script and read
the result from the line of stdout that starts with :data:`RESULT_PREFIX`.

Usage: ``python greedy_generate.py REQUEST_JSON`` where the request holds ``model`` (a path),
``batches`` (a list of prompt lists; each is one ``LLM.generate`` call, in order, so a later
batch can reuse the prefix cache that an earlier one filled), ``max_tokens`` and ``llm_kwargs``
(extra keyword arguments for ``vllm.LLM``). The result holds, per batch and prompt, the prompt's
token ids and the generated token ids.
"""

from __future__ import annotations

import json
import sys
from typing import Any

RESULT_PREFIX = "GREEDY_RESULT "


def generate(request: dict[str, Any]) -> dict[str, Any]:
    """Start one engine, run every batch greedily, and return the token ids."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=request["model"], **request.get("llm_kwargs", {}))
    sampling = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True)
    batches = []
    for prompts in request["batches"]:
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        batches.append(
            [
                {
                    "prompt_token_ids": list(output.prompt_token_ids),
                    "token_ids": list(output.outputs[0].token_ids),
                }
                for output in outputs
            ]
        )
    return {"batches": batches}


def main() -> None:
    request = json.loads(sys.argv[1])
    result = generate(request)
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
