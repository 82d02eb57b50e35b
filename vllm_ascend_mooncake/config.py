"""``kv_connector_extra_config`` and the engine config -> one validated, frozen connector config.

Every key is documented in ``docs/configuration.md``. Unknown keys, wrong types and sizes that do
not match the running engine are refused at start-up with a message that names the key, so a typo
cannot silently fall back to a default.

Keys of vllm-ascend's ``MooncakeConnectorV1`` and vLLM's ``MooncakeConnector`` that mean the same
as one of ours are read under our name with a warning naming the key to write instead; those with
no equivalent are refused saying why (``docs/migration.md``).
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from .log import get_logger
from .params import MAX_TRANSFER_ID_CHARS
from .topology import TopologyError, TransferTopology

CONNECTOR_NAME = "MooncakeHeteroConnector"

#: Bytes per unit of the ``*_kib`` / ``*_mib`` keys (see the ``*_bytes`` properties of
#: :class:`ConnectorConfig`, the one place they are converted).
KIB = 1 << 10
MIB = 1 << 20

# -- defaults -------------------------------------------------------------------------------------
# The one definition of every default of kv_connector_extra_config (docs/configuration.md shows
# them; tests/connector/test_config_docs.py checks that it does). The option dataclasses of the
# lower modules (plan.PlanOptions, receiver.ReceiverOptions) and the transfer engine take their
# defaults from here; this module imports none of them.

#: Mooncake transports accepted as ``protocol``.
PROTOCOLS = ("tcp", "rdma", "ascend", "nvlink", "efa")
#: ``protocol`` per device type when the configuration does not name one ...
DEFAULT_PROTOCOLS = {"cpu": "tcp", "cuda": "rdma", "npu": "ascend"}
#: ... and for any other device type.
FALLBACK_PROTOCOL = "tcp"
#: How reads wait for completion (``read_wait``): see :mod:`.engine`.
READ_WAITS = ("poll", "sync")
DEFAULT_DEVICE_NAME = ""
DEFAULT_SIDE_CHANNEL_PORT = 36100
DEFAULT_RELEASE_TIMEOUT_S = 120.0
DEFAULT_SIDE_CHANNEL_TIMEOUT_S = 10.0
DEFAULT_CLAIM_WAIT_S = 10.0
DEFAULT_PREFILL_WAIT_S = 120.0
DEFAULT_READ_RETRIES = 1
DEFAULT_MAX_DESCRIPTORS_PER_BATCH = 1024
#: ``max_descriptor_kib`` over tcp; 0 (never split) on other transports.
TCP_MAX_DESCRIPTOR_KIB = 1024
DEFAULT_COALESCE_RUNS = True
#: ``block_reads_from_kib`` over tcp; 0 (never) on other transports.
TCP_BLOCK_READS_FROM_KIB = 256
DEFAULT_RECEIVER_THREADS = 4
DEFAULT_STAGING_BUFFER_MIB = 64
#: The longest a prefill may hold a decode's pending claim open (long poll), at most half of
#: ``side_channel_timeout_s`` (:attr:`ConnectorConfig.claim_park_s`).
DEFAULT_CLAIM_PARK_S = 1.0
#: In an engine step that runs no tokens, how long a worker waits for a transfer to end. vLLM
#: steps in a loop while a request only waits for KV (decode) or holds blocks for readers
#: (prefill); each step costs the engine core and the workers CPU (and a shared-memory
#: busy-wait), which on hosts where instances share cores is taken from the other instance's
#: forward. A transfer that ends wakes the wait at once; a request arriving meanwhile waits for
#: the step to end, so this bounds that delay too.
DEFAULT_IDLE_STEP_WAIT_MS = 10.0
#: Where the side-channel secret is read from when kv_connector_extra_config does not set it
#: (an environment variable keeps it out of command lines and process listings).
SECRET_ENV = "VAM_SIDE_CHANNEL_SECRET"
MIN_SECRET_CHARS = 16
#: vLLM's default ``KVTransferConfig.kv_port``. A kv_port equal to it cannot be told from one left
#: unset, so only another value is read (as ``side_channel_port``, see :func:`explicit_kv_port`).
VLLM_DEFAULT_KV_PORT = 14579


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


def _log() -> logging.Logger:
    # Fetched when needed: the plugin and the launcher import this module before vLLM's logging.
    return get_logger(__name__)


class ConnectorConfigError(ValueError):
    """The connector configuration is invalid for this engine."""


@dataclass(frozen=True)
class InstanceSizes:
    """Parallel sizes of one side of the deployment (prefill or decode)."""

    tp_size: int
    dp_size: int = 1


@dataclass(frozen=True)
class ConnectorConfig:
    role: str  # "producer" (prefill) or "consumer" (decode)
    engine_id: str
    prefill: InstanceSizes
    decode: InstanceSizes
    num_kv_heads: int
    is_mla: bool
    block_size: int
    protocol: str
    device_name: str
    side_channel_host: str
    side_channel_port: int
    release_timeout_s: float
    side_channel_timeout_s: float
    claim_wait_s: float
    prefill_wait_s: float
    read_retries: int
    max_descriptors_per_batch: int
    max_descriptor_kib: int
    coalesce_runs: bool
    block_reads_from_kib: int
    receiver_threads: int
    staging_buffer_mib: int
    read_wait: str = default_read_wait(FALLBACK_PROTOCOL)
    #: in an engine step that runs no tokens, how long a worker waits for a transfer to end
    idle_step_wait_ms: float = DEFAULT_IDLE_STEP_WAIT_MS
    dp_rank: int = 0
    #: This engine's index among the data-parallel engines its API server fronts, and how many
    #: those are: what vLLM's ``X-data-parallel-rank`` header takes. The global DP rank with
    #: one API server for every rank; the node-local one with ``--data-parallel-hybrid-lb`` or
    #: ``--data-parallel-external-lb``, whose API servers front only their node's engines.
    server_dp_rank: int = 0
    server_dp_size: int = 1
    #: HMAC key of every side-channel message; None: unauthenticated. Kept out of reprs.
    side_channel_secret: bytes | None = field(default=None, repr=False)
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_producer(self) -> bool:
        return self.role == "producer"

    @property
    def local(self) -> InstanceSizes:
        return self.prefill if self.is_producer else self.decode

    def topology(self) -> TransferTopology:
        return TransferTopology(
            self.num_kv_heads, self.prefill.tp_size, self.decode.tp_size, is_mla=self.is_mla
        )

    # -- the settings in the units the data path uses --------------------------------------

    @property
    def max_descriptor_bytes(self) -> int:
        """``max_descriptor_kib`` in bytes (0: never split)."""
        return self.max_descriptor_kib * KIB

    @property
    def block_reads_from_bytes(self) -> int:
        """``block_reads_from_kib`` in bytes (0: never)."""
        return self.block_reads_from_kib * KIB

    @property
    def staging_buffer_bytes(self) -> int:
        """``staging_buffer_mib`` in bytes."""
        return self.staging_buffer_mib * MIB

    @property
    def idle_step_wait_s(self) -> float:
        """``idle_step_wait_ms`` in seconds."""
        return self.idle_step_wait_ms / 1e3

    @property
    def claim_park_s(self) -> float:
        """How long a prefill may hold a pending claim open: at most half an exchange's timeout."""
        return min(DEFAULT_CLAIM_PARK_S, self.side_channel_timeout_s / 2)

    def side_channel_base_port(self, dp_rank: int | None = None) -> int:
        """Port of TP rank 0 of a prefill DP rank; TP rank ``r`` listens on base + ``r``."""
        rank = self.dp_rank if dp_rank is None else dp_rank
        return self.side_channel_port + rank * self.prefill.tp_size


