"""The start-up warning for vLLM CPU's RoPE op on MLA models, read from real model configs (the
tiny DeepSeek-V2 with plain RoPE and with DeepSeek's YaRN, and a Llama) as transformers loads
them. The defect itself is pinned in tests/e2e/test_mla.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import AutoConfig

from vllm_ascend_mooncake.connector.vllm_defects import mla_plain_rope_on_cpu, rope_type
from vllm_ascend_mooncake.launch.tiny_mla_model import TinyMLAModelSpec
from vllm_ascend_mooncake.launch.tiny_model import TinyModelSpec, build_tiny_model


def model_config(spec, use_mla: bool) -> SimpleNamespace:
    """The two fields of vLLM's ModelConfig the check reads (a real hf_config)."""
    return SimpleNamespace(
        use_mla=use_mla, hf_config=AutoConfig.from_pretrained(build_tiny_model(spec))
    )


@pytest.mark.parametrize("rope,warned", [("default", True), ("yarn", False)])
def test_mla_with_plain_rope_is_warned_on_cpu_only(rope: str, warned: bool) -> None:
    config = model_config(TinyMLAModelSpec(rope=rope), use_mla=True)
    assert rope_type(config.hf_config) == ("default" if rope == "default" else "yarn")
    message = mla_plain_rope_on_cpu(config, "cpu")
    assert (message is not None) == warned
    if warned:
        assert "rotary_embedding" in message and "YaRN" in message
    assert mla_plain_rope_on_cpu(config, "cuda") is None
    assert mla_plain_rope_on_cpu(config, "npu") is None


def test_a_model_without_mla_is_not_warned() -> None:
    config = model_config(TinyModelSpec(), use_mla=False)
    assert rope_type(config.hf_config) == "default"
    assert mla_plain_rope_on_cpu(config, "cpu") is None
