"""A vLLM worker extension for tests: the bytes a worker holds in its KV cache, per layer, KV head
and run of tokens, as digests, so that a test can compare what decode pulled with what prefill
held byte for byte (answers cannot show it for every layer: a draft model's KV changes only which
tokens are proposed, never a greedy answer).

A head-major (block, head) chunk of vLLM CPU is packed by its ISA kernel (K column-major for vec,
16-token tiles for amx): the probe reads each chunk's rows through the packing the connector
plans with (:func:`vllm_ascend_mooncake.core.packing.chunk_packing`, checked against vLLM's own
kernels by tests/datapath/test_chunk_packing.py) and digests the bytes of every run of ``unit``
tokens (the packing's largest token unit) of a head, in token order across the blocks given. The
digests therefore do not depend on the block size: prefill and decode of different block sizes
compare run for run.

Engines load it with ``--worker-extension-cls kv_probe.KVProbe`` (this directory on their
``PYTHONPATH``) and answer ``POST /collective_rpc`` with ``VLLM_SERVER_DEV_MODE=1``
(:func:`probed_engines`). Test-only: nothing in the connector depends on it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

#: Tokens per digest: a multiple of every packing's token unit (amx tiles: 16) that divides
#: every block size vLLM CPU takes (multiples of 32).
TOKEN_RUN = 16


class KVProbe:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``."""

    def kv_token_digests(self, request: str) -> dict[str, Any]:
        """``request``: JSON ``{"blocks": [ids]}``, a request's blocks in order (vLLM's dev
        endpoint passes strings only). Answers this rank's TP rank and, for every layer with a
        KV cache, its KV-head count and per head the SHA-256 of each run of
        :data:`TOKEN_RUN` tokens' bytes (K and V, every row of the packing), in token order."""
        import torch

        from vllm_ascend_mooncake.connector.identity import attention_backend_label
        from vllm_ascend_mooncake.core.packing import chunk_packing

        blocks = json.loads(request)["blocks"]
        context = self.vllm_config.compilation_config.static_forward_context  # type: ignore[attr-defined]
        layers: dict[str, Any] = {}
        for name in sorted(context):
            cache = getattr(context[name], "kv_cache", None)
            cache = cache[0] if isinstance(cache, (list, tuple)) and cache else cache
            if not isinstance(cache, torch.Tensor) or not cache.numel():
                continue
            # vLLM CPU 0.32: [blocks, heads, tokens, 2 * head_size], K and V of a (block, head)
            # side by side in one chunk, packed by the ISA kernel.
            _, heads, block_size, width = cache.shape
            label = attention_backend_label([context[name]])
            packing = chunk_packing(label, "auto", width // 2, cache.element_size())
            assert packing, f"{name}: no known packing for {label} (head size {width // 2})"
            digests = []
            for head in range(heads):
                runs = []
                for block in blocks:
                    chunk = cache[block, head].contiguous().view(torch.uint8).numpy().tobytes()
                    runs += _run_digests(chunk, packing, block_size, name)
                digests.append(runs)
            layers[name] = {"heads": heads, "digests": digests}
        parallel = self.vllm_config.parallel_config  # type: ignore[attr-defined]
        return {"tp_rank": self.rank % parallel.tensor_parallel_size, "layers": layers}  # type: ignore[attr-defined]


def _run_digests(chunk: bytes, packing: Any, block_size: int, layer: str) -> list[str]:
    """The digest of each run of :data:`TOKEN_RUN` tokens of one (block, head) chunk: the run's
    bytes in every row of the packing (a row holds ``token_bytes`` of each token in order)."""
    rows, offset = [], 0
    for group in packing:
        for _ in range(group.rows):
            rows.append(
                (chunk[offset : offset + block_size * group.token_bytes], group.token_bytes)
            )
            offset += block_size * group.token_bytes
    assert offset == len(chunk), f"{layer}: the packing {packing} does not cover the chunk"
    digests = []
    for run in range(block_size // TOKEN_RUN):
        digest = hashlib.sha256()
        for row, token_bytes in rows:
            size = TOKEN_RUN * token_bytes
            digest.update(row[run * size : (run + 1) * size])
        digests.append(digest.hexdigest())
    return digests


def token_digests(url: str, blocks: list[int]) -> list[dict[str, Any]]:
    """Every TP rank's answer of :meth:`KVProbe.kv_token_digests` from the server at ``url``,
    in TP rank order."""
    body = {
        "method": "kv_token_digests",
        "args": [json.dumps({"blocks": blocks})],
        "timeout": 60,
    }
    response = httpx.post(f"{url}/collective_rpc", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return sorted(response.json()["results"], key=lambda rank: rank["tp_rank"])


def by_global_head(
    ranks: list[dict[str, Any]], layer: str, total_heads: int
) -> dict[int, list[list[str]]]:
    """One layer's digests from every TP rank by global KV head, vLLM's sharding (rank ``r`` of
    TP ``T`` holds heads ``r*H/T ..`` when ``T <= H``, else the one head ``r*H//T``,
    replicated): each head's distinct replicas. Replicas computed on different ranks may differ
    in their last bits (each rank reduces the layer's input in its own order), so a pulled copy
    is compared with the replica it may have been read from, not with one of them."""
    tp = len(ranks)
    heads: dict[int, list[list[str]]] = {}
    for rank, answer in enumerate(ranks):
        entry = answer["layers"][layer]
        local = entry["heads"]
        expected = total_heads // tp if tp <= total_heads else 1
        assert local == expected, f"{layer}: rank {rank} of {tp} holds {local} heads"
        first = rank * local if tp <= total_heads else rank * total_heads // tp
        for offset, runs in enumerate(entry["digests"]):
            replicas = heads.setdefault(first + offset, [])
            if runs not in replicas:
                replicas.append(runs)
    return heads


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
    decode_block_size: int,
    total_heads: Callable[[str], int],
) -> list[str]:
    """After decode's first request ever (``params``: its hand-off), decode holds, for every
    layer and head, exactly the bytes prefill held (in one of its replicas of a replicated head)
    for each run of tokens the prompt fills before its last token (the one decode computes
    itself). Decode's blocks are the pool's first, 1.. (block 0 is vLLM's null block): the
    model's layers comparing equal confirms it.
    ``total_heads``: a layer's total KV heads. Answers the layers compared."""
    runs = (prompt_tokens - 1) // TOKEN_RUN
    assert runs >= 1, f"a {prompt_tokens}-token prompt fills no {TOKEN_RUN}-token run"
    decode_blocks = -(-prompt_tokens // decode_block_size)
    held = token_digests(prefill_url, list(params["remote_block_ids"]))
    pulled = token_digests(decode_url, list(range(1, decode_blocks + 1)))
    layers = sorted(held[0]["layers"])
    assert layers == sorted(pulled[0]["layers"]), "prefill and decode have different layers"
    for layer in layers:
        total = total_heads(layer)
        source = by_global_head(held, layer, total)
        landed = by_global_head(pulled, layer, total)
        assert sorted(source) == sorted(landed) == list(range(total)), layer
        differ = [
            head
            for head in range(total)
            for copy in landed[head]
            if not any(copy[:runs] == replica[:runs] for replica in source[head])
        ]
        assert not differ, (
            f"{layer}: decode's copies of heads {differ} match none of prefill's, over the "
            f"prompt's first {runs * TOKEN_RUN} tokens"
        )
    return layers
