"""The contract tier against vllm-ascend's own code: the functions of its released sdists that run
without an NPU (allocation and alignment, its attention backend's cache shape, its registration
ranges, its check of a connector's TP sizes), cut out of the sources by
:mod:`vllm_ascend_sources` and run on CPU tensors. They hold this package, and the builders of
``test_vllm_ascend_caches.py``, to what vllm-ascend really does."""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_vllm_ascend_caches import (
    ALIGNMENT,
    CASES,
    HEAD_SIZE,
    Geometry,
    allocate_int8_cache_tensor,
)
from vllm_ascend_sources import RELEASES, function

from vllm_ascend_mooncake.connector.config import parse_config
from vllm_ascend_mooncake.datapath.registration import kv_memory_ranges

pytestmark = pytest.mark.network

RUNNER = "vllm_ascend/worker/model_runner_v1.py"
ATTENTION = "vllm_ascend/attention/attention_v1.py"
KV_UTILS = "vllm_ascend/distributed/kv_transfer/utils/utils.py"


def allocator(release: str):
    """``NPUModelRunner._allocate_int8_cache_tensor`` bound to a runner with a KV transfer
    config on CPU (the only change: ``device``)."""
    runner = SimpleNamespace(
        vllm_config=SimpleNamespace(kv_transfer_config=object()), device=torch.device("cpu")
    )
    runner._align_memory = function(release, RUNNER, "NPUModelRunner._align_memory", torch=torch)
    allocate = function(release, RUNNER, "NPUModelRunner._allocate_int8_cache_tensor", torch=torch)
    runner._align_memory = runner._align_memory.__get__(runner)
    return lambda numel: allocate(runner, numel, ALIGNMENT)


@pytest.mark.parametrize("release", RELEASES)
def test_the_allocation_the_builders_make_is_vllm_ascends(release) -> None:
    """A 2 MiB-aligned view of ``numel`` bytes out of a storage ``alignment`` bytes longer: what
    the builders' :func:`allocate_int8_cache_tensor` makes, and what registration must take the
    view's span of, not the storage's."""
    allocate = allocator(release)
    for numel in (4096, 3 * ALIGNMENT + 12345):
        theirs, ours = allocate(numel), allocate_int8_cache_tensor(numel)
        for tensor in (theirs, ours):
            assert tensor.data_ptr() % ALIGNMENT == 0 and tensor.numel() == numel
            assert tensor.untyped_storage().nbytes() == numel + ALIGNMENT
        (span,) = kv_memory_ranges([theirs])
        assert (span.addr, span.length) == (theirs.data_ptr(), numel)


@pytest.mark.parametrize("layout,head_major", [("", False), ("NHD", False), ("HND", True)])
def test_the_builders_use_the_attention_backends_shape(layout, head_major) -> None:
    """0.30.0rc2's ``AscendAttentionBackend.get_kv_cache_shape`` under each
    ``VLLM_KV_CACHE_LAYOUT``, against the combined GQA builder's views."""
    envs = SimpleNamespace(VLLM_KV_CACHE_LAYOUT=layout or None)
    shape_of = function(
        "0.30.0rc2", ATTENTION, "AscendAttentionBackend.get_kv_cache_shape", envs_vllm=envs
    )
    geometry = Geometry(layers=1, heads=4, engine_blocks=3, block_size=64, kernel_block=32)
    case = CASES[2] if head_major else CASES[1]
    (k, v) = next(iter(case.build(geometry)[0].values()))
    expected = shape_of(geometry.kernel_blocks, geometry.kernel_block, geometry.heads, HEAD_SIZE)
    assert (2, *k.shape) == expected and v.shape == k.shape
    # 0.23.0.post1's backend is token-major whatever the variable says
    shape_023 = function("0.23.0.post1", ATTENTION, "AscendAttentionBackend.get_kv_cache_shape")
    assert shape_023(6, 32, 4, HEAD_SIZE) == (2, 6, 32, 4, HEAD_SIZE)


