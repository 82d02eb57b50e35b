"""vLLM defects that make answers wrong whatever the connector does, told at start-up.

The connector moves prefill's KV bytes exactly; where vLLM itself computes a model wrongly, P/D
and colocated answers differ and both are wrong, and an operator would blame the transfer. Each
check names the defect, the evidence and what to change; it reads the configuration only.
"""

from __future__ import annotations

from typing import Any


def rope_type(hf_config: Any) -> str | None:
    """The model's RoPE kind (``"default"`` for plain RoPE), from transformers' 5.x
    ``rope_parameters`` or the older ``rope_scaling`` (``None`` there means plain RoPE)."""
    parameters = getattr(hf_config, "rope_parameters", None) or getattr(
        hf_config, "rope_scaling", None
    )
    if not parameters:
        return "default"
    return parameters.get("rope_type") or parameters.get("type") or "default"


def mla_plain_rope_on_cpu(model_config: Any, device_type: str) -> str | None:
    """vLLM CPU's ``rotary_embedding`` op (plain RoPE, up to at least vLLM 0.32) reads MLA's
    strided ``q_pe``/``k_pe`` views as if they were contiguous rows: a prompt's cached ``k_pe``
    of token ``t`` is rotated for another token's position, so the answers are wrong, and
    prefill's whole-prompt forward and decode's one-token recompute are wrong differently
    (issue #26; tests/e2e/test_mla.py pins the op). Scaled RoPE (DeepSeek's YaRN, which every
    DeepSeek-V2/V3 checkpoint uses) is computed in PyTorch and is right."""
    if device_type != "cpu" or not getattr(model_config, "use_mla", False):
        return None
    kind = rope_type(model_config.hf_config)
    if kind != "default":
        return None
    return (
        "this MLA model uses plain RoPE, which vLLM CPU computes with its rotary_embedding op; "
        "up to at least vLLM 0.32 that op misaddresses MLA's strided q_pe/k_pe, so this "
        "model's answers are wrong colocated and differ between prefill and decode. The KV "
        "bytes are moved exactly. Serve a checkpoint with YaRN rope_scaling (as DeepSeek-V2/V3 "
        "ship) or check a newer vLLM with tests/e2e/test_mla.py::test_vllm_cpu_rope_op_on_mla_views"
    )
