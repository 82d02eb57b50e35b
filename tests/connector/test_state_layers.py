"""A worker's Gated DeltaNet state layers described from what vLLM CPU hands over (int8 pages
``[num_blocks, 1, 1, state_bytes]`` a padded page apart, aliased with the attention layers of
the same slot), as recorded for the tiny Qwen3-Next (docs/design/hma.md, section 2)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)

from vllm_ascend_mooncake.connector.kv_groups import transfer_group_specs
from vllm_ascend_mooncake.connector.state_layers import describe_state_groups
from vllm_ascend_mooncake.core.groups import GroupKind
from vllm_ascend_mooncake.core.layout import LayoutError

BLOCK, PAGE, BLOCKS = 128, 65536, 8
HF = SimpleNamespace(
    linear_num_key_heads=2,
    linear_key_head_dim=64,
    linear_num_value_heads=4,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
)


def config(tp: int, mode: str = "align") -> KVCacheConfig:
    state = MambaSpec(
        block_size=BLOCK,
        shapes=((3, 512 // tp), (4 // tp, 64, 64)),
        dtypes=(torch.bfloat16, torch.bfloat16),
        page_size_padded=PAGE // tp,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode=mode,
    )
    full = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=2 // tp, head_size=64, dtype=torch.bfloat16
    )
    return KVCacheConfig(
        num_blocks=BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["layers.0.linear_attn", "layers.2.linear_attn"], state),
            KVCacheGroupSpec(["layers.1.self_attn.attn", "layers.3.self_attn.attn"], full),
        ],
    )


def caches(tp: int) -> dict[str, torch.Tensor]:
    """Two layer slots of one buffer: a state layer and an attention layer alias each."""
    page = PAGE // tp
    content = (3 * 512 + 4 * 64 * 64) * 2 // tp
    buffer = torch.zeros(2 * BLOCKS * page, dtype=torch.int8)
    views = {}
    for slot, (state, attention) in enumerate([(0, 1), (2, 3)]):
        start = slot * BLOCKS * page
        views[f"layers.{state}.linear_attn"] = buffer[start:].as_strided(
            (BLOCKS, 1, 1, content), (page, content, content, 1)
        )
        views[f"layers.{attention}.self_attn.attn"] = (
            buffer[start : start + BLOCKS * page]
            .view(torch.bfloat16)
            .view(BLOCKS, 2 // tp, BLOCK, 128)
        )
    return views


@pytest.mark.parametrize("tp", [1, 2])
def test_state_pages_are_described_with_their_shards(tp: int) -> None:
    kv_config = config(tp)
    groups = transfer_group_specs(kv_config, BLOCK)
    assert [g.kind for g in groups] == [GroupKind.STATE, GroupKind.FULL]
    views = caches(tp)
    (state,) = describe_state_groups(views, kv_config, groups, HF, tp)
    assert state.group == 0 and state.names == ("layers.0.linear_attn", "layers.2.linear_attn")
    assert (state.layout.num_blocks, state.layout.block_stride) == (BLOCKS, PAGE // tp)
    conv, ssm = state.layout.components
    assert (conv.offset, ssm.offset) == (0, 3072 // tp)  # the recorded page offsets
    assert conv.nbytes(tp) + ssm.nbytes(tp) == 35840 // tp
    assert state.bases[0] == (views["layers.0.linear_attn"].data_ptr(),) * 2
    assert state.bases[0][0] == views["layers.1.self_attn.attn"].data_ptr()  # aliased slot


def test_a_state_outside_align_mode_is_refused_naming_the_mode() -> None:
    with pytest.raises(LayoutError, match="'none'"):
        transfer_group_specs(config(1, mode="none"), BLOCK)


def test_a_state_of_another_kind_is_refused() -> None:
    kv_config = config(1)
    groups = transfer_group_specs(kv_config, BLOCK)
    with pytest.raises(LayoutError, match="not Gated DeltaNet"):
        describe_state_groups(caches(1), kv_config, groups, SimpleNamespace(), 1)


def test_engine_shapes_that_the_config_does_not_give_are_refused() -> None:
    kv_config = config(1)
    groups = transfer_group_specs(kv_config, BLOCK)
    wrong = SimpleNamespace(**{**vars(HF), "linear_num_value_heads": 8})
    with pytest.raises(LayoutError, match="shapes"):
        describe_state_groups(caches(1), kv_config, groups, wrong, 1)