def their_register_ranges(release: str, caches: dict[str, Any]) -> list[tuple[int, int]]:
    """vllm-ascend's ``collect_storage_merged_register_regions`` over ``caches``."""
    names = {"torch": torch, "dataclass": dataclass, "Any": Any, "Iterator": Iterator}
    register_range = function(release, KV_UTILS, "RegisterRange", **names)
    register_regions = function(release, KV_UTILS, "RegisterRegions", **names)
    iterate = function(release, KV_UTILS, "iter_kv_cache_tensors", **names)
    names["iter_kv_cache_tensors"] = iterate
    iterate.__globals__["iter_kv_cache_tensors"] = iterate  # it recurses by its module name
    collect = function(
        release,
        KV_UTILS,
        "collect_storage_merged_register_regions",
        OrderedDict=OrderedDict,
        RegisterRange=register_range,
        RegisterRegions=register_regions,
        REGISTER_MERGE_GAP_BYTES=4096,
        tensor_storage_key=function(release, KV_UTILS, "tensor_storage_key", torch=torch),
        **names,
    )
    regions = collect(caches)
    return sorted(zip(regions.ptrs, regions.lengths, strict=True))


@pytest.mark.parametrize(
    "release,case",
    [
        pytest.param(release, case, id=f"{case.name}-by-{release}")
        for case in CASES
        for release in RELEASES
        # 0.23's function reads contiguous caches only: 0.30's interleaved views are not its own
        if not (case.name.startswith("0.30-") and release == "0.23.0.post1")
    ],
)
def test_registration_takes_what_vllm_ascends_own_connector_registers(release, case) -> None:
    """The ranges this package registers for each cache equal vllm-ascend's own connector's
    (views' spans merged per storage), computed by the release that makes that cache."""
    caches, _ = case.build(
        Geometry(layers=3, heads=2, engine_blocks=4, block_size=64, kernel_block=32)
    )
    ours = sorted((r.addr, r.length) for r in kv_memory_ranges(itertools.chain(*caches.values())))
    assert ours == their_register_ranges(release, caches)


def _vllm_config(role: str, tp: int, extra: dict[str, Any]) -> SimpleNamespace:
    transfer = SimpleNamespace(
        is_kv_producer=role == "kv_producer",
        is_kv_consumer=role == "kv_consumer",
        get_from_extra_config=lambda key, default: extra.get(key, default),
    )
    return SimpleNamespace(
        kv_transfer_config=transfer,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, data_parallel_size=1),
    )


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2), (4, 4)])
def test_the_configuration_passes_vllm_ascends_check_and_ours(release, prefill_tp, decode_tp):
    """vllm-ascend's platform runs ``check_kv_extra_config`` on every connector's config: the
    README's ``{"prefill": {"tp_size": P}, "decode": {"tp_size": D}}`` passes it on both
    instances, means the same to this connector, and a wrong size fails both."""
    check = function(release, "vllm_ascend/utils.py", "check_kv_extra_config")
    extra = {"prefill": {"tp_size": prefill_tp}, "decode": {"tp_size": decode_tp}}
    for role, tp in (("kv_producer", prefill_tp), ("kv_consumer", decode_tp)):
        check(_vllm_config(role, tp, extra))
        config = parse_config(
            kv_role=role,
            engine_id=f"engine-{'0' * 8}-{'f' * 32}",  # vllm-ascend's "<engine_id>-<uuid hex>"
            extra=extra,
            local_tp=tp,
            local_dp=1,
            num_kv_heads=4,
            is_mla=False,
            block_size=128,
            device_type="npu",
        )
        assert (config.prefill.tp_size, config.decode.tp_size) == (prefill_tp, decode_tp)
    wrong = {"prefill": {"tp_size": prefill_tp + 1}, "decode": {"tp_size": decode_tp}}
    with pytest.raises(ValueError, match="conflicting tensor parallel size"):
        check(_vllm_config("kv_producer", prefill_tp, wrong))


def test_the_region_budget_of_vllm_ascends_connectors_is_their_own() -> None:
    """vllm-ascend's connectors stop at 256 registrations (``MAX_HCCL_REGISTER_REGIONS``);
    126 layers of 0.23's split K/V plus a staging buffer stay under it, counted its way."""
    allocate = allocator("0.23.0.post1")
    shape = (1, 32, 1, HEAD_SIZE)
    numel = math.prod(shape) * 2
    caches = {
        f"layer.{i}": tuple(allocate(numel).view(torch.bfloat16).view(shape) for _ in "kv")
        for i in range(126)
    }
    caches["staging"] = allocate(1 << 16)
    assert len(their_register_ranges("0.23.0.post1", caches)) == 253 <= 256
