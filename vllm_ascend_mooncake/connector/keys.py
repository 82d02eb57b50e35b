"""Every key of ``kv_connector_extra_config``, declared once: type, default, unit, bound,
meaning, and the keys of other Mooncake connectors read as it. :func:`~.config.parse_config`
checks given values against these declarations, :mod:`.migration` reads the other connectors'
spellings from them, and docs/configuration.md's key table is generated from them (``python
scripts/config_table.py --write``; ``tests/connector/test_config_docs.py`` fails while the docs
differ). The lowest module of the configuration: the connector's name and the configuration's
error type live here too."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any

from ..datapath.pairing import parse_endpoints
from ..datapath.transport import TRANSPORTS
from ..defaults import (
    CONNECTOR_NAME,
    DEFAULT_CLAIM_PARK_S,
    DEFAULT_CLAIM_WAIT_S,
    DEFAULT_COALESCE_RUNS,
    DEFAULT_DEVICE_NAME,
    DEFAULT_IDLE_STEP_WAIT_MS,
    DEFAULT_MAX_DESCRIPTORS_PER_BATCH,
    DEFAULT_PAIR_WAIT_S,
    DEFAULT_PREFILL_WAIT_S,
    DEFAULT_PROTOCOLS,
    DEFAULT_READ_RETRIES,
    DEFAULT_RECEIVER_THREADS,
    DEFAULT_RELEASE_TIMEOUT_S,
    DEFAULT_SIDE_CHANNEL_PORT,
    DEFAULT_SIDE_CHANNEL_TIMEOUT_S,
    DEFAULT_STAGING_BUFFER_MIB,
    DEFAULT_TRANSPORT,
    FALLBACK_PROTOCOL,
    PAIRING_WAIT_S,
    PROTOCOLS,
    READ_WAITS,
    default_block_reads_from_kib,
    default_max_descriptor_kib,
    default_read_wait,
)
from ..handoff import SECRET_ENV as SECRET_ENV

#: vLLM's default ``KVTransferConfig.kv_port``. A kv_port equal to it cannot be told from one left
#: unset, so only another value is read (as ``side_channel_port``, see
#: :func:`.migration.explicit_kv_port`).
VLLM_DEFAULT_KV_PORT = 14579

VLLM_ASCEND = "vllm-ascend's MooncakeConnectorV1"
VLLM_MOONCAKE = "vLLM's MooncakeConnector"


class ConnectorConfigError(ValueError):
    """The connector configuration is invalid for this engine."""


MIN_SECRET_CHARS = 16


@dataclass(frozen=True)
class Bound:
    """The values a key accepts beyond its type."""

    #: what a refusal says the value must be (``... must be > 0, got 0``), and the docs show
    text: str
    ok: Callable[[Any], bool]
    #: how the docs show it, if not as ``text``
    markdown: str = ""
    #: the refusal, if not ``{where} must be {text}, got {value!r}`` (a format string)
    refusal: str = ""

    def refuse(self, where: str, value: Any) -> ConnectorConfigError:
        if self.refusal:
            return ConnectorConfigError(self.refusal.format(where=where, value=value))
        return ConnectorConfigError(f"{where} must be {self.text}, got {value!r}")


POSITIVE = Bound("> 0", lambda value: value > 0)
NON_NEGATIVE = Bound(">= 0", lambda value: value >= 0)
PORT = Bound("a port number, 1 to 65535", lambda value: 1 <= value <= 65535, "1 to 65535")


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


def one_of(values: tuple[str, ...], refusal: str = "") -> Bound:
    """One of ``values`` (refused as ``refusal`` says, if given)."""
    return Bound(
        f"one of {', '.join(values)}",
        lambda value: value in values,
        ", ".join(f"`{value}`" for value in values),
        refusal,
    )


@dataclass(frozen=True)
class Computed:
    """A default that is not one value: computed when the configuration is parsed."""

    #: how the docs show it
    markdown: str
    #: the default as a function of the protocol; None: :func:`~.config.parse_config` computes it
    of_protocol: Callable[[str], Any] | None = None


def _literal(value: Any) -> str:
    """A value as the docs write it: ``120`` for 120.0, ``true``, ``""``."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, float):
        text = f"{value:g}"
    elif value == "":
        text = '""'
    else:
        text = str(value)
    return f"`{text}`"


def by_protocol(of_protocol: Callable[[str], Any]) -> Computed:
    """A default that is one value over tcp and another on every other transport."""
    return Computed(
        f"{_literal(of_protocol('tcp'))} with `tcp`, else {_literal(of_protocol('rdma'))}",
        of_protocol,
    )


