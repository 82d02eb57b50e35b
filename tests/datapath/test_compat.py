"""Handshake compatibility: every mismatch is refused with both values named."""

from __future__ import annotations

import msgspec
import pytest

from vam_testing.datapath_cases import worker_metadata
from vllm_ascend_mooncake.core.layout import BlockOrder, Region, RegionLayout
from vllm_ascend_mooncake.core.packing import chunk_packing
from vllm_ascend_mooncake.core.topology import TransferTopology
from vllm_ascend_mooncake.datapath.compat import IncompatiblePeerError, check_peer
from vllm_ascend_mooncake.datapath.wire import ModelIdentity, WorkerMetadata

IDENTITY = ModelIdentity("tiny", "float32", "auto", 32, 64, 4, 2, False)


def metadata(
    heads: int,
    tp: int,
    *,
    identity=IDENTITY,
    order=BlockOrder.HEAD_MAJOR,
    names=("a", "b"),
    tokens=32,
    packing=(),
    draft: tuple[int, int] | None = None,
) -> WorkerMetadata:
    """``draft``: the last region is a draft layer's, (heads held, its group's total)."""
    layout = RegionLayout(order, 8, heads * tokens * 256, heads, tokens, 256, packing=packing)
    layouts = [layout] * len(names)
    if draft is not None:
        held, total = draft
        layouts[-1] = RegionLayout(
            order, 8, held * tokens * 256, held, tokens, 256, packing=packing, kv_heads=total
        )
    regions = [
        Region(n, 4096 * i, lay) for i, (n, lay) in enumerate(zip(names, layouts, strict=True))
    ]
    return worker_metadata(regions, identity=identity, tp_size=tp)


TOPO = TransferTopology(4, 2, 1)


def test_compatible_pair_passes() -> None:
    check_peer(metadata(4, 1), metadata(2, 2), TOPO)


@pytest.mark.parametrize(
    "remote,message",
    [
        (
            metadata(2, 2, identity=msgspec.structs.replace(IDENTITY, dtype="bfloat16")),
            "dtype 'bfloat16' on prefill vs 'float32' on decode",
        ),
        (
            metadata(2, 2, identity=msgspec.structs.replace(IDENTITY, model_config="cafe")),
            "model_config 'cafe' on prefill vs '' on decode; prefill serves 'tiny'",
        ),
        (
            metadata(2, 2, identity=msgspec.structs.replace(IDENTITY, attention_backend="X/amx")),
            "attention_backend 'X/amx' on prefill vs '' on decode",
        ),
        (
            metadata(2, 2, identity=msgspec.structs.replace(IDENTITY, vllm_version="0.1")),
            "vllm_version '0.1' on prefill",
        ),
        (
            metadata(1, 4),
            "prefill runs TP 4 but this decode instance is configured for prefill TP 2",
        ),
        (metadata(2, 2, names=("a",)), "1 KV regions on prefill vs 2 on decode"),
        (metadata(2, 2, names=("b", "a")), "different layer order"),
        (metadata(2, 2, order=BlockOrder.TOKEN_MAJOR), "block order token_major on prefill"),
        (metadata(3, 2), "holds 3 heads on prefill and 4 on decode"),
    ],
)
def test_mismatches_are_named(remote, message) -> None:
    with pytest.raises(IncompatiblePeerError, match=message):
        check_peer(metadata(4, 1), remote, TOPO)


def test_a_draft_layers_regions_are_checked_against_their_own_head_group() -> None:
    """The model's 4 heads and a draft's 2 at prefill TP 2 -> decode TP 1: the draft region holds
    1 head on prefill and 2 on decode; a draft region of another group, or holding heads its
    group does not give, is refused naming the region."""
    topology = TransferTopology(4, 2, 1, extra_kv_heads=(2,))
    check_peer(metadata(4, 1, draft=(2, 2)), metadata(2, 2, draft=(1, 2)), topology)
    with pytest.raises(IncompatiblePeerError, match=r"region b's layer has 4 KV heads on prefill"):
        check_peer(metadata(4, 1, draft=(2, 2)), metadata(2, 2), topology)
    with pytest.raises(IncompatiblePeerError, match="region b holds 2 heads on prefill and 2"):
        check_peer(metadata(4, 1, draft=(2, 2)), metadata(2, 2, draft=(2, 2)), topology)
    with pytest.raises(IncompatiblePeerError, match="region b: no head group of 3 KV heads"):
        check_peer(metadata(4, 1, draft=(2, 2)), metadata(2, 2, draft=(1, 3)), topology)


def test_the_served_name_alone_may_differ() -> None:
    renamed = msgspec.structs.replace(IDENTITY, model="/models/tiny-on-another-host")
    check_peer(metadata(4, 1), metadata(2, 2, identity=renamed), TOPO)


