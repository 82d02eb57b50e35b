"""Keys of other Mooncake connectors, read under our names or refused saying why.

vllm-ascend's ``MooncakeConnectorV1`` and vLLM's ``MooncakeConnector`` are configured with keys
of their own. Those that mean the same as one of ours are declared with our key (its
``aliases``, where the key is declared: :data:`.config.KEYS`) and read under our name with a
warning naming the key to write instead; those with no equivalent are refused with the reason
(``docs/migration.md``). :func:`migrate_keys` does this before :mod:`.config` validates the keys.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

from ..log import get_logger
from ..names import CONNECTOR_NAME, VLLM_ASCEND, VLLM_MOONCAKE
from ..options import Alias, ConnectorConfigError, Option

#: vLLM's default ``KVTransferConfig.kv_port``. A kv_port equal to it cannot be told from one left
#: unset, so only another value is read (as ``side_channel_port``, see :func:`explicit_kv_port`).
VLLM_DEFAULT_KV_PORT = 14579


def _log() -> logging.Logger:
    # Fetched when needed: the plugin and the launcher import this module before vLLM's logging.
    return get_logger(__name__)


def renamed_keys(keys: Iterable[Option]) -> dict[str, tuple[str, Alias]]:
    """Other connectors' keys -> (our key, how it is read), from the aliases ``keys`` declare."""
    return {alias.name: (key.name, alias) for key in keys for alias in key.aliases}


def port_number(where: str, value: Any) -> int:
    """A port given as an int, or as a decimal string (vllm-ascend's guides write ``"36000"``)."""
    if isinstance(value, str) and value.strip().isdecimal():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ConnectorConfigError(f"{where} must be a port number, got {value!r}")


#: Keys of other connectors with no equivalent here: refused, saying why (docs/migration.md).
REFUSED_KEYS: dict[str, str] = {
    "num_workers": f"{VLLM_MOONCAKE} sizes its prefill-side sender thread pool with it; here "
    f"prefill moves no bytes (decode reads them), and the decode readers are receiver_threads",
    "bootstrap_server_address": f"{VLLM_MOONCAKE}'s bootstrap server; there is none here: "
    f"decode takes the prefill's address from the kv_transfer_params the proxy forwards. Remove it",
    "tls_config": "vllm-ascend's MooncakeLayerwiseConnector uses it for its metaserver; this "
    "connector has no metaserver (decode pulls after prefill, no layer-wise push). Remove it",
}

#: Environment variables of those connectors that this one does not read, and what to set instead.
FOREIGN_ENV: dict[str, str] = {
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
    return port_number("kv_transfer_config.kv_port", port)


def migrate_keys(
    extra: dict[str, Any], kv_port: int | None, renamed: dict[str, tuple[str, Alias]]
) -> dict[str, Any]:
    """``extra`` with other connectors' keys replaced by ours; refuses those that mean nothing
    here, and an old and a new spelling of one setting that disagree. ``kv_port``: what
    :func:`explicit_kv_port` read from ``kv_transfer_config``; ``renamed``: the other
    connectors' keys (:func:`renamed_keys`)."""
    refused = sorted(set(extra) & set(REFUSED_KEYS))
    if refused:
        raise ConnectorConfigError(
            f"kv_connector_extra_config key(s) of other connectors that {CONNECTOR_NAME} does not "
            f"accept: " + "; ".join(f"{key!r}: {REFUSED_KEYS[key]}" for key in refused)
        )
    migrated = {key: value for key, value in extra.items() if key not in renamed}
    # our key -> [(where the user wrote it, the value under our key, a note for the log)]
    old_spellings: dict[str, list[tuple[str, Any, str]]] = {}
    for key, value in extra.items():
        if key in renamed:
            ours, alias = renamed[key]
            where = f"kv_connector_extra_config[{key!r}] ({alias.origin})"
            old_spellings.setdefault(ours, []).append(
                (where, alias.convert(where, value), alias.note)
            )
    if kv_port is not None:
        ours, alias = renamed["kv_port"]
        old_spellings.setdefault(ours, []).append(
            (f"kv_transfer_config.kv_port ({alias.origin})", kv_port, alias.note)
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
    for name, instead in FOREIGN_ENV.items():
        if name in os.environ:
            _log().warning("%s is set, but %s does not read it: %s", name, CONNECTOR_NAME, instead)
    return migrated


#: vllm-ascend's pipeline keys in ``prefill``/``decode``; only pipeline size 1 runs here.
PIPELINE_KEYS = ("pp_size", "pp_layer_partition")


def refuse_pipeline(side: str, sizes: dict[str, Any]) -> None:
    """Accept vllm-ascend's ``pp_size: 1`` in ``prefill``/``decode`` (with a note that it can
    go); refuse real pipeline parallelism."""
    pp_size = sizes.get("pp_size", 1)
    if "pp_layer_partition" in sizes or type(pp_size) is not int or pp_size != 1:
        given = {key: sizes[key] for key in PIPELINE_KEYS if key in sizes}
        raise ConnectorConfigError(
            f"kv_connector_extra_config[{side!r}] asks for pipeline parallelism with {given} "
            f"(keys of {VLLM_ASCEND}); {CONNECTOR_NAME} supports pipeline parallel size 1 only: "
            f"use tensor parallelism and remove these keys"
        )
    if "pp_size" in sizes:
        _log().info(
            "kv_connector_extra_config[%r]['pp_size'] = 1 (%s) is the only pipeline size %s "
            "runs; the key can be removed",
            side,
            VLLM_ASCEND,
            CONNECTOR_NAME,
        )
