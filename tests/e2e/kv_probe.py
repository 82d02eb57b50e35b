"""A vLLM worker extension for tests: the bytes a worker holds in its KV cache, per layer, block
and KV head, as digests, so that a test can compare what decode pulled with what prefill held
byte for byte (answers cannot show it for every layer: a draft model's KV changes only which
tokens are proposed, never a greedy answer).

Engines load it with ``--worker-extension-cls kv_probe.KVProbe`` (this directory on their
``PYTHONPATH``) and answer ``POST /collective_rpc`` with ``VLLM_SERVER_DEV_MODE=1``; the test
reads it with :func:`block_digests`. Test-only: nothing in the connector depends on it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx


class KVProbe:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``."""

    def kv_block_digests(self, request: str) -> dict[str, Any]:
        """``request``: JSON ``{"blocks": [ids]}`` (vLLM's dev endpoint passes strings only).
        Answers this rank's TP rank and, for every layer with a KV cache, its KV-head count and
        the SHA-256 of each (block, local head) chunk (its K and V), blocks in the order asked."""
        import torch

        asked = json.loads(request)
        context = self.vllm_config.compilation_config.static_forward_context  # type: ignore[attr-defined]
        layers: dict[str, Any] = {}
        for name in sorted(context):
            cache = getattr(context[name], "kv_cache", None)
            cache = cache[0] if isinstance(cache, (list, tuple)) and cache else cache
            if not isinstance(cache, torch.Tensor) or not cache.numel():
                continue
            # Head-major: [blocks, heads, ...] (vLLM CPU 0.32: K and V of a (block, head) side by
            # side), or [2 (K, V), blocks, heads, ...].
            split = cache.dim() == 5 and cache.shape[0] == 2
            heads = cache.shape[2] if split else cache.shape[1]
            digests = []
            for block in asked["blocks"]:
                per_head = []
                for head in range(heads):
                    if split:
                        chunk = torch.stack([cache[0, block, head], cache[1, block, head]])
                    else:
                        chunk = cache[block, head]
                    raw = chunk.contiguous().view(torch.uint8).numpy().tobytes()
                    per_head.append(hashlib.sha256(raw).hexdigest())
                digests.append(per_head)
            layers[name] = {"heads": heads, "digests": digests}
        parallel = self.vllm_config.parallel_config  # type: ignore[attr-defined]
        return {"tp_rank": self.rank % parallel.tensor_parallel_size, "layers": layers}  # type: ignore[attr-defined]


def block_digests(url: str, blocks: list[int]) -> list[dict[str, Any]]:
    """Every TP rank's answer of :meth:`KVProbe.kv_block_digests` from the server at ``url``,
    in TP rank order."""
    body = {
        "method": "kv_block_digests",
        "args": [json.dumps({"blocks": blocks})],
        "timeout": 60,
    }
    response = httpx.post(f"{url}/collective_rpc", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return sorted(response.json()["results"], key=lambda rank: rank["tp_rank"])


def by_global_head(
    ranks: list[dict[str, Any]], layer: str, total_heads: int
) -> list[dict[int, str]]:
    """One layer's digests from every TP rank, per block: global KV head -> digest, by vLLM's
    sharding (rank ``r`` of TP ``T`` holds heads ``r*H/T ..`` when ``T <= H``, else the one head
    ``r*H//T``, replicated); replicas must agree."""
    tp = len(ranks)
    blocks: list[dict[int, str]] = []
    for rank, answer in enumerate(ranks):
        entry = answer["layers"][layer]
        local = entry["heads"]
        expected = total_heads // tp if tp <= total_heads else 1
        assert local == expected, f"{layer}: rank {rank} of {tp} holds {local} heads"
        first = rank * local if tp <= total_heads else rank * total_heads // tp
        for index, per_head in enumerate(entry["digests"]):
            if len(blocks) <= index:
                blocks.append({})
            for offset, digest in enumerate(per_head):
                head = first + offset
                assert blocks[index].setdefault(head, digest) == digest, (
                    f"{layer}: the replicas of head {head} differ in block {index}"
                )
    return blocks


def probed_engines(draft_model: str | None) -> dict:
    """``DeploymentSpec`` fields for engines this probe can read: the worker extension, vLLM's
    dev endpoint, and with ``draft_model`` EAGLE speculative decoding (2 tokens) with it."""
    args = ["--worker-extension-cls", "kv_probe.KVProbe"]
    if draft_model is not None:
        speculative = {"method": "eagle", "model": draft_model, "num_speculative_tokens": 2}
        args += ["--speculative-config", json.dumps(speculative)]
    return {
        "prefill_args": tuple(args),
        "decode_args": tuple(args),
        "extra_env": {"PYTHONPATH": str(Path(__file__).parent), "VLLM_SERVER_DEV_MODE": "1"},
    }


def assert_first_pull_byte_exact(
    prefill_url: str,
    decode_url: str,
    params: dict[str, Any],
    prompt_tokens: int,
    block_size: int,
    total_heads: Callable[[str], int],
) -> list[str]:
    """After decode's first request ever (``params``: its hand-off, prefill and decode of equal
    ``block_size``), decode holds, for every layer, head and block the prompt fills before its
    last token, exactly the bytes prefill held. Decode's blocks are the pool's first, 1.. (block 0
    is vLLM's null block): the model's layers comparing equal confirms it. ``total_heads``: a
    layer's total KV heads. Answers the layers compared."""
    full = (prompt_tokens - 1) // block_size
    assert full >= 1, f"a {prompt_tokens}-token prompt fills no {block_size}-token block"
    held = block_digests(prefill_url, params["remote_block_ids"][:full])
    pulled = block_digests(decode_url, list(range(1, full + 1)))
    layers = sorted(held[0]["layers"])
    assert layers == sorted(pulled[0]["layers"]), "prefill and decode have different layers"
    for layer in layers:
        total = total_heads(layer)
        source = by_global_head(held, layer, total)
        landed = by_global_head(pulled, layer, total)
        assert len(source) == full and all(len(block) == total for block in source), layer
        differ = [
            (block, head)
            for block, heads in enumerate(source)
            for head in heads
            if landed[block].get(head) != heads[head]
        ]
        assert not differ, f"{layer}: decode's (block, head) chunks {differ} differ from prefill's"
    return layers
