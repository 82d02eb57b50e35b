"""The connector is reachable by name (entry point) and by module path, and registers once."""

from __future__ import annotations

from importlib.metadata import entry_points

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from vllm_ascend_mooncake.connector.facade import MooncakeHeteroConnector
from vllm_ascend_mooncake.connector.plugin import register
from vllm_ascend_mooncake.names import CONNECTOR_NAME


def test_installed_as_a_vllm_general_plugin() -> None:
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins["vllm_ascend_mooncake"] == "vllm_ascend_mooncake.connector.plugin:register"


def test_registration_is_idempotent_and_does_not_clash() -> None:
    register()
    register()
    config = KVTransferConfig(kv_connector=CONNECTOR_NAME, kv_role="kv_consumer")
    assert KVConnectorFactory.get_connector_class(config) is MooncakeHeteroConnector
    assert CONNECTOR_NAME not in ("MooncakeConnector", "MooncakeConnectorV1")
    assert "MooncakeConnector" in KVConnectorFactory._registry  # vLLM's own is untouched


def test_module_path_works_without_the_plugin() -> None:
    config = KVTransferConfig(
        kv_connector=CONNECTOR_NAME,
        kv_connector_module_path="vllm_ascend_mooncake.connector",
        kv_role="kv_producer",
    )
    cls = KVConnectorFactory.get_connector_class(config)
    assert cls is MooncakeHeteroConnector and issubclass(cls, KVConnectorBase_V1)


def test_requests_the_head_major_layout() -> None:
    class Model:
        use_mla = False

    class Config:
        model_config = Model()

    assert MooncakeHeteroConnector.get_required_kvcache_layout(Config()) == "HND"
    Model.use_mla = True
    assert MooncakeHeteroConnector.get_required_kvcache_layout(Config()) is None


def test_the_requested_layout_name_is_head_major_in_this_vllm() -> None:
    """vLLM 0.23 knows only NHD/HND; 0.30+ resolve HND to LBHNC (vllm_compat.HEAD_MAJOR_LAYOUT).
    A cache config set to the name the connector asks for must resolve to the head-major layout
    the worker checks for."""
    from vllm.config import CacheConfig

    from vllm_ascend_mooncake.connector import vllm_compat

    cache = CacheConfig()
    cache.kv_cache_layout = vllm_compat.HEAD_MAJOR_LAYOUT  # as the engine core records it
    resolved = vllm_compat.resolved_kv_cache_layout(type("Config", (), {"cache_config": cache}))
    assert resolved == vllm_compat.RESOLVED_HEAD_MAJOR_LAYOUT
