"""Names shared by every layer and by the launchers that are not options: the connector's name,
the other connectors it reads keys of, and the environment variable of the side-channel secret.
Imports nothing, so that the ``vam-vllm`` wrapper can read it before vLLM (and torch) load."""

#: The name vLLM knows the connector by (``kv_connector``).
CONNECTOR_NAME = "MooncakeHeteroConnector"

#: The connectors whose keys are read under ours (:mod:`.connector.migration`).
VLLM_ASCEND = "vllm-ascend's MooncakeConnectorV1"
VLLM_MOONCAKE = "vLLM's MooncakeConnector"

#: Where the side-channel secret is read from when kv_connector_extra_config does not set it
#: (an environment variable keeps it out of command lines and process listings).
SECRET_ENV = "VAM_SIDE_CHANNEL_SECRET"
