"""vLLM general plugin: make the connector available by name in every vLLM process.

Installed through the ``vllm.general_plugins`` entry point, which vLLM loads in the CLI, the engine
core and every worker before configs are built. Registration is lazy (vLLM imports the module only
when the connector is used) and idempotent, because vLLM may load plugins more than once. The name
differs from vLLM's own ``MooncakeConnector`` and vllm-ascend's ``MooncakeConnectorV1``.
Loading in every process is also where :mod:`.busy_wait` applies its opt-in setting.
"""

from __future__ import annotations

from ..names import CONNECTOR_NAME
from .busy_wait import apply_from_env

CONNECTOR_MODULE = "vllm_ascend_mooncake.connector"


def register() -> None:
    apply_from_env()  # opt-in (VAM_SHM_BUSY_WAIT_S): shorter busy-wait between vLLM processes
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
