"""Names shared by every layer and by the launchers that are not options: the connector's name
and the other connectors it reads keys of (the side-channel secret's environment variable is the
hand-off contract's: :data:`.handoff.SECRET_ENV`). Imports nothing, so that the ``vam-vllm``
wrapper can read it before vLLM (and torch) load."""

#: The name vLLM knows the connector by (``kv_connector``).
CONNECTOR_NAME = "MooncakeHeteroConnector"

#: The connectors whose keys are read under ours (:mod:`.connector.migration`).
VLLM_ASCEND = "vllm-ascend's MooncakeConnectorV1"
VLLM_MOONCAKE = "vLLM's MooncakeConnector"