_KEYS = {
    "prefill": "dict with tp_size (and dp_size) of the prefill instance",
    "decode": "dict with tp_size (and dp_size) of the decode instance",
    "protocol": f"Mooncake transport: {', '.join(PROTOCOLS)} (default: by device)",
    "device_name": "Mooncake device/NIC list, '' for auto",
    "side_channel_host": "address workers listen on and advertise (default: VLLM_HOST_IP, else "
    "the host's address)",
    "side_channel_port": "base port of the prefill side channel",
    "release_timeout_s": "prefill releases blocks nobody read after this many seconds",
    "side_channel_timeout_s": "timeout of one side-channel exchange",
    "claim_wait_s": "how long decode waits for prefill to register a request before reading",
    "prefill_wait_s": "how long decode waits for a prefill it was sent alongside to finish",
    "read_retries": "extra attempts for a failed batched read",
    "max_descriptors_per_batch": "cap on descriptors per transfer call",
    "max_descriptor_kib": f"split larger descriptors (0: never; default "
    f"{TCP_MAX_DESCRIPTOR_KIB} on tcp, else 0)",
    "coalesce_runs": "run-level coalescing for heterogeneous TP",
    "block_reads_from_kib": "head-major merges read per block (no fix-up) from this block size",
    "receiver_threads": "decode threads issuing reads (parallel across prefill peers)",
    "staging_buffer_mib": "decode staging buffer for token-major slice pulls",
    "read_wait": "how reads wait: poll (sleeps; default on tcp) or sync (Mooncake's spin)",
    "idle_step_wait_ms": "in a step that runs no tokens, how long workers wait for a transfer",
    "side_channel_secret": f"shared secret authenticating side-channel messages (default: "
    f"${SECRET_ENV}; at least {MIN_SECRET_CHARS} characters)",
    "ascend_local_comm_res_path": "read by vllm-ascend's NPU worker on A5 (endpoint files), not "
    "by this connector",
}

