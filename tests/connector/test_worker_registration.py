"""The worker hands vllm-ascend's per-layer cache tuples over with the config's MLA flag."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_ascend_mooncake.connector.worker import ConnectorWorker
from vllm_ascend_mooncake.core.layout import LayoutError

BLOCKS, BLOCK_SIZE = 4, 16


def ascend_mla_caches():
    """vllm-ascend's MLA cache: per layer (nope, rope), ``[blocks, block_size, 1, width]``."""
    return {
        f"model.layers.{i}.self_attn.attn": (
            torch.zeros(BLOCKS, BLOCK_SIZE, 1, 512, dtype=torch.bfloat16),
            torch.zeros(BLOCKS, BLOCK_SIZE, 1, 64, dtype=torch.bfloat16),
        )
        for i in range(2)
    }


def test_the_worker_describes_tuple_caches_with_the_configs_mla_flag() -> None:
    """``ConnectorWorker._describe`` hands vllm-ascend's tuples over with ``config.is_mla``."""

    def worker(is_mla: bool) -> ConnectorWorker:
        model = SimpleNamespace(get_num_kv_heads=lambda parallel: 1, get_head_size=lambda: 576)
        made = object.__new__(ConnectorWorker)  # not started: only what _describe reads
        made.config = SimpleNamespace(is_mla=is_mla, block_size=BLOCK_SIZE)
        made._vllm_config = SimpleNamespace(model_config=model, parallel_config=None)
        return made

    caches = ascend_mla_caches()
    memory = worker(True)._describe(caches)
    assert [r.name.rsplit(".", 1)[1] for r in memory.regions] == ["nope", "rope"] * 2
    tensors = [t for pair in caches.values() for t in pair]
    assert len(memory.tensors) == len(tensors)
    assert all(a is b for a, b in zip(memory.tensors, tensors, strict=True))  # all registered
    with pytest.raises(LayoutError, match="looks like an MLA cache"):
        worker(False)._describe(caches)
