"""Token-id prompts of exact lengths, identical for every system of a run.

Prompts are sent as token ids (``/v1/completions`` accepts a list of ints), so a "256-token
prompt" is 256 tokens on every system with no tokenizer round trip. Ids are drawn from the
tokenizer's regular vocabulary (no special or reserved tokens) by a generator seeded with the
prompt's length and index: each request of a cell gets a different prompt, and a request with the
same (length, index) is the same prompt for the colocated instance and both P/D deployments.
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def regular_token_ids(model_dir: str | Path) -> list[int]:
    """Ids of the ordinary (non-special, non-added) tokens in ``model_dir/tokenizer.json``."""
    tokenizer = json.loads((Path(model_dir) / "tokenizer.json").read_text(encoding="utf-8"))
    added = {int(token["id"]) for token in tokenizer.get("added_tokens", [])}
    vocab = tokenizer["model"]["vocab"]
    ids = sorted(int(token_id) for token_id in vocab.values() if int(token_id) not in added)
    if not ids:
        raise ValueError(f"{model_dir}/tokenizer.json has no regular tokens")
    return ids


def make_prompt(vocabulary: list[int], length: int, index: int, seed: int = 0) -> list[int]:
    """The ``index``-th prompt of ``length`` tokens: deterministic in (seed, length, index)."""
    if length <= 0:
        raise ValueError(f"prompt length must be positive, got {length}")
    rng = random.Random(f"{seed}:{length}:{index}")
    return [rng.choice(vocabulary) for _ in range(length)]
