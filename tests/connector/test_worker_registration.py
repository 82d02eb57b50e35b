"""The worker hands vllm-ascend's per-layer cache tuples over with the config's MLA flag."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_ascend_mooncake.connector.worker import ConnectorWorker
from vllm_ascend_mooncake.core.layout import BlockOrder, LayoutError
from vllm_ascend_mooncake.core.packing import chunk_packing
from vllm_ascend_mooncake.datapath.wire import ModelIdentity

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


def worker(is_mla: bool, heads: int, head_size: int, block_size: int = BLOCK_SIZE):
    model = SimpleNamespace(
        get_num_kv_heads=lambda parallel: heads, get_head_size=lambda: head_size
    )
    made = object.__new__(ConnectorWorker)  # not started: only what _describe reads
    made.config = SimpleNamespace(is_mla=is_mla, block_size=block_size)
    made._vllm_config = SimpleNamespace(model_config=model, parallel_config=None)
    return made


def test_the_worker_describes_tuple_caches_with_the_configs_mla_flag() -> None:
    """``ConnectorWorker._describe`` hands vllm-ascend's tuples over with ``config.is_mla``."""

    caches = ascend_mla_caches()
    identity = ModelIdentity("ds", "bfloat16", "auto", BLOCK_SIZE, 576, 1, 2, True)
    memory = worker(True, 1, 576)._describe(caches, identity)
    assert [r.name.rsplit(".", 1)[1] for r in memory.regions] == ["nope", "rope"] * 2
    tensors = [t for pair in caches.values() for t in pair]
    assert len(memory.tensors) == len(tensors)
    assert all(a is b for a, b in zip(memory.tensors, tensors, strict=True))  # all registered
    with pytest.raises(LayoutError, match="looks like an MLA cache"):
        worker(False, 1, 576)._describe(caches, identity)


@pytest.mark.parametrize("isa", ["vec", "vec16", "amx"])
def test_vllm_cpu_views_carry_their_isa_packing(isa) -> None:
    """vLLM CPU's per-layer views ``[blocks, heads, tokens, 2 * head_size]`` are described with
    the chunk packing of the ISA the backend label names (what lets prefill and decode use
    different block sizes); a backend without a known packing leaves it unknown."""
    views = {
        f"model.layers.{i}.self_attn.attn": torch.zeros(3, 2, 32, 128, dtype=torch.bfloat16)
        for i in range(2)
    }
    identity = ModelIdentity("tiny", "bfloat16", "auto", 32, 64, 2, 2, False, f"CPU_ATTN/{isa}")
    memory = worker(False, 2, 64, 32)._describe(views, identity)
    layout = memory.regions[0].layout
    assert layout.block_order is BlockOrder.HEAD_MAJOR
    assert layout.packing == chunk_packing(f"CPU_ATTN/{isa}", "auto", 64, 2) != ()
    for label, dtype in (("CPU_ATTN/neon", "auto"), ("CPU_ATTN/vec", "fp8"), ("OTHER", "auto")):
        other = ModelIdentity("tiny", "bfloat16", dtype, 32, 64, 2, 2, False, label)
        assert worker(False, 2, 64, 32)._describe(views, other).regions[0].layout.packing == ()


def test_a_packing_that_does_not_account_for_the_bytes_is_dropped() -> None:
    """Views wider than K and V of the head size (a backend changed under us): unknown packing
    and a warning, never a failed start."""
    views = {"model.layers.0.self_attn.attn": torch.zeros(3, 2, 32, 256, dtype=torch.bfloat16)}
    identity = ModelIdentity("tiny", "bfloat16", "auto", 32, 64, 2, 1, False, "CPU_ATTN/vec")
    memory = worker(False, 2, 64, 32)._describe(views, identity)
    assert memory.regions[0].layout.packing == ()
