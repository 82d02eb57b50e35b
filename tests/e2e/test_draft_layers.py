"""End to end: speculative decoding (EAGLE) through P/D, the draft model's layers with a KV-head
count (and head size) of their own, at heterogeneous TP (issue #44 item 1).

Prefill and decode both serve a tiny Llama target (4 KV heads) with a tiny EAGLE draft of another
KV-head count, so each engine's KV cache has the draft's layer after the target's, a head group
the connector plans apart. A greedy answer is the target's whatever the draft proposes, so
answers check the target's KV only; the draft's KV is checked by its bytes: after one hand-off
a worker extension (``kv_probe.py``) digests every (block, KV head) chunk of every layer on
both sides, and decode must hold, head for head, exactly what prefill held.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest
from kv_probe import assert_first_pull_byte_exact, probed_engines
from pd_checks import assert_clean_transfers, assert_same, complete, hand_off, metric

from vllm_ascend_mooncake.launch.deployment import DeploymentSpec, LocalDeployment
from vllm_ascend_mooncake.launch.tiny_draft_model import TinyEagleDraftSpec
from vllm_ascend_mooncake.launch.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.engine

TARGET = TinyModelSpec(num_layers=2, num_attention_heads=8, num_kv_heads=4, head_dim=32)
BLOCK_SIZE = 32
#: Token ids of the hand-off whose bytes are compared: four full blocks before the last token
#: (the one decode computes itself).
PROBED_PROMPT = list(range(20, 170))
PROMPTS = [
    "hello world",
    " ".join(f"draft{i} proposes, the target decides" for i in range(15)),
    " ".join(f"head{i} of its own group" for i in range(30)),
]


@dataclass(frozen=True)
class DraftCase:
    prefill_tp: int
    decode_tp: int
    draft_kv_heads: int
    draft_head_dim: int

    def __str__(self) -> str:
        return (
            f"{self.prefill_tp}-{self.decode_tp}-draft{self.draft_kv_heads}x{self.draft_head_dim}"
        )


CASES = [
    # the draft's 2 heads split over decode's ranks, read from prefill's one rank
    DraftCase(prefill_tp=1, decode_tp=2, draft_kv_heads=2, draft_head_dim=32),
    # the draft's one head (and a head size of its own) replicated on prefill's two ranks
    DraftCase(prefill_tp=2, decode_tp=1, draft_kv_heads=1, draft_head_dim=64),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_draft_layers_with_their_own_kv_heads_arrive_byte_exact(case: DraftCase, tmp_path) -> None:
    target = build_tiny_model(TARGET)
    draft = build_tiny_model(
        TinyEagleDraftSpec.for_target(
            TARGET,
            num_attention_heads=8,
            num_kv_heads=case.draft_kv_heads,
            head_dim=case.draft_head_dim,
        )
    )
    spec = DeploymentSpec(
        model=str(target),
        prefill_tp=case.prefill_tp,
        decode_tp=case.decode_tp,
        block_size=BLOCK_SIZE,
        log_dir=str(tmp_path),
        **probed_engines(str(draft)),
    )
    draft_layer = f"model.layers.{TARGET.num_layers}.self_attn.attn"
    with LocalDeployment(spec) as pd:
        name = httpx.get(f"{pd.decode.base_url}/v1/models").json()["data"][0]["id"]
        params = hand_off(pd.prefill.base_url, name, PROBED_PROMPT)
        handed_off = complete(pd.decode.base_url, name, PROBED_PROMPT, kv_transfer_params=params)
        layers = assert_first_pull_byte_exact(
            pd.prefill.base_url,
            pd.decode.base_url,
            params,
            len(PROBED_PROMPT),
            BLOCK_SIZE,
            lambda layer: case.draft_kv_heads if layer == draft_layer else TARGET.num_kv_heads,
        )
        assert draft_layer in layers and len(layers) == TARGET.num_layers + 1, layers

        assert_same(handed_off, complete(pd.decode.base_url, name, PROBED_PROMPT), "hand-off")
        for prompt in PROMPTS:
            colocated = complete(pd.decode.base_url, name, prompt)
            assert_same(complete(pd.proxy_url, name, prompt), colocated, "through P/D")
        assert metric(pd.decode.base_url, "vllm:spec_decode_num_draft_tokens_total") > 0
        assert_clean_transfers(pd, requests=1 + len(PROMPTS))
        decode_log = (tmp_path / "decode.log").read_text(errors="replace")
        assert f"draft layers' {case.draft_kv_heads} KV heads" in decode_log
        assert "Traceback" not in decode_log
