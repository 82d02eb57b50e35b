"""The identity a worker advertises: what must match for KV bytes to mean the same."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_ascend_mooncake.connector.identity import attention_backend_label, model_config_digest

CONFIG = {"architectures": ["LlamaForCausalLM"], "num_key_value_heads": 2, "head_dim": 64}


def test_the_digest_ignores_where_the_model_lives_but_not_what_it_computes() -> None:
    here = {**CONFIG, "_name_or_path": "/models/a", "transformers_version": "5.19.0"}
    there = {**CONFIG, "_name_or_path": "/srv/b", "transformers_version": "5.2.0"}
    assert model_config_digest(here) == model_config_digest(there)
    assert model_config_digest(CONFIG) != model_config_digest({**CONFIG, "head_dim": 128})


class _Backend:
    def __init__(self, name: str) -> None:
        self._name = name

    def get_name(self) -> str:
        return self._name


def test_the_backend_label_names_the_cpu_packing() -> None:
    amx = SimpleNamespace(attn_backend=_Backend("CPU_ATTN"), isa="amx")
    vec = SimpleNamespace(attn_backend=_Backend("CPU_ATTN"), isa="vec")
    flash = SimpleNamespace(attn_backend=_Backend("FLASH_ATTN"))
    assert attention_backend_label([amx, amx]) == "CPU_ATTN/amx"
    assert attention_backend_label([vec]) != attention_backend_label([amx])
    assert attention_backend_label([flash, SimpleNamespace()]) == "FLASH_ATTN"


def test_a_cpu_layer_without_an_isa_has_no_known_packing() -> None:
    """vLLM 0.23's CPU attention never sets ``layer.isa``: the label is the bare backend, whose
    chunk packing is unknown, so only equal block sizes pair (refused at the handshake)."""
    from vllm_ascend_mooncake.core.packing import chunk_packing

    label = attention_backend_label([SimpleNamespace(attn_backend=_Backend("CPU_ATTN"))])
    assert label == "CPU_ATTN"
    assert chunk_packing(label, "auto", 64, 4) == ()
    assert chunk_packing("CPU_ATTN/vec", "auto", 64, 4) != ()