MLA_IDENTITY = ModelIdentity("deepseek", "bfloat16", "auto", 16, 576, 1, 2, True)


def ascend_mla_metadata(tp: int, widths=(512, 64)) -> WorkerMetadata:
    """vllm-ascend MLA: per layer a nope and a rope latent region of different widths."""
    regions = []
    for layer in range(2):
        for part, width in zip(("nope", "rope"), widths, strict=True):
            layout = RegionLayout(BlockOrder.LATENT, 8, 16 * width * 2, 1, 16, width * 2)
            regions.append(Region(f"layer.{layer}.{part}", 1 << (20 + len(regions)), layout))
    return worker_metadata(regions, identity=MLA_IDENTITY, tp_size=tp)


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2), (2, 4)])
def test_mla_regions_of_different_widths_in_one_layer_pair_region_by_region(
    prefill_tp, decode_tp
) -> None:
    topology = TransferTopology(1, prefill_tp, decode_tp, is_mla=True)
    check_peer(ascend_mla_metadata(decode_tp), ascend_mla_metadata(prefill_tp), topology)
    narrower_rope = ascend_mla_metadata(prefill_tp, widths=(512, 32))
    with pytest.raises(
        IncompatiblePeerError, match=r"layer\.0\.rope: 64 B per head per token on prefill vs 128 B"
    ):
        check_peer(ascend_mla_metadata(decode_tp), narrower_rope, topology)


def test_token_major_blocks_of_divisible_sizes_pass() -> None:
    """Prefill 32, decode 64 tokens per block: accepted for token-major blocks."""
    decode = metadata(
        4,
        1,
        identity=msgspec.structs.replace(IDENTITY, block_size=64),
        order=BlockOrder.TOKEN_MAJOR,
        tokens=64,
    )
    check_peer(decode, metadata(2, 2, order=BlockOrder.TOKEN_MAJOR), TOPO)


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_head_major_blocks_of_divisible_sizes_pass_when_both_sides_send_their_packing(isa) -> None:
    """vLLM CPU, prefill 32 / decode 64: the packing travels in each region's wire description
    and must be the same on both sides; a prefill that does not send it (an older version) is
    refused naming the unknown packing."""
    cpu = msgspec.structs.replace(IDENTITY, attention_backend=f"CPU_ATTN/{isa}")
    packing = chunk_packing(f"CPU_ATTN/{isa}", "auto", 64, 2)  # 256 B per head and token
    decode = metadata(
        4,
        1,
        identity=msgspec.structs.replace(cpu, block_size=64),
        tokens=64,
        packing=packing,
    )
    prefill = metadata(2, 2, identity=cpu, packing=packing)
    assert prefill.to_regions()[0].layout.packing == packing
    check_peer(decode, prefill, TOPO)
    with pytest.raises(IncompatiblePeerError, match="packing is unknown on prefill"):
        check_peer(decode, metadata(2, 2, identity=cpu), TOPO)


@pytest.mark.parametrize(
    "decode_block,order,message",
    [
        (64, BlockOrder.HEAD_MAJOR, "block size 32 on prefill vs 64 on decode with head-major"),
        (48, BlockOrder.TOKEN_MAJOR, "block_size 32 on prefill vs 48 on decode: neither divides"),
    ],
)
def test_block_sizes_that_cannot_be_mapped_are_named(decode_block, order, message) -> None:
    decode = metadata(
        4,
        1,
        identity=msgspec.structs.replace(IDENTITY, block_size=decode_block),
        order=order,
        tokens=decode_block,
    )
    with pytest.raises(IncompatiblePeerError, match=message):
        check_peer(decode, metadata(2, 2, order=order), TOPO)


@pytest.mark.parametrize(
    "field",
    [f for f in ModelIdentity.__struct_fields__ if f not in ("model", "block_size")],
)
def test_every_identity_field_that_differs_is_refused_naming_both_values_and_the_fix(
    field,
) -> None:
    """Issue #26 item 4: one refusal per identity field, each with both sides' values and what
    to change (the flag, or "the same model")."""
    value = getattr(IDENTITY, field)
    other = (
        (not value) if isinstance(value, bool) else (value + 1 if isinstance(value, int) else "x")
    )
    remote = metadata(2, 2, identity=msgspec.structs.replace(IDENTITY, **{field: other}))
    with pytest.raises(IncompatiblePeerError) as refused:
        check_peer(metadata(4, 1), remote, TOPO)
    message = str(refused.value)
    assert f"{field} {other!r} on prefill vs {value!r} on decode" in message
    assert "start both instances with the same " in message


def test_prefill_pipeline_parallelism_is_refused() -> None:
    remote = msgspec.structs.replace(metadata(2, 2), pp_size=2)
    with pytest.raises(IncompatiblePeerError, match="pipeline parallelism 2 is not supported"):
        check_peer(metadata(4, 1), remote, TOPO)
