"""``kv_connector_extra_config`` and the engine config -> one validated, frozen connector config.

Every key is declared once, in :data:`.keys.KEYS`: its type, default (from :mod:`..defaults`),
unit, bound, description and the other connectors' spellings of it. :func:`parse_config` checks
the keys against it, and the key table of ``docs/configuration.md`` is generated from it
(``python scripts/config_table.py --write``; ``tests/connector/test_config_docs.py`` fails when
they differ). Unknown keys, wrong types, values out of bounds and sizes that do not match the
running engine are refused at start-up with a message that names the key, so a typo cannot
silently fall back to a default.

Keys of vllm-ascend's ``MooncakeConnectorV1`` and vLLM's ``MooncakeConnector`` are read under our
names or refused saying why before that (:mod:`.migration`, ``docs/migration.md``).
"""

from __future__ import annotations

import ipaddress
import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any

from ..core.topology import TopologyError, TransferTopology
from ..defaults import (
    DEFAULT_CLAIM_PARK_S,
    DEFAULT_IDLE_STEP_WAIT_MS,
    DEFAULT_PAIR_WAIT_S,
    DEFAULT_TRANSPORT,
    FALLBACK_PROTOCOL,
    default_protocol,
    default_read_wait,
)
from ..log import get_logger
from .keys import (
    CONNECTOR_NAME,
    KEYS,
    KEYS_BY_NAME,
    MIN_SECRET_CHARS,
    SECRET_ENV,
    Computed,
    ConnectorConfigError,
    Key,
)
from .migration import PIPELINE_KEYS, explicit_kv_port, migrate_keys, refuse_pipeline
from .params import MAX_TRANSFER_ID_CHARS
from .vllm_compat import data_parallel_index

#: Bytes per unit of the ``*_kib`` / ``*_mib`` keys (see the ``*_bytes`` properties of
#: :class:`ConnectorConfig`, the one place they are converted).
KIB = 1 << 10
MIB = 1 << 20


def _log() -> logging.Logger:
    # Fetched when needed: the plugin and the launcher import this module before vLLM's logging.
    return get_logger(__name__)


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
    #: decode: the prefill instances to pair with at start-up (``host:port,...``; "": none)
    verify_reads: bool = False
    prefill_side_channels: str = ""
    pair_wait_s: float = DEFAULT_PAIR_WAIT_S
    #: decode: hold a prefill engine's first request until paired (datapath/pairing.py)
    pair_before_pull: bool = True
    read_wait: str = default_read_wait(FALLBACK_PROTOCOL)
    transport: str = DEFAULT_TRANSPORT
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
    #: the draft (EAGLE/MTP) model's total KV heads, its layers' head group; 0: no draft model
    draft_kv_heads: int = 0

    @property
    def is_producer(self) -> bool:
        return self.role == "producer"

    @property
    def local(self) -> InstanceSizes:
        return self.prefill if self.is_producer else self.decode

    def topology(self) -> TransferTopology:
        return _topology(
            self.num_kv_heads,
            self.prefill.tp_size,
            self.decode.tp_size,
            self.is_mla,
            self.draft_kv_heads,
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


# -- the keys of kv_connector_extra_config, declared once -----------------------------------------


def _typed(key: Key, value: Any) -> Any:
    """``value`` if it has the key's type (an int is read as a float where a float is due)."""
    if key.type is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, key.type) or (isinstance(value, bool) and key.type is not bool):
        raise ConnectorConfigError(
            f"kv_connector_extra_config[{key.name!r}] must be {key.type.__name__}, got {value!r}"
        )
    return value


def _given(extra: dict[str, Any]) -> dict[str, Any]:
    """The values ``extra`` sets, checked against their declarations (type and bound), less
    those that mean "the default" and the keys checked by their own code."""
    given = {}
    for key in KEYS:
        if key.name not in extra or key.own_check:
            continue
        value = _typed(key, extra[key.name])
        if key.as_default is not None and key.as_default.ok(value):
            continue
        if key.bound is not None and not key.bound.ok(value):
            raise key.bound.refuse(f"kv_connector_extra_config[{key.name!r}]", value)
        given[key.name] = value
    return given


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


def _secret(given: dict[str, Any]) -> bytes | None:
    """The side-channel secret from the config, else from the environment; None if neither."""
    secret = given.get("side_channel_secret", os.environ.get(SECRET_ENV, ""))
    if not secret:
        return None
    if len(secret) < MIN_SECRET_CHARS:
        raise ConnectorConfigError(
            f"the side-channel secret (side_channel_secret or ${SECRET_ENV}) must have at least "
            f"{MIN_SECRET_CHARS} characters, got {len(secret)}"
        )
    return secret.encode()


