"""What vLLM sees: the connector facade, its scheduler and worker sides, config and params.

``vllm_ascend_mooncake.connector`` is also the module path users may give vLLM
(``kv_connector_module_path``), so the package exports ``MooncakeHeteroConnector``; it is imported
on first use only, so that reading the config or params does not import vLLM's engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .facade import MooncakeHeteroConnector as MooncakeHeteroConnector

__all__ = ["MooncakeHeteroConnector"]


def __getattr__(name: str) -> Any:
    if name == "MooncakeHeteroConnector":
        from .facade import MooncakeHeteroConnector

        return MooncakeHeteroConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
