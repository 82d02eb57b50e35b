"""``kv_connector_extra_config`` and the engine config -> one validated, frozen connector config.

Every key is declared once, where it is read: as a field of :class:`ConnectorConfig`, or of the
options of a data-path part it is composed of (``ReceiverOptions``, ``MooncakeOptions``), with
:func:`..options.option`: its type, default, unit, bound, description and the other connectors'
spellings of it. :data:`KEYS` collects them; :func:`parse_config` checks the keys against it, and
the key table of ``docs/configuration.md`` is generated from it (``python
scripts/config_table.py --write``; ``tests/connector/test_config_docs.py`` fails when they
differ). Unknown keys, wrong types, values out of bounds and sizes that do not match the running
engine are refused at start-up with a message that names the key, so a typo cannot silently fall
back to a default.

Keys of vllm-ascend's ``MooncakeConnectorV1`` and vLLM's ``MooncakeConnector`` are read under our
names or refused saying why before that (:mod:`.migration`, ``docs/migration.md``).
"""

from __future__ import annotations

import ipaddress
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from ..core.topology import TopologyError, TransferTopology
from ..datapath.mooncake import MooncakeOptions, default_protocol
from ..datapath.pairing import parse_endpoints
from ..datapath.receiver import CLAIM_PARK_S, ReceiverOptions
from ..datapath.transport import TRANSPORTS
from ..handoff import SECRET_ENV
from ..log import get_logger
from ..names import CONNECTOR_NAME, VLLM_ASCEND
from ..options import (
    MIB,
    PORT,
    POSITIVE,
    Alias,
    Bound,
    Computed,
    ConnectorConfigError,
    Option,
    declared_options,
    key_table_markdown,
    one_of,
    option,
    option_fields,
    part,
    with_key_table,
)
from .migration import (
    PIPELINE_KEYS,
    VLLM_DEFAULT_KV_PORT,
    explicit_kv_port,
    migrate_keys,
    port_number,
    refuse_pipeline,
    renamed_keys,
)
from .params import MAX_TRANSFER_ID_CHARS
from .prefill_pairings import PAIRING_WAIT_S
from .vllm_compat import data_parallel_index

MIN_SECRET_CHARS = 16


def _log() -> logging.Logger:
    # Fetched when needed: the plugin and the launcher import this module before vLLM's logging.
    return get_logger(__name__)


@dataclass(frozen=True)
class InstanceSizes:
    """Parallel sizes of one side of the deployment (prefill or decode)."""

    tp_size: int
    dp_size: int = 1


def _endpoints_ok(text: str) -> bool:
    try:
        parse_endpoints(text)
    except ValueError:
        return False
    return True


ENDPOINTS = Bound(
    "comma-separated host:port",
    _endpoints_ok,
    "comma-separated `host:port`",
    "{where} must be comma-separated host:port entries (IPv6 hosts in brackets), got {value!r}",
)
_SIZES_ALLOWED = "`tp_size` and `dp_size` > 0"


