"""Handshake compatibility: refuse a peer whose KV bytes cannot be combined with ours.

Checked once per peer when its metadata is fetched, before any byte moves. Every mismatch is
named with both values, so an operator sees which flag to change; nothing is silently corrupted.
"""

from __future__ import annotations

from ..core.layout import LayoutError, Region, check_pairable
from ..core.topology import TopologyError, TransferTopology
from .wire import WorkerMetadata

#: Identity fields that name things for messages but need not match. Block sizes may differ
#: when one divides the other (checked below; the regions say whether their blocks can be split).
_NAMES_ONLY = ("model", "block_size")

#: What an operator changes when an identity field differs: the first sentence of the fix.
_FIX_BY_FIELD = {
    "dtype": "--dtype",
    "kv_cache_dtype": "--kv-cache-dtype",
    "head_size": "model",
    "num_kv_heads": "model",
    "num_layers": "model",
    "is_mla": "model",
    "model_config": "model",
    "attention_backend": "attention backend (same device type and, on CPU, same ISA)",
    "vllm_version": "vLLM version",
    "kv_cache_groups": (
        "model and hybrid KV cache manager setting (--disable-hybrid-kv-cache-manager on both "
        "or neither)"
    ),
}


class IncompatiblePeerError(ValueError):
    """The prefill and decode workers cannot exchange KV (different model, layout, geometry).

    ``incarnation``: the refused prefill worker's, once its metadata was read, so that decode
    can still tell it to release what it holds for the request."""

    incarnation: str = ""


def check_peer(local: WorkerMetadata, remote: WorkerMetadata, topology: TransferTopology) -> None:
    """Raise :class:`IncompatiblePeerError` unless decode ``local`` can read prefill ``remote``."""
    peer = f"prefill engine {remote.engine_id} rank {remote.tp_rank}"
    differing = [
        field
        for field in remote.identity.__struct_fields__
        if field not in _NAMES_ONLY
        and getattr(remote.identity, field) != getattr(local.identity, field)
    ]
    problems = [
        f"{field} {getattr(remote.identity, field)!r} on prefill vs "
        f"{getattr(local.identity, field)!r} on decode"
        for field in differing
    ]
    fixes = list(
        dict.fromkeys(f"the same {_FIX_BY_FIELD.get(field, field)}" for field in differing)
    )
    remote_block, local_block = remote.identity.block_size, local.identity.block_size
    if min(remote_block, local_block) < 1 or (
        remote_block % local_block and local_block % remote_block
    ):
        problems.append(
            f"block_size {remote_block} on prefill vs {local_block} on decode: neither divides "
            f"the other"
        )
        fixes.append("--block-size values where one divides the other")
    if problems:
        problems.append(
            f"prefill serves {remote.identity.model!r}, decode {local.identity.model!r}"
        )
    if fixes:
        problems.append("start both instances with " + " and ".join(fixes))
    if remote.tp_size != topology.prefill_tp:
        problems.append(
            f"prefill runs TP {remote.tp_size} but this decode instance is configured for "
            f"prefill TP {topology.prefill_tp} (kv_connector_extra_config prefill.tp_size)"
        )
    if remote.pp_size != 1:
        problems.append(f"prefill pipeline parallelism {remote.pp_size} is not supported (use 1)")
    if len(remote.regions) != len(local.regions):
        problems.append(
            f"{len(remote.regions)} KV regions on prefill vs {len(local.regions)} on decode"
        )
    if problems:
        raise IncompatiblePeerError(f"{peer} is incompatible: " + "; ".join(problems))
    for local_region, remote_region in zip(local.to_regions(), remote.to_regions(), strict=True):
        if local_region.name != remote_region.name:
            raise IncompatiblePeerError(
                f"{peer} is incompatible: region {remote_region.name!r} on prefill pairs with "
                f"{local_region.name!r} on decode (different layer order)"
            )
        try:
            check_pairable(local_region.layout, remote_region.layout, name=local_region.name)
        except LayoutError as exc:
            raise IncompatiblePeerError(f"{peer} is incompatible: {exc}") from exc
        if topology.is_mla:
            continue
        _check_region_heads(peer, local_region, remote_region, topology)


def _check_region_heads(
    peer: str, local_region: Region, remote_region: Region, topology: TransferTopology
) -> None:
    """A region pair must belong to one head group, and each side hold what that group's
    sharding gives it (a draft layer's own head count included)."""
    try:
        group = topology.group(local_region.layout.kv_heads)
        remote_group = topology.group(remote_region.layout.kv_heads)
    except TopologyError as exc:
        raise IncompatiblePeerError(
            f"{peer} is incompatible: region {local_region.name}: {exc}"
        ) from exc
    if remote_group is not group:
        raise IncompatiblePeerError(
            f"{peer} is incompatible: region {local_region.name}'s layer has "
            f"{remote_group.num_kv_heads} KV heads on prefill and {group.num_kv_heads} on "
            f"decode: the two instances run different (draft) models"
        )
    if (
        remote_region.layout.num_heads != group.prefill_heads_per_rank
        or local_region.layout.num_heads != group.decode_heads_per_rank
    ):
        raise IncompatiblePeerError(
            f"{peer} is incompatible: region {local_region.name} holds "
            f"{remote_region.layout.num_heads} heads on prefill and "
            f"{local_region.layout.num_heads} on decode, but {group.describe()}"
        )
