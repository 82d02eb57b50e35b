"""Every default of ``kv_connector_extra_config``, defined once.

The configuration (:mod:`.connector.config`) applies them to the keys a user leaves out, and the
option objects of the lower layers (``core.plan.PlanOptions``,
``datapath.receiver.ReceiverOptions``, the transport) take theirs from here too, so the layers
agree without importing upward.
``docs/configuration.md`` shows them; ``tests/connector/test_config_docs.py`` checks that it does.
This module imports nothing.
"""

#: The name vLLM knows the connector by (``kv_connector``); here, not in ``connector.keys``, so
#: that the ``vam-vllm`` wrapper can look for it before vLLM (and torch) load.
CONNECTOR_NAME = "MooncakeHeteroConnector"

#: What moves the bytes (``transport``): ``datapath.transport.TRANSPORTS`` lists the choices.
DEFAULT_TRANSPORT = "mooncake"
#: Mooncake transports accepted as ``protocol``.
PROTOCOLS = ("tcp", "rdma", "ascend", "nvlink", "efa")
#: ``protocol`` per device type when the configuration does not name one ...
DEFAULT_PROTOCOLS = {"cpu": "tcp", "cuda": "rdma", "npu": "ascend"}
#: ... and for any other device type.
FALLBACK_PROTOCOL = "tcp"
#: How reads wait for completion (``read_wait``): see :mod:`.datapath.mooncake`.
READ_WAITS = ("poll", "sync")
DEFAULT_DEVICE_NAME = ""
DEFAULT_SIDE_CHANNEL_PORT = 36100
DEFAULT_RELEASE_TIMEOUT_S = 120.0
DEFAULT_SIDE_CHANNEL_TIMEOUT_S = 10.0
DEFAULT_CLAIM_WAIT_S = 10.0
DEFAULT_PREFILL_WAIT_S = 120.0
#: How long a decode worker's start-up waits for each prefill of ``prefill_side_channels`` to
#: answer before serving without it (prefill and decode are often started together, and a
#: prefill's side channel listens once its KV cache is allocated).
DEFAULT_PAIR_WAIT_S = 120.0
#: How long decode's scheduler holds a prefill engine's first request for the pairing probe
#: (``pair_before_pull``) before leaving the handshake to its pull. A prefill that answers does
#: so in milliseconds; one that does not (down, frozen) is left to the pull's own timeouts, as
#: before there was a probe: a request held longer could outlive prefill's hold on its KV
#: (``release_timeout_s``) while nobody renews it.
PAIRING_WAIT_S = 5.0
DEFAULT_READ_RETRIES = 1
DEFAULT_MAX_DESCRIPTORS_PER_BATCH = 1024
#: ``max_descriptor_kib`` over tcp; 0 (never split) on other transports.
TCP_MAX_DESCRIPTOR_KIB = 1024
DEFAULT_COALESCE_RUNS = True
#: ``block_reads_from_kib`` over tcp; 0 (never) on other transports.
TCP_BLOCK_READS_FROM_KIB = 256
DEFAULT_RECEIVER_THREADS = 4
DEFAULT_STAGING_BUFFER_MIB = 64
#: The staging buffer is split into up to this many areas of at least ``MIN_STAGING_AREA_MIB``,
#: one per request in flight: a request holds its area from planning to its report, so with
#: several areas the next request is planned and queued while one still reads.
MAX_STAGING_AREAS = 4
MIN_STAGING_AREA_MIB = 32
#: The longest a prefill may hold a decode's pending claim open (long poll), at most half of
#: ``side_channel_timeout_s`` (:attr:`.connector.config.ConnectorConfig.claim_park_s`).
DEFAULT_CLAIM_PARK_S = 1.0
#: In an engine step that runs no tokens, how long a worker waits for a transfer to end. vLLM
#: steps in a loop while a request only waits for KV (decode) or holds blocks for readers
#: (prefill); each step costs the engine core and the workers CPU (and a shared-memory
#: busy-wait), which on hosts where instances share cores is taken from the other instance's
#: forward. A transfer that ends wakes the wait at once; a request arriving meanwhile waits for
#: the step to end, so this bounds that delay too.
DEFAULT_IDLE_STEP_WAIT_MS = 10.0
#: After a read from a prefill never settled (a frozen peer), decode fails further reads from
#: that prefill at once for this long (its circuit is open), then tries one again: the pulls
#: queued for it end at once instead of each costing the read's timeouts and a quarantine.
PEER_COOLDOWN_S = 10.0
#: Each further read in a row that never settles doubles the cool-down, up to this: a prefill
#: whose data path stays frozen while its side channel answers costs one quarantined read (its
#: decode blocks and a staging area, kept until restart) per this long, not per 10 s plus the
#: read's timeouts. A read that lands, or a new incarnation of the peer, ends the back-off.
PEER_COOLDOWN_MAX_S = 640.0
#: Before vLLM's sleep mode discards the KV cache, the longest a decode worker waits for its reads
#: under way to settle (Mooncake's own transfer timeout, ``MC_TRANSFER_TIMEOUT``, is 30 s).
SLEEP_DRAIN_S = 30.0


def default_protocol(device_type: str) -> str:
    """``protocol`` when the configuration does not name one."""
    return DEFAULT_PROTOCOLS.get(device_type, FALLBACK_PROTOCOL)


def default_read_wait(protocol: str) -> str:
    """``read_wait`` when the configuration does not say: ``poll`` over tcp, else ``sync``."""
    return "poll" if protocol == "tcp" else "sync"


def default_max_descriptor_kib(protocol: str) -> int:
    """``max_descriptor_kib`` when the configuration does not say."""
    return TCP_MAX_DESCRIPTOR_KIB if protocol == "tcp" else 0


def default_block_reads_from_kib(protocol: str) -> int:
    """``block_reads_from_kib`` when the configuration does not say."""
    return TCP_BLOCK_READS_FROM_KIB if protocol == "tcp" else 0
