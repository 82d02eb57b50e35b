"""The Ascend contract tier: KV caches made the way vllm-ascend makes them, through registration
for ``npu``, the planner and byte-exact pulls across TP pairs.

No NPU runs here, so each cache is built on CPU by the same steps as vllm-ascend's model runner,
cited line by line from the released sdists (``vllm_ascend/worker/model_runner_v1.py`` of
``vllm_ascend-0.23.0.post1`` and ``vllm_ascend-0.30.0rc2``); only ``device="npu"`` becomes CPU
and the Mooncake engine behind :class:`MooncakeTransport` is a stub that records what it is asked
to register (its ``register`` checks run for real, with ``device_type="npu"``). The bytes move on
the in-process transport; the expected values are written and read through the engine's own
tensor views (token ``t``, head ``h``), never through this package's layout description.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vam_testing.kv_reference import owned_heads
from vllm_ascend_mooncake.connector.attention_layers import (
    LayerGeometry,
    attention_geometry,
    check_planned_heads,
    draft_layer_heads,
    draft_layer_names,
    refuse_hybrid_layers,
    refuse_unsupported_parallelism,
)
from vllm_ascend_mooncake.core.layout import BlockOrder, LayoutError
from vllm_ascend_mooncake.core.plan import PlanOptions, StagingArea, plan_request
from vllm_ascend_mooncake.core.relayout import LocalMemory, apply_row_copies, apply_swaps
from vllm_ascend_mooncake.core.topology import TransferTopology
from vllm_ascend_mooncake.datapath import mooncake as mooncake_module
from vllm_ascend_mooncake.datapath.fake import InProcessTransport
from vllm_ascend_mooncake.datapath.registration import kv_memory_ranges, regions_from_split_caches
from vllm_ascend_mooncake.datapath.transport import MemoryRange

#: vllm-ascend's raw-allocation alignment when a KV connector is configured
#: (``_allocate_kv_cache_tensors``: ``alignment = 2 * 1024 * 1024``, 0.23.0.post1 l.4101,
#: 0.30.0rc2 l.4976).
ALIGNMENT = 2 << 20
DTYPE = torch.bfloat16
HEAD_SIZE = 16
NOPE, ROPE, INDEXER = 512, 64, 128  # DeepSeek's kv_lora_rank, qk_rope_head_dim, index_head_dim


def allocate_int8_cache_tensor(numel: int) -> torch.Tensor:
    """``NPUModelRunner._allocate_int8_cache_tensor`` with a KV transfer config (0.30.0rc2
    l.4868-4889; 0.23.0.post1 l.4005-4025): ``torch.zeros(numel + alignment, int8)``, then
    ``_align_memory`` (l.4701-4705) slices from the first 2 MiB-aligned address, ``[:numel]``.
    The storage starts unaligned and is ``alignment`` bytes longer than the view."""
    raw = torch.zeros(numel + ALIGNMENT, dtype=torch.int8)
    offset = (raw.data_ptr() + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT - raw.data_ptr()
    return raw[offset:][:numel]


@dataclass(frozen=True)
class Geometry:
    """One rank's cache: ``heads`` KV heads, ``engine_blocks`` blocks of ``block_size`` tokens
    cut into kernel blocks of ``kernel_block`` tokens (vllm-ascend's ``block_size_chunk``)."""

    layers: int
    heads: int
    engine_blocks: int
    block_size: int
    kernel_block: int

    @property
    def kernel_blocks(self) -> int:
        return self.engine_blocks * (self.block_size // self.kernel_block)


#: A layer's cache as vllm-ascend hands it to ``register_kv_caches``, and how token ``t`` of
#: head ``h`` (or latent part ``h``) is addressed in each of its tensors: ``(tensor, index)``.
Cache = tuple[torch.Tensor, ...]
Locate = Callable[[Cache, int, int, int], tuple[torch.Tensor, tuple[int, ...]]]


def _kernel_slot(geometry: Geometry, block_id: int, token: int) -> tuple[int, int]:
    """Engine block ``block_id``'s token ``token`` as (kernel block, slot): vllm-ascend views an
    engine block as ``block_size // kernel_block_size`` consecutive kernel blocks
    (``kv_cache_shape = get_kv_cache_shape(num_blocks * block_size_chunk, kernel_block_size,
    ...)``, 0.30.0rc2 l.5711-5719)."""
    per = geometry.block_size // geometry.kernel_block
    return block_id * per + token // geometry.kernel_block, token % geometry.kernel_block


def split_gqa_v023(geometry: Geometry) -> tuple[dict[str, Cache], Locate]:
    """0.23.0.post1: K and V are separate raw allocations per layer (``k_tensor`` and
    ``v_tensor`` from ``_allocate_int8_cache_tensor``, l.4252-4262, split by
    ``calc_split_factor`` into halves), each viewed as ``[num_blocks, block_size, heads,
    head_size]`` (``raw_k_tensor.view(k_cache_dtype).view(k_shape)``, l.4639, with the
    backend's NHD shape)."""
    shape = (geometry.kernel_blocks, geometry.kernel_block, geometry.heads, HEAD_SIZE)
    nbytes = math.prod(shape) * DTYPE.itemsize
    caches = {
        f"model.layers.{i}.self_attn.attn": tuple(
            allocate_int8_cache_tensor(nbytes).view(DTYPE).view(shape) for _ in ("k", "v")
        )
        for i in range(geometry.layers)
    }
    return caches, _token_major_locate(geometry)


def combined_gqa_v030(geometry: Geometry, *, hnd: bool = False) -> tuple[dict[str, Cache], Locate]:
    """0.30.0rc2's default GQA cache: one raw allocation per layer (``raw_kv_is_combined``,
    l.5645-5653) viewed through ``AscendAttentionBackend.get_kv_cache_shape`` (attention_v1.py
    l.109-118: ``(2, num_blocks, block_size, H, D)``, or ``(2, num_blocks, H, block_size, D)``
    when ``VLLM_KV_CACHE_LAYOUT`` is ``HND``/``LBHNC``) with strides ``(hidden, 2 * hidden,
    ...dense)`` (l.5724-5745): block ``i``'s K and V are adjacent, ``[K_i | V_i]``; the layer
    is handed over as ``(kv_cache[0], kv_cache[1])``."""
    inner = (
        (geometry.heads, geometry.kernel_block, HEAD_SIZE)
        if hnd
        else (geometry.kernel_block, geometry.heads, HEAD_SIZE)
    )
    shape = (2, geometry.kernel_blocks, *inner)
    hidden = math.prod(shape[2:])
    dense = [math.prod(shape[dim + 1 :]) for dim in range(len(shape))]
    caches = {}
    for i in range(geometry.layers):
        raw = allocate_int8_cache_tensor(math.prod(shape) * DTYPE.itemsize).view(DTYPE)
        kv = torch.as_strided(
            raw,
            size=shape,
            stride=(hidden, 2 * hidden, *dense[2:]),
            storage_offset=raw.storage_offset(),
        )
        caches[f"model.layers.{i}.self_attn.attn"] = (kv[0], kv[1])
    return caches, _head_major_locate(geometry) if hnd else _token_major_locate(geometry)


def _token_major_locate(geometry: Geometry) -> Locate:
    def locate(cache: Cache, part: int, block_id: int, token: int, head: int = 0):
        kernel, slot = _kernel_slot(geometry, block_id, token)
        return cache[part], (kernel, slot, head)

    return locate


def _head_major_locate(geometry: Geometry) -> Locate:
    def locate(cache: Cache, part: int, block_id: int, token: int, head: int = 0):
        kernel, slot = _kernel_slot(geometry, block_id, token)
        return cache[part], (kernel, head, slot)

    return locate


def mla(geometry: Geometry, widths: tuple[int, ...], *, shared_tail: bool = False):
    """vllm-ascend's MLA cache: per layer one ``[num_blocks, block_size, 1, width]`` tensor per
    latent part, each its own raw allocation (0.30.0rc2 l.5252-5300: ``nope`` = ``kv_lora_rank``,
    ``rope`` = ``qk_rope_head_dim``; ``AscendMLABackend.get_kv_cache_shape`` gives the 4-D
    form). DeepSeek V3.2 on 0.23.0.post1 adds the indexer's keys, and with its C8 indexer their
    scales, in one tuple (l.4286-4300); ``shared_tail``: the keys and scales are two views of one
    raw allocation (``_allocate_sparse_c8_indexer_tensors``, 0.30.0rc2 l.4891-4944)."""
    caches = {}
    for i in range(geometry.layers):
        parts = []
        sizes = [
            geometry.kernel_blocks * geometry.kernel_block * w * DTYPE.itemsize for w in widths
        ]
        if shared_tail:
            head = [allocate_int8_cache_tensor(n) for n in sizes[:-2]]
            tail = allocate_int8_cache_tensor(sizes[-2] + sizes[-1])
            raws = [*head, tail[: sizes[-2]], tail[sizes[-2] :]]
        else:
            raws = [allocate_int8_cache_tensor(n) for n in sizes]
        for raw, width in zip(raws, widths, strict=True):
            parts.append(
                raw.view(DTYPE).view(geometry.kernel_blocks, geometry.kernel_block, 1, width)
            )
        caches[f"model.layers.{i}.self_attn.attn"] = tuple(parts)

    def locate(cache: Cache, part: int, block_id: int, token: int, head: int = 0):
        kernel, slot = _kernel_slot(geometry, block_id, token)
        return cache[part], (kernel, slot, 0)

    return caches, locate


# --- registration for npu ------------------------------------------------------------------------


class _StubEngine:
    """Stands in for Mooncake's ``TransferEngine`` (no NPU here): records registrations."""

    def __init__(self) -> None:
        self.registered: list[tuple[int, int]] = []

    def initialize(self, *args: object) -> int:
        return 0

    def get_rpc_port(self) -> int:
        return 12345

    def batch_register_memory(self, addrs: list[int], lengths: list[int]) -> int:
        self.registered.extend(zip(addrs, lengths, strict=True))
        return 0


@pytest.fixture
def npu_transport(monkeypatch):
    """A real :class:`MooncakeTransport` for ``npu`` over a stub engine."""
    module = SimpleNamespace(TransferEngine=_StubEngine)
    monkeypatch.setattr(mooncake_module, "require_mooncake_engine", lambda: module)
    return lambda: mooncake_module.MooncakeTransport(
        "127.0.0.1", "ascend", device_type="npu", read_wait="sync"
    )


# --- the cases -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    is_mla: bool
    build: Callable[[Geometry], tuple[dict[str, Cache], Locate]]
    parts: int  # tensors per layer
    head_major: bool = False
    kernel_block: int = 32  # tokens per kernel block; the engine's block may be larger


CASES = [
    Case("0.23-split-gqa", False, split_gqa_v023, 2),
    Case("0.30-combined-gqa", False, combined_gqa_v030, 2),
    Case("0.30-hnd", False, lambda g: combined_gqa_v030(g, hnd=True), 2, head_major=True),
    Case("0.30-mla", True, lambda g: mla(g, (NOPE, ROPE)), 2),
    Case("0.23-dsv32", True, lambda g: mla(g, (NOPE, ROPE, INDEXER)), 3),
    Case("0.23-dsv32-c8", True, lambda g: mla(g, (NOPE, ROPE, INDEXER, 1), shared_tail=True), 4),
]
#: (prefill TP, decode TP, KV heads): merges, slices and TP > KV heads on either side.
TP_PAIRS = [(1, 2, 4), (2, 1, 4), (4, 1, 4), (1, 4, 4), (1, 4, 2), (4, 1, 2), (2, 2, 4)]
#: (engine block, kernel block) per side: equal, and Ascend's 128-token kernel under
#: ``--block-size 256`` (scaled down: 64 on 32) on prefill, decode or both.
BLOCK_SIZES = [
    ((32, 32), (32, 32)),
    ((64, 32), (32, 32)),
    ((32, 32), (64, 32)),
    ((64, 32), (64, 32)),
]


def _regions(case: Case, caches: dict[str, Cache], heads: int, block_size: int):
    return regions_from_split_caches(
        caches,
        num_kv_heads=1 if case.is_mla else heads,
        block_size=block_size,
        head_size=HEAD_SIZE,
        is_mla=case.is_mla,
        head_major=case.head_major,
    )


def _pull_and_compare(case: Case, prefill_tp: int, decode_tp: int, heads: int, sizes, seed: int):
    (p_block, p_kernel), (d_block, d_kernel) = sizes
    rng = np.random.default_rng(seed)
    layers, num_tokens = 2, 3 * max(p_block, d_block) - 5
    global_heads = 1 if case.is_mla else heads
    # the prompt's values: [layer][part][token][head][width]
    widths = [
        t.shape[-1]
        for t in case.build(Geometry(1, 1, 1, p_kernel, p_kernel))[0][
            "model.layers.0.self_attn.attn"
        ]
    ]
    values = [
        [torch.randn(num_tokens, global_heads, w, dtype=torch.float32).to(DTYPE) for w in widths]
        for _ in range(layers)
    ]
    p_ids = [int(b) for b in rng.permutation(12)[: -(-num_tokens // p_block)]]
    d_ids = [int(b) for b in rng.permutation(12)[: -(-num_tokens // d_block)]]

    def side(tp: int, block: int, kernel: int, rank: int):
        own = owned_heads(global_heads, tp, rank, case.is_mla)
        geometry = Geometry(layers, len(own), 12, block, kernel)
        caches, locate = case.build(geometry)
        return own, caches, locate, _regions(case, caches, len(own), block)

    topology = TransferTopology(global_heads, prefill_tp, decode_tp, is_mla=case.is_mla)
    prefills = {}
    for rank in range(prefill_tp):
        own, caches, locate, regions = side(prefill_tp, p_block, p_kernel, rank)
        for layer, cache in enumerate(caches.values()):
            for part in range(case.parts):
                for t in range(num_tokens):
                    for local, head in enumerate(own):
                        tensor, index = locate(cache, part, p_ids[t // p_block], t % p_block, local)
                        tensor[index] = values[layer][part][t, head]
        transport = InProcessTransport()
        transport.register(kv_memory_ranges([t for c in caches.values() for t in c]))
        prefills[rank] = (transport, regions, caches)
    for rank in range(decode_tp):
        own, caches, locate, regions = side(decode_tp, d_block, d_kernel, rank)
        tensors = [t for c in caches.values() for t in c]
        staging = torch.zeros(1 << 22, dtype=torch.uint8)
        transport = InProcessTransport()
        transport.register(kv_memory_ranges([*tensors, staging]))
        memory = LocalMemory.from_tensors([*tensors, staging])
        pulls = topology.pulls_for(rank, seed)
        remote = {pull.prefill_rank: prefills[pull.prefill_rank][1] for pull in pulls}
        plan = plan_request(
            topology,
            rank,
            seed,
            regions,
            remote,
            d_ids,
            p_ids,
            PlanOptions(staging=StagingArea(staging.data_ptr(), staging.numel())),
            num_tokens=num_tokens,
        )
        for peer in plan.peers:
            session = prefills[peer.prefill_rank][0].session
            for batch in peer.batches:
                transport.read(session, batch.local_addrs, batch.remote_addrs, batch.lengths)
                apply_row_copies(memory, batch.after_landing)
        apply_swaps(memory, plan.fixups)
        for layer, cache in enumerate(caches.values()):
            for part in range(case.parts):
                for t in range(num_tokens):
                    for local, head in enumerate(own):
                        tensor, index = locate(cache, part, d_ids[t // d_block], t % d_block, local)
                        expected = values[layer][part][t, head]
                        assert torch.equal(tensor[index], expected), (
                            f"decode rank {rank}, layer {layer}, part {part}, token {t}, "
                            f"head {head}"
                        )
        transport.close()
    for transport, _, _ in prefills.values():
        transport.close()


#: MLA has no heads: three TP pairs cover its replication.
MLA_TP_PAIRS = [(1, 2, 4), (2, 1, 4), (4, 1, 4)]
PULLS = [
    pytest.param(
        case,
        tp,
        sizes,
        id=f"{case.name}-{tp[0]}to{tp[1]}-h{tp[2]}-p{sizes[0][0]}k{sizes[0][1]}"
        f"-d{sizes[1][0]}k{sizes[1][1]}",
    )
    for case in CASES
    for tp in (MLA_TP_PAIRS if case.is_mla else TP_PAIRS)
    for sizes in BLOCK_SIZES
]


@pytest.mark.parametrize("case,tp,sizes", PULLS)
def test_vllm_ascend_caches_pull_byte_exact(case: Case, tp, sizes) -> None:
    prefill_tp, decode_tp, heads = tp
    _pull_and_compare(case, prefill_tp, decode_tp, heads, sizes, seed=prefill_tp * 10 + decode_tp)


def test_deepseek_v32_indexer_as_its_own_layer_is_a_latent_region() -> None:
    """vllm-ascend 0.30.0rc2 gives DeepSeek V3.2's indexer keys a layer of their own
    (``...indexer.k_cache``), one tensor rather than a tuple."""
    geometry = Geometry(layers=1, heads=1, engine_blocks=2, block_size=32, kernel_block=32)
    caches, _ = mla(geometry, (NOPE, ROPE))
    (indexer,) = mla(geometry, (INDEXER,))[0].values()
    caches["model.layers.0.self_attn.indexer.k_cache"] = indexer[0]
    regions = _regions(CASES[3], caches, 1, 32)
    assert [r.name.rsplit(".", 1)[-1] for r in regions] == ["nope", "rope", "k_cache"]
    assert {r.layout.block_order for r in regions} == {BlockOrder.LATENT}
    assert regions[-1].layout.head_token_bytes == INDEXER * DTYPE.itemsize


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_registration_for_npu_takes_the_views_spans_merged_per_storage(case, npu_transport) -> None:
    """What vllm-ascend's allocations hand over registers on ``npu``: the views' spans (2 MiB
    aligned, as vllm-ascend aligned them), one range per raw allocation, never the unaligned
    storage around them."""
    caches, _ = case.build(
        Geometry(layers=3, heads=2, engine_blocks=5, block_size=64, kernel_block=32)
    )
    tensors = [t for c in caches.values() for t in c]
    transport = npu_transport()
    registered = transport.register(kv_memory_ranges(tensors))
    allocations = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(registered) == len(allocations)
    for memory in registered:
        assert memory.addr % ALIGNMENT == 0  # where vllm-ascend aligned it
        assert memory.addr not in allocations  # the view, not the padded storage
    for tensor in tensors:
        start, end = tensor.data_ptr(), tensor[-1].data_ptr() + tensor[-1].nbytes
        assert any(m.addr <= start and end <= m.end for m in registered), "a view is not covered"
    assert transport._engine.registered == [(m.addr, m.length) for m in registered]


def test_the_largest_models_register_well_under_vllm_ascends_region_budget(npu_transport) -> None:
    """126 layers of 0.23's split K/V (two allocations a layer) plus decode's staging buffer:
    253 registrations, under the 256 vllm-ascend's own connectors allow themselves
    (``MAX_HCCL_REGISTER_REGIONS``, ``distributed/kv_transfer/utils/utils.py``)."""
    caches, _ = split_gqa_v023(
        Geometry(layers=126, heads=1, engine_blocks=1, block_size=32, kernel_block=32)
    )
    staging = allocate_int8_cache_tensor(1 << 16)
    tensors = [t for c in caches.values() for t in c]
    registered = npu_transport().register(kv_memory_ranges([*tensors, staging]))
    assert len(registered) == 253


@pytest.mark.parametrize("block_size,kernel", [(256, 128), (64, 32)])
def test_a_larger_engine_block_is_described_in_kernel_blocks(block_size, kernel) -> None:
    """``--block-size 256`` on Ascend's 128-token kernel: the tensors hold twice as many
    128-token blocks, and each engine block is two of them."""
    geometry = Geometry(
        layers=1, heads=2, engine_blocks=3, block_size=block_size, kernel_block=kernel
    )
    caches, _ = combined_gqa_v030(geometry)
    case = CASES[1]
    k, _ = _regions(case, caches, 2, block_size)
    assert k.layout.kernel_blocks == block_size // kernel and k.layout.tokens_per_block == kernel
    assert k.layout.num_blocks == 3 * block_size // kernel
    assert k.layout.block_order is BlockOrder.TOKEN_MAJOR


def test_hnd_views_are_head_major_and_nhd_token_major() -> None:
    geometry = Geometry(layers=1, heads=4, engine_blocks=2, block_size=32, kernel_block=32)
    hnd = _regions(CASES[2], combined_gqa_v030(geometry, hnd=True)[0], 4, 32)
    nhd = _regions(CASES[1], combined_gqa_v030(geometry)[0], 4, 32)
    assert {r.layout.block_order for r in hnd} == {BlockOrder.HEAD_MAJOR}
    assert {r.layout.block_order for r in nhd} == {BlockOrder.TOKEN_MAJOR}
    # as many heads as tokens per block: the shape reads both ways, the layout variable decides
    square = Geometry(layers=1, heads=32, engine_blocks=2, block_size=32, kernel_block=32)
    hnd_square = _regions(CASES[2], combined_gqa_v030(square, hnd=True)[0], 32, 32)
    assert {r.layout.block_order for r in hnd_square} == {BlockOrder.HEAD_MAJOR}


def _with_draft_layer(draft_heads: int) -> tuple[dict[str, Cache], dict[str, SimpleNamespace]]:
    """Two model layers of 4 KV heads and an MTP/EAGLE draft layer (numbered past them, as
    vLLM numbers its draft layers) of ``draft_heads``, with the attention layers vLLM built."""
    main, _ = combined_gqa_v030(
        Geometry(layers=2, heads=4, engine_blocks=2, block_size=32, kernel_block=32)
    )
    draft, _ = combined_gqa_v030(
        Geometry(layers=1, heads=draft_heads, engine_blocks=2, block_size=32, kernel_block=32)
    )
    caches = {**main, "model.layers.2.mtp.attn": next(iter(draft.values()))}
    layers = {name: SimpleNamespace(num_kv_heads=4, head_size=HEAD_SIZE) for name in main}
    layers["model.layers.2.mtp.attn"] = SimpleNamespace(
        num_kv_heads=draft_heads, head_size=HEAD_SIZE
    )
    return caches, layers


def _draft_registration(caches, layers, topology: TransferTopology, draft_kv_heads: int):
    """What the worker does at registration: find the draft layers, read every layer's
    geometry, check it against the topology and describe the regions."""
    drafts = draft_layer_names(caches, layers, target_layers=2)
    geometry = attention_geometry(
        caches, layers, default=LayerGeometry(4, HEAD_SIZE), is_mla=False, draft_layers=drafts
    )
    check_planned_heads(geometry, topology, False, topology.decode_tp, draft_kv_heads)
    return regions_from_split_caches(
        caches,
        num_kv_heads=geometry.num_kv_heads,
        block_size=32,
        head_size=HEAD_SIZE,
        is_mla=False,
        layer_heads=draft_layer_heads(geometry, topology, draft_kv_heads),
    )


def test_a_draft_layer_with_its_own_kv_head_count_is_accepted_and_planned() -> None:
    """An MTP/EAGLE draft layer whose KV-head count differs from the model's (vllm-ascend PR
    #11886) is a head group of its own: its regions name it and are planned with its pulls."""
    caches, layers = _with_draft_layer(draft_heads=1)
    topology = TransferTopology(4, 1, 1, extra_kv_heads=(1,))
    regions = _draft_registration(caches, layers, topology, draft_kv_heads=1)
    assert [(r.name, r.layout.num_heads, r.layout.kv_heads) for r in regions[-2:]] == [
        ("model.layers.2.mtp.attn.k", 1, 1),
        ("model.layers.2.mtp.attn.v", 1, 1),
    ]
    assert {r.layout.kv_heads for r in regions[:-2]} == {0}
    plan = plan_request(topology, 0, 0, regions, {0: regions}, [1], [0])
    k, v = regions[-2:]
    expected = {k.layout.block_len, v.layout.block_len}
    draft_reads = [
        int(n)
        for b in plan.peers[0].batches
        for addr, n in zip(b.local_addrs, b.lengths, strict=True)
        if addr in (k.block_addr(1), v.block_addr(1))
    ]
    assert set(draft_reads) == expected  # one block of the draft's one head per region


def test_a_draft_layer_contradicting_its_groups_total_is_refused_naming_it() -> None:
    """A draft layer holding 2 heads on this rank where the draft config's 1 KV head over TP 1
    gives 1: refused at start-up, naming the layer."""
    caches, layers = _with_draft_layer(draft_heads=2)
    topology = TransferTopology(4, 1, 1, extra_kv_heads=(1,))
    with pytest.raises(LayoutError, match=r"draft layer model\.layers\.2\.mtp\.attn holds 2"):
        _draft_registration(caches, layers, topology, draft_kv_heads=1)


def test_context_parallelism_is_refused_at_start_up() -> None:
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        with pytest.raises(LayoutError, match=f"--{name.replace('_', '-')} 1"):
            refuse_unsupported_parallelism(SimpleNamespace(**{name: 2}))
    refuse_unsupported_parallelism(SimpleNamespace())  # vLLM 0.23 has neither: nothing to refuse


def test_a_hybrid_models_state_layer_is_refused_naming_hybrid() -> None:
    """vLLM's Mamba and linear-attention layers derive from ``MambaBase``; a class of that name
    stands in for one here (building a real GDN layer needs a whole hybrid model)."""

    class MambaBase:  # the name vLLM's state layers share (model_executor/layers/mamba/abstract.py)
        pass

    class GatedDeltaNetAttention(MambaBase):
        pass

    caches = {"model.layers.0.linear_attn": [torch.zeros(2, 4), torch.zeros(2, 8)]}
    with pytest.raises(LayoutError, match=r"linear_attn.*hybrid models"):
        refuse_hybrid_layers(caches, {"model.layers.0.linear_attn": GatedDeltaNetAttention()})


def test_memory_ranges_never_merge_two_allocations() -> None:
    """Adjacent allocations stay two registrations: a device registration must not span two."""
    raw = torch.zeros(2 * 4096, dtype=torch.int8)
    a, b = raw[:4096].clone(), raw[4096:].clone()
    ranges = kv_memory_ranges([a, b])
    assert sorted(ranges, key=lambda m: m.addr) == sorted(
        [MemoryRange(a.data_ptr(), 4096), MemoryRange(b.data_ptr(), 4096)], key=lambda m: m.addr
    )


def test_an_unaligned_npu_range_is_registered_with_a_warning(npu_transport, caplog) -> None:
    """Mooncake refuses none (its docs ask for 2 MiB-aligned addresses under HCCS): the range is
    registered and the operator told."""
    raw = torch.zeros(3 * ALIGNMENT, dtype=torch.int8)
    aligned = allocate_int8_cache_tensor(4096)
    unaligned = raw[(ALIGNMENT - raw.data_ptr() % ALIGNMENT) + 512 :][:4096]
    transport = npu_transport()
    with caplog.at_level("WARNING"):
        transport.register(kv_memory_ranges([aligned]))
    assert "2 MiB" not in caplog.text
    with caplog.at_level("WARNING"):
        registered = transport.register(kv_memory_ranges([unaligned]))
    assert registered == [MemoryRange(unaligned.data_ptr(), 4096)]
    assert "start off a 2 MiB boundary" in caplog.text