def port_number(where: str, value: Any) -> int:
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
class Alias:
    """A key of another connector that means the same as one of ours: read under our name with
    a warning naming the key to write instead (docs/migration.md)."""

    name: str
    origin: str
    #: the value under our key, from the alias's value; raises naming ``where`` if unusable
    convert: Callable[[str, Any], Any]
    note: str = ""


@dataclass(frozen=True)
class Key:
    """One key of ``kv_connector_extra_config``: how it is checked, and how the docs show it.
    Everything after the default is named where declared (no field can be taken for another)."""

    name: str
    type: type
    #: the value when the key is not set: a plain value, or :class:`Computed`
    default: Any
    _: KW_ONLY
    #: one line: what the key sets (the first sentence of its row in the docs)
    summary: str
    #: the rest of its row in the docs
    details: str = ""
    unit: str = ""
    #: checked on every given value by :func:`~.config.parse_config` (with the type)
    bound: Bound | None = None
    #: given values that mean "the default" (kept: earlier versions accepted them)
    as_default: Bound | None = None
    #: checked, type included, by the key's own code in :func:`~.config.parse_config`; the docs show
    #: ``allowed`` then
    own_check: bool = False
    #: the docs' type column, if not the type's name
    type_markdown: str = ""
    #: the docs' allowed column, if not the bound's
    allowed: str = ""
    #: keys of other connectors read as this one
    aliases: tuple[Alias, ...] = ()

    def allowed_markdown(self) -> str:
        text = self.allowed or (
            (self.bound.markdown or self.bound.text) if self.bound is not None else "any"
        )
        if self.as_default is not None:
            text += f" ({self.as_default.markdown or self.as_default.text}: the default)"
        return text

    def default_markdown(self) -> str:
        if isinstance(self.default, Computed):
            return self.default.markdown
        return _literal(self.default)

    def row(self) -> str:
        meaning = f"{self.summary} {self.details}" if self.details else self.summary
        cells = (
            f"`{self.name}`",
            self.type_markdown or self.type.__name__,
            self.unit,
            self.default_markdown(),
            self.allowed_markdown(),
            meaning,
        )
        return "| " + " | ".join(cells) + " |"


_SIZES_ALLOWED = "`tp_size` and `dp_size` > 0"
_BY_DEVICE = Computed(
    ", ".join(f"`{protocol}` on {device.upper()}" for device, protocol in DEFAULT_PROTOCOLS.items())
    + f", else `{FALLBACK_PROTOCOL}`"
)