_VLLM_ASCEND = "vllm-ascend's MooncakeConnectorV1"
_VLLM_MOONCAKE = "vLLM's MooncakeConnector"


def default_host() -> str:
    """The address this instance advertises unless told: ``VLLM_HOST_IP``, else the address
    vLLM itself picks for the host (its ``get_ip()``), else loopback; never loopback by accident
    on a host that has a network address."""
    host = os.environ.get("VLLM_HOST_IP", "").strip()
    if host:
        return host
    try:
        from vllm.utils.network_utils import get_ip
    except ImportError:
        return "127.0.0.1"
    try:
        return get_ip()
    except Exception:
        return "127.0.0.1"


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _expect(extra: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = extra.get(key, default)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ConnectorConfigError(
            f"kv_connector_extra_config[{key!r}] must be {getattr(kind, '__name__', kind)}, "
            f"got {value!r}"
        )
    return value


def _secret(extra: dict[str, Any]) -> bytes | None:
    """The side-channel secret from the config, else from the environment; None if neither."""
    secret = _expect(extra, "side_channel_secret", str, os.environ.get(SECRET_ENV, ""))
    if not secret:
        return None
    if len(secret) < MIN_SECRET_CHARS:
        raise ConnectorConfigError(
            f"the side-channel secret (side_channel_secret or ${SECRET_ENV}) must have at least "
            f"{MIN_SECRET_CHARS} characters, got {len(secret)}"
        )
    return secret.encode()


def _positive(key: str, value: float) -> None:
    if value <= 0:
        raise ConnectorConfigError(f"kv_connector_extra_config[{key!r}] must be > 0, got {value}")


# -- keys of other Mooncake connectors ----------------------------------------------------------


def _port_number(where: str, value: Any) -> int:
    """A port given as an int, or as a decimal string (vllm-ascend's guides write ``"36000"``)."""
    if isinstance(value, str) and value.strip().isdecimal():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ConnectorConfigError(f"{where} must be a port number, got {value!r}")


def _string(where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConnectorConfigError(f"{where} must be str, got {value!r}")
    return value


def _ascend_direct_protocol(where: str, value: Any) -> str:
    """vllm-ascend's ``use_ascend_direct``: ``true`` gave Mooncake the plain host address (the
    form of its ADXL/HIXL transport, with protocol ``ascend``), which is what this connector
    always does; ``false`` chose the HCCL form ``host:0:npu_<id>``, which it cannot do."""
    if value is True:
        return "ascend"
    if value is False:
        raise ConnectorConfigError(
            f"{where} false chose vllm-ascend's legacy HCCL transport address "
            f"(host:0:npu_<id>), removed from vllm-ascend in December 2025 (#4547); "
            f"{CONNECTOR_NAME} has no equivalent: it always gives Mooncake the plain host "
            f"address, as Mooncake's ADXL/HIXL transport (built with USE_ASCEND_DIRECT) needs. "
            f"Remove the key (protocol 'ascend' is the default on NPUs)"
        )
    raise ConnectorConfigError(f"{where} must be bool, got {value!r}")


@dataclass(frozen=True)
class _Renamed:
    """A key of another connector that means the same as one of ours."""

    ours: str
    origin: str
    #: the value under our key, from the old key's value; raises naming ``where`` if unusable
    convert: Callable[[str, Any], Any]
    note: str = ""


#: Read under our name, with a warning naming the key to write instead (docs/migration.md).
_RENAMED_KEYS: dict[str, _Renamed] = {
    "mooncake_protocol": _Renamed("protocol", _VLLM_MOONCAKE, _string),
    "use_ascend_direct": _Renamed("protocol", _VLLM_ASCEND, _ascend_direct_protocol),
    # vllm-ascend reads kv_port from kv_transfer_config (explicit_kv_port); one copied into the
    # extra config is read the same way. There it is the base port of prefill's side channel:
    # DP rank d, TP rank r listens on kv_port + d*tp_size + r (with PP and PCP 1, as here).
    "kv_port": _Renamed(
        "side_channel_port",
        _VLLM_ASCEND,
        _port_number,
        note="only prefill listens on it; decode takes the prefill's port from kv_transfer_params",
    ),
}

#: Keys of other connectors with no equivalent here: refused, saying why (docs/migration.md).
_REFUSED_KEYS: dict[str, str] = {
    "num_workers": f"{_VLLM_MOONCAKE} sizes its prefill-side sender thread pool with it; here "
    f"prefill moves no bytes (decode reads them), and the decode readers are receiver_threads",
    "bootstrap_server_address": f"{_VLLM_MOONCAKE}'s bootstrap server; there is none here: "
    f"decode takes the prefill's address from the kv_transfer_params the proxy forwards. Remove it",
    "tls_config": "vllm-ascend's MooncakeLayerwiseConnector uses it for its metaserver; this "
    "connector has no metaserver (decode pulls after prefill, no layer-wise push). Remove it",
}

#: Environment variables of those connectors that this one does not read, and what to set instead.
_FOREIGN_ENV: dict[str, str] = {
    "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": "prefill releases unread blocks after "
    "kv_connector_extra_config['release_timeout_s']",
    "VLLM_MOONCAKE_BOOTSTRAP_PORT": "there is no bootstrap server: prefill listens on "
    "kv_connector_extra_config['side_channel_port']",
}


def explicit_kv_port(kv_transfer_config: Any) -> int | None:
    """``KVTransferConfig.kv_port`` if the user set it, else None.

    vLLM gives kv_port a default (14579) that neither of its Mooncake-style connectors reads;
    vllm-ascend reads it as the base port of prefill's side channel, which is our
    ``side_channel_port``. A value equal to vLLM's default cannot be told from an unset one, so
    it is not read."""
    port = getattr(kv_transfer_config, "kv_port", None)
    if port is None or port == VLLM_DEFAULT_KV_PORT:
        return None
    return _port_number("kv_transfer_config.kv_port", port)


def _migrate_keys(extra: dict[str, Any], kv_port: int | None) -> dict[str, Any]:
    """``extra`` with other connectors' keys replaced by ours; refuses those that mean nothing
    here, and an old and a new spelling of one setting that disagree."""
    refused = sorted(set(extra) & set(_REFUSED_KEYS))
    if refused:
        raise ConnectorConfigError(
            f"kv_connector_extra_config key(s) of other connectors that {CONNECTOR_NAME} does not "
            f"accept: " + "; ".join(f"{key!r}: {_REFUSED_KEYS[key]}" for key in refused)
        )
    migrated = {key: value for key, value in extra.items() if key not in _RENAMED_KEYS}
    # our key -> [(where the user wrote it, the value under our key, a note for the log)]
    old_spellings: dict[str, list[tuple[str, Any, str]]] = {}
    for key, value in extra.items():
        if key in _RENAMED_KEYS:
            renamed = _RENAMED_KEYS[key]
            where = f"kv_connector_extra_config[{key!r}] ({renamed.origin})"
            old_spellings.setdefault(renamed.ours, []).append(
                (where, renamed.convert(where, value), renamed.note)
            )
    if kv_port is not None:
        old_spellings.setdefault("side_channel_port", []).append(
            (
                f"kv_transfer_config.kv_port ({_VLLM_ASCEND})",
                kv_port,
                _RENAMED_KEYS["kv_port"].note,
            )
        )
    for ours, old in old_spellings.items():
        target = f"kv_connector_extra_config[{ours!r}]"
        given = [(where, value) for where, value, _ in old]
        if ours in migrated:
            given.insert(0, (target, migrated[ours]))
        if len({repr(value) for _, value in given}) > 1:
            raise ConnectorConfigError(
                " and ".join(f"{where} = {value!r}" for where, value in given)
                + f" set the same thing differently: keep only {target}"
            )
        migrated[ours] = given[0][1]
        for where, value, note in old:
            _log().warning(
                "%s is read as %s = %r; write that instead%s",
                where,
                target,
                value,
                f" ({note})" if note else "",
            )
    for name, instead in _FOREIGN_ENV.items():
        if name in os.environ:
            _log().warning("%s is set, but %s does not read it: %s", name, CONNECTOR_NAME, instead)
    return migrated


#: vllm-ascend's pipeline keys in ``prefill``/``decode``; only pipeline size 1 runs here.
_PIPELINE_KEYS = ("pp_size", "pp_layer_partition")


def _refuse_pipeline(side: str, sizes: dict[str, Any]) -> None:
    """Accept vllm-ascend's ``pp_size: 1`` (with a note that it can go); refuse real PP."""
    pp_size = sizes.get("pp_size", 1)
    if "pp_layer_partition" in sizes or type(pp_size) is not int or pp_size != 1:
        given = {key: sizes[key] for key in _PIPELINE_KEYS if key in sizes}
        raise ConnectorConfigError(
            f"kv_connector_extra_config[{side!r}] asks for pipeline parallelism with {given} "
            f"(keys of {_VLLM_ASCEND}); {CONNECTOR_NAME} supports pipeline parallel size 1 only: "
            f"use tensor parallelism and remove these keys"
        )
    if "pp_size" in sizes:
        _log().info(
            "kv_connector_extra_config[%r]['pp_size'] = 1 (%s) is the only pipeline size %s "
            "runs; the key can be removed",
            side,
            _VLLM_ASCEND,
            CONNECTOR_NAME,
        )


def _sizes(extra: dict[str, Any], side: str, default_tp: int) -> InstanceSizes:
    raw = extra.get(side, {"tp_size": default_tp})
    if not isinstance(raw, dict) or set(raw) - {"tp_size", "dp_size", *_PIPELINE_KEYS}:
        raise ConnectorConfigError(
            f"kv_connector_extra_config[{side!r}] must be a dict with keys tp_size and dp_size, "
            f"got {raw!r}"
        )
    _refuse_pipeline(side, raw)
    tp, dp = raw.get("tp_size", default_tp), raw.get("dp_size", 1)
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConnectorConfigError(f"{side}.tp_size must be a positive integer, got {tp!r}")
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ConnectorConfigError(f"{side}.dp_size must be a positive integer, got {dp!r}")
    return InstanceSizes(tp, dp)


def parse_config(
    *,
    kv_role: str,
    engine_id: str,
    extra: dict[str, Any] | None,
    local_tp: int,
    local_dp: int,
    local_pp: int = 1,
    dp_rank: int = 0,
    server_dp: tuple[int, int] = (0, 1),
    num_kv_heads: int,
    is_mla: bool,
    block_size: int,
    device_type: str,
    kv_port: int | None = None,
) -> ConnectorConfig:
    """Validate the user's settings against the running engine.

    ``kv_port``: vLLM's ``KVTransferConfig.kv_port`` when the user set it
    (:func:`explicit_kv_port`), read as ``side_channel_port``. ``server_dp``: this engine's
    ``(index, count)`` among those its API server fronts (:func:`server_dp_position`)."""
    extra = _migrate_keys(dict(extra or {}), kv_port)
    unknown = sorted(set(extra) - set(_KEYS))
    if unknown:
        known = ", ".join(sorted(_KEYS))
        raise ConnectorConfigError(
            f"unknown kv_connector_extra_config key(s) {unknown}; known keys: {known} (keys of "
            f"other Mooncake connectors and their equivalents: docs/migration.md)"
        )
    _expect(extra, "ascend_local_comm_res_path", str, "")  # vllm-ascend's; not read here
    roles = {"kv_producer": "producer", "kv_consumer": "consumer"}
    if kv_role not in roles:
        raise ConnectorConfigError(
            f"kv_role {kv_role!r} is not supported by {CONNECTOR_NAME}: run the prefill instance "
            f"with kv_producer and the decode instance with kv_consumer"
        )
    role = roles[kv_role]
    if not 0 < len(engine_id) <= MAX_TRANSFER_ID_CHARS:
        raise ConnectorConfigError(
            f"engine_id must have 1 to {MAX_TRANSFER_ID_CHARS} characters (it travels in "
            f"kv_transfer_params and on the side channel), got {len(engine_id)}"
        )
    if local_pp != 1:
        raise ConnectorConfigError(
            f"pipeline parallelism ({local_pp} stages) is not supported by {CONNECTOR_NAME}; "
            f"use tensor parallelism"
        )
    prefill = _sizes(extra, "prefill", local_tp)
    decode = _sizes(extra, "decode", local_tp)
    local = prefill if role == "producer" else decode
    side = "prefill" if role == "producer" else "decode"
    if local.tp_size != local_tp:
        raise ConnectorConfigError(
            f"this {side} instance runs tensor parallel size {local_tp}, but "
            f"kv_connector_extra_config[{side!r}].tp_size is {local.tp_size}"
        )
    # vLLM runs the data-parallel engines of a dense model as independent DP 1 engines (only
    # ``data_parallel_index`` keeps the rank), so DP 1 cannot contradict a declared size.
    if local_dp != 1 and local.dp_size != local_dp:
        raise ConnectorConfigError(
            f"this {side} instance runs data parallel size {local_dp}, but "
            f"kv_connector_extra_config[{side!r}].dp_size is {local.dp_size}"
        )
    if role == "producer" and not 0 <= dp_rank < local.dp_size:  # its side-channel ports
        raise ConnectorConfigError(
            f"this {side} instance is data-parallel engine {dp_rank}, but "
            f"kv_connector_extra_config[{side!r}].dp_size is {local.dp_size}: set it to the "
            f"instance's --data-parallel-size"
        )
    try:
        TransferTopology(num_kv_heads, prefill.tp_size, decode.tp_size, is_mla=is_mla)
    except TopologyError as exc:
        raise ConnectorConfigError(f"cannot pair these instances: {exc}") from exc

    port = _expect(extra, "side_channel_port", int, DEFAULT_SIDE_CHANNEL_PORT)
    if not port >= 1 or port + prefill.dp_size * prefill.tp_size > 65536:
        raise ConnectorConfigError(
            f"side_channel_port {port} leaves no room for {prefill.dp_size * prefill.tp_size} "
            f"prefill workers below 65536"
        )
    config = ConnectorConfig(
        role=role,
        engine_id=engine_id,
        prefill=prefill,
        decode=decode,
        num_kv_heads=num_kv_heads,
        is_mla=is_mla,
        block_size=block_size,
        protocol=_expect(extra, "protocol", str, default_protocol(device_type)),
        device_name=_expect(extra, "device_name", str, DEFAULT_DEVICE_NAME),
        side_channel_host=_expect(extra, "side_channel_host", str, default_host()),
        side_channel_port=port,
        release_timeout_s=_expect(extra, "release_timeout_s", float, DEFAULT_RELEASE_TIMEOUT_S),
        side_channel_timeout_s=_expect(
            extra, "side_channel_timeout_s", float, DEFAULT_SIDE_CHANNEL_TIMEOUT_S
        ),
        claim_wait_s=_expect(extra, "claim_wait_s", float, DEFAULT_CLAIM_WAIT_S),
        prefill_wait_s=_expect(extra, "prefill_wait_s", float, DEFAULT_PREFILL_WAIT_S),
        read_retries=_expect(extra, "read_retries", int, DEFAULT_READ_RETRIES),
        max_descriptors_per_batch=_expect(
            extra, "max_descriptors_per_batch", int, DEFAULT_MAX_DESCRIPTORS_PER_BATCH
        ),
        max_descriptor_kib=_expect(extra, "max_descriptor_kib", int, -1),
        coalesce_runs=_expect(extra, "coalesce_runs", bool, DEFAULT_COALESCE_RUNS),
        block_reads_from_kib=_expect(extra, "block_reads_from_kib", int, -1),
        receiver_threads=_expect(extra, "receiver_threads", int, DEFAULT_RECEIVER_THREADS),
        staging_buffer_mib=_expect(extra, "staging_buffer_mib", int, DEFAULT_STAGING_BUFFER_MIB),
        read_wait=_expect(extra, "read_wait", str, ""),
        idle_step_wait_ms=_expect(extra, "idle_step_wait_ms", float, DEFAULT_IDLE_STEP_WAIT_MS),
        dp_rank=dp_rank,
        server_dp_rank=server_dp[0],
        server_dp_size=server_dp[1],
        side_channel_secret=_secret(extra),
        extra=extra,
    )
    if config.max_descriptor_kib < 0:
        config = replace(config, max_descriptor_kib=default_max_descriptor_kib(config.protocol))
    if config.block_reads_from_kib < 0:
        config = replace(config, block_reads_from_kib=default_block_reads_from_kib(config.protocol))
    if not config.read_wait:
        config = replace(config, read_wait=default_read_wait(config.protocol))
    if config.read_wait not in READ_WAITS:
        raise ConnectorConfigError(
            f"kv_connector_extra_config['read_wait'] must be one of {', '.join(READ_WAITS)}, "
            f"got {config.read_wait!r}"
        )
    for key in (
        "release_timeout_s",
        "side_channel_timeout_s",
        "claim_wait_s",
        "prefill_wait_s",
        "max_descriptors_per_batch",
        "receiver_threads",
        "staging_buffer_mib",
        "idle_step_wait_ms",
    ):
        _positive(key, getattr(config, key))
    if config.read_retries < 0:
        raise ConnectorConfigError(
            f"kv_connector_extra_config['read_retries'] must be >= 0, got {config.read_retries}"
        )
    if config.protocol not in PROTOCOLS:
        raise ConnectorConfigError(
            f"kv_connector_extra_config['protocol'] {config.protocol!r} is not a Mooncake "
            f"transport ({', '.join(PROTOCOLS)})"
        )
    return config


def config_from_vllm(vllm_config: Any) -> ConnectorConfig:
    """Build the connector config from vLLM's ``VllmConfig``."""
    from vllm.platforms import current_platform

    transfer = vllm_config.kv_transfer_config
    parallel = vllm_config.parallel_config
    model = vllm_config.model_config
    dp_rank = dp_index(parallel)
    extra = transfer.kv_connector_extra_config
    return parse_config(
        kv_role=transfer.kv_role,
        engine_id=transfer.engine_id,
        extra=extra,
        local_tp=parallel.tensor_parallel_size,
        local_dp=parallel.data_parallel_size,
        local_pp=parallel.pipeline_parallel_size,
        dp_rank=dp_rank,
        server_dp=server_dp_position(parallel, _declared_dp_size(extra, transfer.kv_role)),
        num_kv_heads=model.get_total_num_kv_heads(),
        is_mla=bool(model.use_mla),
        block_size=vllm_config.cache_config.block_size,
        device_type=current_platform.device_type,
        kv_port=explicit_kv_port(transfer),
    )


def dp_index(parallel: Any) -> int:
    """This engine's data-parallel rank. vLLM resets ``data_parallel_rank`` to 0 in each engine
    of a dense model (they run as independent DP 1 engines) and keeps the rank only in
    ``data_parallel_index``."""
    return getattr(parallel, "data_parallel_index", parallel.data_parallel_rank)


def _declared_dp_size(extra: dict[str, Any] | None, kv_role: str) -> int:
    """The DP size the user declared for this side (validated later by :func:`parse_config`)."""
    side = (extra or {}).get("prefill" if kv_role == "kv_producer" else "decode")
    size = side.get("dp_size", 1) if isinstance(side, dict) else 1
    return size if isinstance(size, int) and not isinstance(size, bool) and size >= 1 else 1


def server_dp_position(parallel: Any, declared_dp_size: int = 1) -> tuple[int, int]:
    """This engine's index among the engines its API server fronts, and their number: what
    vLLM's ``X-data-parallel-rank`` header selects.

    With internal load balancing one API server fronts every DP rank, numbered globally. The
    engines of a dense model forget the DP size (each runs as DP 1), so the declared one counts.
    With hybrid or external load balancing (``local_engines_only``) each API server fronts only
    its node's engines, numbered from 0; a dense model's engines forget how many share their
    server, so they are not offered for pinning then: (0, 1).
    """
    if getattr(parallel, "local_engines_only", False):
        if parallel.data_parallel_size_local > 1:
            return parallel.data_parallel_rank_local or 0, parallel.data_parallel_size_local
        return 0, 1
    return dp_index(parallel), max(declared_dp_size, parallel.data_parallel_size)
