"""The topology x geometry matrix on real `vllm serve` P/D, answers equal to colocated.

Each cell is one deployment: a TP pair, a model geometry (KV heads, head_dim, GQA ratio) and a
block size. Its prompts go through ``vam-proxy`` (serial, then overlapped legs) and a second time
through a client that only does what vLLM's example disaggregation proxy does, so that decode's
prefix cache serves the leading blocks and the pull reads the tail. A negative control (decode
given another prompt's KV continues that prompt) proves the bytes are used, and every pull of the
cell must have succeeded on every decode rank, with no block freed by prefill's timeout.

Together with ``test_pd_serve.py`` (1->1, 2->1, 1->2 on 2 KV heads, head_dim 64, block 32):
2->2, 4->1 (prefill TP above the KV-head count: replicated heads), 1->2 on one KV head (decode
replicas), 2->1 on 4 KV heads; head_dim 64 and 128; blocks of 32, 64 and 128.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest
from pd_checks import (
    assert_clean_transfers,
    assert_same,
    complete,
    complete_like_vllm_example_proxy,
    metric,
    summary,
)

from vllm_ascend_mooncake.launch.deployment import DeploymentSpec, LocalDeployment
from vllm_ascend_mooncake.launch.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = [pytest.mark.engine, pytest.mark.matrix]

PROMPTS = [
    "hello world",
    "A disaggregated deployment runs the prompt on one instance and the decoding on another",
    " ".join(f"word{i} the quick brown fox" for i in range(25)),  # spans blocks of 128 too
]


@dataclass(frozen=True)
class Cell:
    prefill_tp: int
    decode_tp: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    def __str__(self) -> str:
        return (
            f"{self.prefill_tp}to{self.decode_tp}-kv{self.num_kv_heads}-d{self.head_dim}"
            f"-b{self.block_size}"
        )


CELLS = [
    Cell(2, 2, num_kv_heads=2, head_dim=64, block_size=64),
    Cell(4, 1, num_kv_heads=2, head_dim=64, block_size=32),  # prefill replicates KV heads
    Cell(1, 2, num_kv_heads=1, head_dim=128, block_size=128),  # decode replicates, GQA 8
    Cell(2, 1, num_kv_heads=4, head_dim=128, block_size=64),  # GQA 2
]


def negative_control(pd: LocalDeployment, name: str) -> None:
    """Decode gets prompt X with the KV of prompt Y (same length): it must continue Y."""
    x = httpx.post(
        f"{pd.prefill.base_url}/tokenize", json={"model": name, "prompt": PROMPTS[2]}, timeout=60
    ).json()["tokens"]
    y = list(x)
    for i in range(4, len(y) - 8, 3):  # a third of the tokens differ; same length
        y[i] = 3 + (y[i] + 1) % 400
    colocated_x = complete(pd.prefill.base_url, name, x)
    colocated_y = complete(pd.prefill.base_url, name, y)
    assert summary(colocated_x)[0] != summary(colocated_y)[0], "X and Y must answer differently"
    handoff = {"do_remote_decode": True}
    prefilled = complete(pd.prefill.base_url, name, y, max_tokens=1, kv_transfer_params=handoff)
    decoded = complete(
        pd.decode.base_url,
        name,
        x,
        kv_transfer_params=prefilled["kv_transfer_params"],
        cache_salt="negative-control",  # never served from decode's cache of X
    )
    assert summary(decoded)[0] == summary(colocated_y)[0]
    assert summary(decoded)[0] != summary(colocated_x)[0]


@pytest.mark.parametrize("cell", CELLS, ids=str)
def test_matrix_cell_matches_colocated(cell: Cell, tmp_path) -> None:
    model = build_tiny_model(
        TinyModelSpec(num_kv_heads=cell.num_kv_heads, head_dim=cell.head_dim, dtype="float32")
    )
    spec = DeploymentSpec(
        model=str(model),
        prefill_tp=cell.prefill_tp,
        decode_tp=cell.decode_tp,
        block_size=cell.block_size,
        log_dir=str(tmp_path),
    )
    with LocalDeployment(spec) as pd:
        name = httpx.get(f"{pd.prefill.base_url}/v1/models", timeout=60).json()["data"][0]["id"]
        # Colocated answers from the prefill instance itself (no hand-off asked for).
        reference = {p: complete(pd.prefill.base_url, name, p) for p in PROMPTS}
        for prompt in PROMPTS:
            assert_same(complete(pd.proxy_url, name, prompt), reference[prompt], f"{cell} proxy")
        hits_before = metric(pd.decode.base_url, "vllm:prefix_cache_hits_total")
        for prompt in PROMPTS:
            second = complete_like_vllm_example_proxy(
                pd.prefill.base_url, pd.decode.base_url, name, prompt
            )
            assert_same(second, reference[prompt], f"{cell} second pass, vLLM proxy protocol")
        assert metric(pd.decode.base_url, "vllm:prefix_cache_hits_total") > hits_before
        negative_control(pd, name)
        assert_clean_transfers(pd, requests=2 * len(PROMPTS) + 1)