@dataclass(frozen=True, kw_only=True)
class ConnectorConfig:
    """The connector's configuration: its own keys, declared here in the order the docs list
    them, the parts' keys where the part is (:func:`..options.part`), and what the engine says."""

    role: str  # "producer" (prefill) or "consumer" (decode)
    engine_id: str
    prefill: InstanceSizes = option(
        key_type=dict,
        computed=Computed("the local TP, DP 1"),
        summary="sizes of the prefill instance.",
        details=(
            "The local side's values must equal the engine's own `--tensor-parallel-size` / "
            "`--data-parallel-size`. A data-parallel prefill must declare its `dp_size`: vLLM runs "
            "each engine of a dense model as an independent DP 1 engine, so the connector learns "
            "the engine's rank from vLLM but the number of engines only from here (an engine beyond"
            " `dp_size` is refused at start-up, since it would share another's side-channel ports)."
        ),
        own_check=True,
        type_markdown='`{"tp_size": int, "dp_size": int}`',
        allowed=_SIZES_ALLOWED,
    )
    decode: InstanceSizes = option(
        key_type=dict,
        computed=Computed("the local TP, DP 1"),
        summary="sizes of the decode instance.",
        details=(
            "The remote side's size is the one expected, not the only one served: a decode instance"
            " reads prefill instances of any TP size it can pair with (each request's params name "
            "its prefill's), and a prefill instance serves decode instances of any TP size it can "
            "pair with (learned from the first claim of each transfer), except a prefill that "
            "replicates KV heads (TP larger than the head count), which serves its `decode.tp_size`"
            " only. The `prefill` sizes must still agree for `dp_size`."
        ),
        own_check=True,
        type_markdown="same",
        allowed=_SIZES_ALLOWED,
    )
    transport: str = option(
        "mooncake",
        summary="what moves the KV bytes between instances.",
        details=(
            "Only the Mooncake Transfer Engine today; the data path reaches it through one seam "
            "(`datapath/transport.py`), where another would be added."
        ),
        bound=one_of(TRANSPORTS),
    )
    #: protocol, device_name, read_wait: how the Mooncake transport is started
    mooncake: MooncakeOptions = part()
    side_channel_host: str = option(
        computed=Computed(
            "`$VLLM_HOST_IP`, else the host's address as vLLM picks it (`get_ip()`), else "
            "`127.0.0.1`"
        ),
        summary="address workers listen on and advertise (the KV side channel and Mooncake).",
        details=(
            "Decode connects to the one prefill advertises; a decode instance with a network "
            "address warns once per prefill that advertises loopback (a multi-host deployment whose"
            " prefill kept a loopback setting)."
        ),
    )
    side_channel_port: int = option(
        36100,
        summary=(
            "base port of the prefill side channel: prefill DP rank `d`, TP rank `r` listens on "
            "`port + d*tp_size + r`."
        ),
        details="The ports of every prefill worker must lie below 65536. Only prefill listens, so "
        "only prefill needs it: decode has no port of its own and takes the prefill's host and "
        "base port from the `remote_host` and `remote_port` of the `kv_transfer_params` the proxy "
        "forwards (the base port of the prefill's DP rank), adding the prefill TP rank it reads. "
        "On decode the value is only range-checked. vLLM's top-level "
        "`kv_transfer_config.kv_port` (what vllm-ascend uses for this) is read as "
        f"`side_channel_port` when it is not vLLM's default {VLLM_DEFAULT_KV_PORT}, with a "
        "warning; both set to different values is an error. Keep the range clear of Mooncake's "
        "TCP ports (15000\N{EN DASH}17000) and, on Ascend, of ADXL's range "
        "(20000 + 1000·NPUs per node).",
        bound=PORT,
        # vllm-ascend reads kv_port from kv_transfer_config (migration.explicit_kv_port); one
        # copied into the extra config is read the same way. There it is the base port of
        # prefill's side channel: DP rank d, TP rank r listens on kv_port + d*tp_size + r.
        aliases=(
            Alias(
                "kv_port",
                VLLM_ASCEND,
                port_number,
                "only prefill listens on it; decode takes the prefill's port from "
                "kv_transfer_params",
            ),
        ),
    )
    #: decode: the prefill instances to pair with at start-up (``host:port,...``; "": none)
    prefill_side_channels: str = option(
        "",
        summary=(
            "decode only: the prefill instances this decode instance reads, as their "
            "`side_channel_host:side_channel_port`; decode pairs with every worker of each at "
            "start-up."
        ),
        details=(
            "A prefill it cannot read (another model or dtype, block sizes neither dividing the "
            "other, TP sizes that do not pair, ...) stops decode's start-up with the reason and "
            "what to change, instead of failing its first request with HTTP 500; one that does not "
            "answer within `pair_wait_s` is paired on its first request (warning). Empty: every "
            "prefill is paired on its first request. Prefills not listed are still served."
        ),
        bound=ENDPOINTS,
    )
    #: How long a decode worker's start-up waits for each prefill of ``prefill_side_channels`` to
    #: answer before serving without it (prefill and decode are often started together, and a
    #: prefill's side channel listens once its KV cache is allocated).
    pair_wait_s: float = option(
        120.0,
        summary=(
            "how long decode's start-up waits for each prefill of `prefill_side_channels` to "
            "answer."
        ),
        unit="s",
        bound=POSITIVE,
    )
    #: decode: hold a prefill engine's first request until paired (datapath/pairing.py)
    pair_before_pull: bool = option(
        True,
        summary=(
            "decode only: hold the first request from a prefill engine not paired yet until "
            "decode has handshaken with every rank of it."
        ),
        details=(
            "A prefill this decode cannot read (another model or dtype, block sizes neither "
            "dividing the other, TP sizes that do not pair, ...) then costs that request nothing:"
            " it is computed here, as every later request of that prefill engine is, instead of "
            "failing with HTTP 500 under vLLM's default `kv_load_failure_policy`. The handshake "
            "is what the first pull would do anyway; a prefill that does not answer within "
            f"{PAIRING_WAIT_S:g} s is left to the pull. false: the first pull pairs."
        ),
    )
    release_timeout_s: float = option(
        120.0,
        summary=(
            "prefill releases the blocks of a request no decode rank finished reading after this "
            "long."
        ),
        details=(
            "Read leases renew it, but a transfer is never held longer than "
            "4 \N{MULTIPLICATION SIGN} `release_timeout_s` in all, however often it is claimed."
        ),
        unit="s",
        bound=POSITIVE,
    )
    side_channel_timeout_s: float = option(
        10.0,
        summary="timeout of one side-channel exchange (metadata fetch, read-done notification).",
        unit="s",
        bound=POSITIVE,
    )
    #: HMAC key of every side-channel message; None: unauthenticated. Kept out of reprs.
    side_channel_secret: bytes | None = option(
        None,
        key_type=str,
        computed=Computed(f"`${SECRET_ENV}`, else none"),
        repr=False,
        summary=f"a secret shared by prefill and decode (at least {MIN_SECRET_CHARS} "
        "characters): every side-channel message then carries an HMAC-SHA256 of its bytes.",
        details=(
            "A peer without the secret is refused with a log line naming the setting. Prefer the "
            "environment variable: vLLM logs `kv_connector_extra_config` at start-up. It "
            "authenticates, it does not encrypt."
        ),
        allowed=f'at least {MIN_SECRET_CHARS} characters; `""`: none',
    )
    #: claim_wait_s ... receiver_threads: how decode reads
    receiver: ReceiverOptions = part()
    staging_buffer_mib: int = option(
        64,
        summary=(
            "decode staging buffer, allocated only when a decode rank can read a slice of token-"
            "major prefill blocks (prefill TP < decode TP with an `LBNHC`-style cache) or prefill "
            "blocks of another size from a head-major cache of known packing (vLLM CPU), which are "
            "cut by token through it. It is split into up to 4 areas of at least 32 MiB, one per "
            "request in flight; prefill ranks a request reads in parallel share its area."
        ),
        unit="MiB",
        bound=POSITIVE,
    )
    #: In an engine step that runs no tokens, how long a worker waits for a transfer to end. vLLM
    #: steps in a loop while a request only waits for KV (decode) or holds blocks for readers
    #: (prefill); each step costs the engine core and the workers CPU (and a shared-memory
    #: busy-wait), which on hosts where instances share cores is taken from the other instance's
    #: forward. A transfer that ends wakes the wait at once; a request arriving meanwhile waits
    #: for the step to end, so this bounds that delay too.
    idle_step_wait_ms: float = option(
        10.0,
        summary=(
            "in an engine step that runs no tokens (a decode request only waiting for its KV, "
            "prefill only holding blocks for readers), how long each worker waits for a transfer to"
            " end before the step returns; a transfer that ends wakes it at once."
        ),
        details=(
            "Longer waits mean fewer such steps and less CPU (0.5 cores at 10 ms, 0.17 at 50 ms for"
            " one waiting decode request on a 2-core host), but a request arriving meanwhile waits "
            "for the step to end. Raise it (e.g. 50) where prefill and decode share cores "
            "(docs/deploy-single-host.md)."
        ),
        unit="ms",
        bound=POSITIVE,
    )
    #: not read here: vllm-ascend's NPU worker reads it from the same dict
    ascend_local_comm_res_path: str | None = option(
        None,
        key_type=str,
        computed=Computed("none"),
        summary=(
            "not read by this connector: vllm-ascend's NPU worker reads it on A5 machines (the "
            "directory of its `ub_endpoint_npu_*.json` files) from `kv_connector_extra_config`, "
            "whichever connector runs, so it is accepted and passed through."
        ),
    )
    num_kv_heads: int
    is_mla: bool
    block_size: int
    dp_rank: int = 0
    #: This engine's index among the data-parallel engines its API server fronts, and how many
    #: those are: what vLLM's ``X-data-parallel-rank`` header takes. The global DP rank with
    #: one API server for every rank; the node-local one with ``--data-parallel-hybrid-lb`` or
    #: ``--data-parallel-external-lb``, whose API servers front only their node's engines.
    server_dp_rank: int = 0
    server_dp_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    #: every key's value but the secret's, in the key's unit, by name (what ``config.<key>``
    #: reads)
    settings: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    #: the draft (EAGLE/MTP) model's total KV heads, its layers' head group; 0: no draft model
    draft_kv_heads: int = 0

    def __getattr__(self, name: str) -> Any:
        """A key by its name (``config.read_retries``), in the key's unit, also where a part
        holds it (``config.receiver.read_retries``, the typed way)."""
        settings = self.__dict__.get("settings", {})
        if name in settings:
            return settings[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

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
        return self.receiver.max_descriptor_bytes

    @property
    def block_reads_from_bytes(self) -> int:
        """``block_reads_from_kib`` in bytes (0: never)."""
        return self.receiver.block_reads_from_bytes

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
        return self.receiver.claim_park_s

    def side_channel_base_port(self, dp_rank: int | None = None) -> int:
        """Port of TP rank 0 of a prefill DP rank; TP rank ``r`` listens on base + ``r``."""
        rank = self.dp_rank if dp_rank is None else dp_rank
        return self.side_channel_port + rank * self.prefill.tp_size


# -- the keys of kv_connector_extra_config, declared where they are read -------------------------

#: Every key of ``kv_connector_extra_config``, in the order docs/configuration.md lists them.
KEYS: tuple[Option, ...] = declared_options(ConnectorConfig)
KEYS_BY_NAME: dict[str, Option] = {key.name: key for key in KEYS}
#: Other connectors' keys -> (our key, how it is read), from the aliases the keys declare.
RENAMED_KEYS = renamed_keys(KEYS)


def key_table() -> str:
    """The key table of docs/configuration.md (``python scripts/config_table.py --write``)."""
    return key_table_markdown(KEYS)


def with_generated_key_table(markdown: str) -> str:
    """``markdown`` (docs/configuration.md) with the key table regenerated."""
    return with_key_table(markdown, key_table())


def _typed(key: Option, value: Any) -> Any:
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


def _settings(given: dict[str, Any], protocol: str) -> dict[str, Any]:
    """Every key checked by the table, given or defaulted (a default computed by code of its own
    in :func:`parse_config` is None here)."""

    def setting(key: Option) -> Any:
        if key.name in given:
            return given[key.name]
        if isinstance(key.default, Computed):
            return key.default.of_protocol(protocol) if key.default.of_protocol else None
        return key.default

    return {key.name: setting(key) for key in KEYS if not key.own_check}


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
    extra = migrate_keys(dict(extra or {}), kv_port, RENAMED_KEYS)
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
    settings = _settings(given, protocol)
    port = settings["side_channel_port"]
    if port + prefill.dp_size * prefill.tp_size > 65536:
        raise ConnectorConfigError(
            f"side_channel_port {port} leaves no room for {prefill.dp_size * prefill.tp_size} "
            f"prefill workers below 65536"
        )
    settings["protocol"] = protocol
    if "side_channel_host" not in given:
        settings["side_channel_host"] = default_host()
    del settings["side_channel_secret"]  # kept as bytes (the field), not again as text
    receiver = ReceiverOptions(
        **option_fields(ReceiverOptions, settings),
        claim_park_s=min(CLAIM_PARK_S, settings["side_channel_timeout_s"] / 2),
    )
    own = option_fields(ConnectorConfig, settings)
    return ConnectorConfig(
        **{**own, "prefill": prefill, "decode": decode, "side_channel_secret": _secret(given)},
        role=role,
        engine_id=engine_id,
        mooncake=MooncakeOptions(**option_fields(MooncakeOptions, settings)),
        receiver=receiver,
        num_kv_heads=num_kv_heads,
        draft_kv_heads=draft_kv_heads,
        is_mla=is_mla,
        block_size=block_size,
        dp_rank=dp_rank,
        server_dp_rank=server_dp[0],
        server_dp_size=server_dp[1],
        extra=extra,
        settings=settings,
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