def _sizes(extra: dict[str, Any], side: str, default_tp: int) -> InstanceSizes:
    raw = extra.get(side, {"tp_size": default_tp})
    if not isinstance(raw, dict) or set(raw) - {"tp_size", "dp_size", *PIPELINE_KEYS}:
        raise ConnectorConfigError(
            f"kv_connector_extra_config[{side!r}] must be a dict with keys tp_size and dp_size, "
            f"got {raw!r}"
        )
    refuse_pipeline(side, raw)
    tp, dp = raw.get("tp_size", default_tp), raw.get("dp_size", 1)
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConnectorConfigError(f"{side}.tp_size must be a positive integer, got {tp!r}")
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ConnectorConfigError(f"{side}.dp_size must be a positive integer, got {dp!r}")
    return InstanceSizes(tp, dp)


#: Keys that are :class:`ConnectorConfig` fields of the same name, filled from :data:`KEYS` by
#: :func:`parse_config` (the others have code of their own there).
_PLAIN_FIELDS = tuple(
    key.name
    for key in KEYS
    if key.name in {f.name for f in fields(ConnectorConfig)}
    and not key.own_check
    and not (isinstance(key.default, Computed) and key.default.of_protocol is None)
)


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
    draft_kv_heads: int = 0,
) -> ConnectorConfig:
    """Validate the user's settings against the running engine.

    ``kv_port``: vLLM's ``KVTransferConfig.kv_port`` when the user set it
    (:func:`explicit_kv_port`), read as ``side_channel_port``. ``server_dp``: this engine's
    ``(index, count)`` among those its API server fronts (:func:`server_dp_position`).
    ``draft_kv_heads``: the draft (EAGLE/MTP) model's total KV heads (0: none), a head group of
    its own when it differs from ``num_kv_heads``."""
    extra = migrate_keys(dict(extra or {}), kv_port)
    unknown = sorted(set(extra) - set(KEYS_BY_NAME))
    if unknown:
        known = ", ".join(sorted(KEYS_BY_NAME))
        raise ConnectorConfigError(
            f"unknown kv_connector_extra_config key(s) {unknown}; known keys: {known} (keys of "
            f"other Mooncake connectors and their equivalents: docs/migration.md)"
        )
    given = _given(extra)
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
        _topology(num_kv_heads, prefill.tp_size, decode.tp_size, is_mla, draft_kv_heads)
    except TopologyError as exc:
        raise ConnectorConfigError(f"cannot pair these instances: {exc}") from exc

    protocol = given.get("protocol", default_protocol(device_type))

    def setting(name: str) -> Any:
        if name in given:
            return given[name]
        default = KEYS_BY_NAME[name].default
        return default.of_protocol(protocol) if isinstance(default, Computed) else default

    settings = {name: setting(name) for name in _PLAIN_FIELDS}
    port = settings["side_channel_port"]
    if port + prefill.dp_size * prefill.tp_size > 65536:
        raise ConnectorConfigError(
            f"side_channel_port {port} leaves no room for {prefill.dp_size * prefill.tp_size} "
            f"prefill workers below 65536"
        )
    return ConnectorConfig(
        role=role,
        engine_id=engine_id,
        prefill=prefill,
        decode=decode,
        num_kv_heads=num_kv_heads,
        draft_kv_heads=draft_kv_heads,
        is_mla=is_mla,
        block_size=block_size,
        protocol=protocol,
        side_channel_host=(
            given["side_channel_host"] if "side_channel_host" in given else default_host()
        ),
        dp_rank=dp_rank,
        server_dp_rank=server_dp[0],
        server_dp_size=server_dp[1],
        side_channel_secret=_secret(given),
        extra=extra,
        **settings,
    )


def config_from_vllm(vllm_config: Any) -> ConnectorConfig:
    """Build the connector config from vLLM's ``VllmConfig``."""
    from vllm.platforms import current_platform

    transfer = vllm_config.kv_transfer_config
    parallel = vllm_config.parallel_config
    model = vllm_config.model_config
    dp_rank = data_parallel_index(parallel)
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
        draft_kv_heads=draft_model_kv_heads(vllm_config),
    )


def draft_model_kv_heads(vllm_config: Any) -> int:
    """The draft model's total KV heads when vLLM runs speculative decoding with one (EAGLE,
    MTP, a draft model); 0 otherwise (none, or n-gram and other model-free methods)."""
    speculative = getattr(vllm_config, "speculative_config", None)
    draft = getattr(speculative, "draft_model_config", None)
    return int(draft.get_total_num_kv_heads()) if draft is not None else 0


def _topology(
    num_kv_heads: int, prefill_tp: int, decode_tp: int, is_mla: bool, draft_kv_heads: int
) -> TransferTopology:
    """The transfer topology, the draft model's layers a head group of their own where their
    total KV heads differ from the model's."""
    extra = (draft_kv_heads,) if draft_kv_heads and draft_kv_heads != num_kv_heads else ()
    return TransferTopology(
        num_kv_heads, prefill_tp, decode_tp, is_mla=is_mla, extra_kv_heads=extra
    )


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
    return data_parallel_index(parallel), max(declared_dp_size, parallel.data_parallel_size)