#: Every key of ``kv_connector_extra_config``, in the order docs/configuration.md lists them
#: (its table is generated from this: ``python scripts/config_table.py --write``).
KEYS: tuple[Key, ...] = (
    Key(
        "prefill",
        dict,
        Computed("the local TP, DP 1"),
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
    ),
    Key(
        "decode",
        dict,
        Computed("the local TP, DP 1"),
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
    ),
    Key(
        "transport",
        str,
        DEFAULT_TRANSPORT,
        summary="what moves the KV bytes between instances.",
        details=(
            "Only the Mooncake Transfer Engine today; the data path reaches it through one seam "
            "(`datapath/transport.py`), where another would be added."
        ),
        bound=one_of(TRANSPORTS),
    ),
    Key(
        "protocol",
        str,
        _BY_DEVICE,
        summary="Mooncake transport.",
        details="With `tcp`, `MC_FORCE_TCP=1` is set unless you set it.",
        bound=one_of(
            PROTOCOLS,
            "{where} {value!r} is not a Mooncake transport (" + ", ".join(PROTOCOLS) + ")",
        ),
        aliases=(
            Alias("mooncake_protocol", VLLM_MOONCAKE, _string),
            Alias("use_ascend_direct", VLLM_ASCEND, _ascend_direct_protocol),
        ),
    ),
    Key(
        "device_name",
        str,
        DEFAULT_DEVICE_NAME,
        summary="Mooncake NIC/device list (`mlx5_0,mlx5_1`); empty = auto.",
    ),
    Key(
        "side_channel_host",
        str,
        Computed(
            "`$VLLM_HOST_IP`, else the host's address as vLLM picks it (`get_ip()`), else "
            "`127.0.0.1`"
        ),
        summary="address workers listen on and advertise (the KV side channel and Mooncake).",
        details=(
            "Decode connects to the one prefill advertises; a decode instance with a network "
            "address warns once per prefill that advertises loopback (a multi-host deployment whose"
            " prefill kept a loopback setting)."
        ),
    ),
    Key(
        "side_channel_port",
        int,
        DEFAULT_SIDE_CHANNEL_PORT,
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
    ),
    Key(
        "prefill_side_channels",
        str,
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
    ),
    Key(
        "pair_wait_s",
        float,
        DEFAULT_PAIR_WAIT_S,
        summary=(
            "how long decode's start-up waits for each prefill of `prefill_side_channels` to "
            "answer."
        ),
        unit="s",
        bound=POSITIVE,
    ),
    Key(
        "pair_before_pull",
        bool,
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
    ),
    Key(
        "release_timeout_s",
        float,
        DEFAULT_RELEASE_TIMEOUT_S,
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
    ),
    Key(
        "side_channel_timeout_s",
        float,
        DEFAULT_SIDE_CHANNEL_TIMEOUT_S,
        summary="timeout of one side-channel exchange (metadata fetch, read-done notification).",
        unit="s",
        bound=POSITIVE,
    ),
    Key(
        "side_channel_secret",
        str,
        Computed(f"`${SECRET_ENV}`, else none"),
        summary=f"a secret shared by prefill and decode (at least {MIN_SECRET_CHARS} "
        "characters): every side-channel message then carries an HMAC-SHA256 of its bytes.",
        details=(
            "A peer without the secret is refused with a log line naming the setting. Prefer the "
            "environment variable: vLLM logs `kv_connector_extra_config` at start-up. It "
            "authenticates, it does not encrypt."
        ),
        allowed=f'at least {MIN_SECRET_CHARS} characters; `""`: none',
    ),
    Key(
        "claim_wait_s",
        float,
        DEFAULT_CLAIM_WAIT_S,
        summary=(
            "before reading, decode claims a read lease from each prefill rank; a rank that has not"
            " registered the request yet (it learns of it one engine step after answering) is asked"
            " again for up to this long."
        ),
        details=(
            "A rank that already released the request refuses, so a late read never sees reused "
            "blocks. The lease lasts `release_timeout_s` and is renewed before reading when half of"
            " it has passed; bytes read after the lease ended are discarded."
        ),
        unit="s",
        bound=POSITIVE,
    ),
    Key(
        "prefill_wait_s",
        float,
        DEFAULT_PREFILL_WAIT_S,
        summary=(
            "the same wait for a request whose decode leg was sent alongside its prefill (the "
            'proxy\'s overlapped legs): the lease is "pending" until prefill is done.'
        ),
        details=f"Prefill holds a pending claim open (up to {DEFAULT_CLAIM_PARK_S:g} s, or half of "
        "`side_channel_timeout_s`, at a time) and answers it the moment it registers the "
        "request, so decode neither polls nor waits longer than needed. A prefill request that "
        "is aborted refuses the lease at once.",
        unit="s",
        bound=POSITIVE,
    ),
    Key(
        "read_retries",
        int,
        DEFAULT_READ_RETRIES,
        summary=(
            "extra attempts, with a short backoff, for a batched read that failed (transient "
            "transport errors)."
        ),
        bound=NON_NEGATIVE,
    ),
    Key(
        "max_descriptors_per_batch",
        int,
        DEFAULT_MAX_DESCRIPTORS_PER_BATCH,
        summary="cap on descriptors per read call.",
        details=(
            "Mooncake's TCP transport rejects batches past about 2,000 outstanding descriptors per "
            "peer."
        ),
        bound=POSITIVE,
    ),
    Key(
        "max_descriptor_kib",
        int,
        by_protocol(default_max_descriptor_kib),
        summary="split descriptors larger than this many KiB (0: never).",
        details=(
            "Mooncake's TCP transport moves ~1 MiB descriptors faster than much larger ones; RDMA "
            "slices large ones itself. A negative value is read as the default, not refused."
        ),
        unit="KiB",
        bound=NON_NEGATIVE,
        as_default=Bound("< 0", lambda value: value < 0),
    ),
    Key(
        "coalesce_runs",
        bool,
        DEFAULT_COALESCE_RUNS,
        summary=(
            "run-level coalescing for heterogeneous TP: one descriptor per block run and pull, "
            "followed by a local permutation."
        ),
        details="`false` reads block by block (no permutation for head-major caches).",
    ),
    Key(
        "block_reads_from_kib",
        int,
        by_protocol(default_block_reads_from_kib),
        summary=(
            "head-major merges (prefill TP > decode TP) read block by block, with no local "
            "permutation, when a prefill block is at least this many KiB (0: never)."
        ),
        details=(
            "Over TCP per-block reads of 256 KiB blocks beat run-level coalescing plus its "
            "permutation, 128 KiB blocks did not (see benchmarks/README.md); smaller blocks stay "
            "coalesced. A negative value is read as the default, not refused."
        ),
        unit="KiB",
        bound=NON_NEGATIVE,
        as_default=Bound("< 0", lambda value: value < 0),
    ),
    Key(
        "verify_reads",
        bool,
        False,
        summary=(
            "decode only: check every read batch end to end before the pull is reported: decode "
            "compares the checksum of the bytes that landed with prefill's checksum of the bytes it"
            " serves."
        ),
        details=(
            "A mismatch (corruption in flight, a planned destination written short or not at all, "
            "blocks changed under the read) fails the pull, counted and logged, instead of loading "
            "wrong KV. It checks the transport's copy of the ranges the plan chose, not the plan: "
            "a wrong offset or block chosen by the planner, and the copies and swaps that run after"
            " the bytes land, pass unseen (datapath/verify.py). It costs a "
            "side-channel round trip per batch and a checksum pass over the bytes on both sides, on"
            " the KV's own device (benchmarks/README.md); both sides must run a version that knows "
            "it."
        ),
    ),
    Key(
        "receiver_threads",
        int,
        DEFAULT_RECEIVER_THREADS,
        summary=(
            "decode threads issuing reads; different prefill peers are read in parallel, one peer "
            "in order."
        ),
        bound=POSITIVE,
    ),
    Key(
        "staging_buffer_mib",
        int,
        DEFAULT_STAGING_BUFFER_MIB,
        summary=(
            "decode staging buffer, allocated only when a decode rank can read a slice of token-"
            "major prefill blocks (prefill TP < decode TP with an `LBNHC`-style cache) or prefill "
            "blocks of another size from a head-major cache of known packing (vLLM CPU), which are "
            "cut by token through it. It is split into up to 4 areas of at least 32 MiB, one per "
            "request in flight; prefill ranks a request reads in parallel share its area."
        ),
        unit="MiB",
        bound=POSITIVE,
    ),
    Key(
        "read_wait",
        str,
        by_protocol(default_read_wait),
        summary=(
            "how a read waits for Mooncake: `poll` submits one asynchronous batch per descriptor "
            "and sleeps between status checks; `sync` is Mooncake's `batch_transfer_sync_read`, "
            "which keeps a core spinning per read in flight (see docs/deploy-single-host.md, small "
            "CPU hosts)."
        ),
        bound=one_of(READ_WAITS),
        as_default=Bound('""', lambda value: value == "", '`""`'),
    ),
    Key(
        "idle_step_wait_ms",
        float,
        DEFAULT_IDLE_STEP_WAIT_MS,
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
    ),
    Key(
        "ascend_local_comm_res_path",
        str,
        Computed("none"),
        summary=(
            "not read by this connector: vllm-ascend's NPU worker reads it on A5 machines (the "
            "directory of its `ub_endpoint_npu_*.json` files) from `kv_connector_extra_config`, "
            "whichever connector runs, so it is accepted and passed through."
        ),
    ),
)
KEYS_BY_NAME: dict[str, Key] = {key.name: key for key in KEYS}

#: The markers around the generated key table in docs/configuration.md.
KEY_TABLE_BEGIN = "<!-- keys:begin: generated, run python scripts/config_table.py --write -->"
KEY_TABLE_END = "<!-- keys:end -->"


def key_table_markdown() -> str:
    """The key table of docs/configuration.md, one row per entry of :data:`KEYS`."""
    header = ("key", "type", "unit", "default", "allowed", "meaning")
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *(key.row() for key in KEYS),
    ]
    return "\n".join(lines) + "\n"


def with_key_table(markdown: str) -> str:
    """``markdown`` (docs/configuration.md) with the table between the markers regenerated."""
    before, begin, rest = markdown.partition(KEY_TABLE_BEGIN)
    _, end, after = rest.partition(KEY_TABLE_END)
    if not begin or not end:
        raise ValueError(f"no {KEY_TABLE_BEGIN!r} ... {KEY_TABLE_END!r} in the markdown")
    return f"{before}{KEY_TABLE_BEGIN}\n{key_table_markdown()}{KEY_TABLE_END}{after}"
