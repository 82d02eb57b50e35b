"""Where the vLLM releases this connector supports (0.23 to 0.34) differ, in one place.

Each difference is detected by what the installed vLLM has (an attribute, an enum member, a
signature), never by its version string, so a backport or a vllm-ascend build that carries a
newer API is served by the newer path. Each shim names the vLLM behaviour it adapts to; the
differences are listed with what was run where in docs/compatibility.md.

Differences that need no shim, because the connector's code is already written for both:

* ``request_finished`` receives every block of the request on 0.23 and only the blocks of
  computed tokens on 0.30+: the scheduler side keeps the prompt's blocks either way
  (``scheduler.request_finished``).
* vLLM 0.32 calls ``start_load_kv`` after the forward when no load is synchronous, 0.34's worker
  connector API passes keyword arguments to it: the orders are applied when the metadata is
  bound (``facade._apply_orders``) and ``start_load_kv`` accepts any keyword.
* vllm-ascend hands ``(K, V)`` or MLA ``(nope, rope)`` tuples per layer on every release
  (``datapath/registration.regions_from_split_caches``).
"""

from __future__ import annotations

from typing import Any

try:  # vLLM's hybrid KV cache manager stays on for a connector subclassing it
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # a release without it never asks

    class SupportsHMA:  # type: ignore[no-redef]
        """Stands in for vLLM's ``SupportsHMA`` where the installed vLLM has none."""


#: The head-major layout's name on every supported release. vLLM 0.23 knows only the FlashInfer
#: names ``NHD``/``HND`` (its CUDA backends raise "Unknown cache layout format" for anything
#: else); 0.30+ name layouts by stride order and read ``HND`` as ``LBHNC``
#: (``vllm/config/cache.py``, ``_LAYOUT_COMPAT_ALIASES``).
HEAD_MAJOR_LAYOUT = "HND"

#: The resolved-layout name (0.30+: ``CacheConfig.get_resolved_kv_cache_layout().name``) that
#: :data:`HEAD_MAJOR_LAYOUT` resolves to.
RESOLVED_HEAD_MAJOR_LAYOUT = "LBHNC"


def chat_takes_forwarded_prompt_ids() -> bool:
    """vLLM 0.30+'s chat endpoint takes a request's prompt as token ids forwarded in
    ``kv_transfer_params["prompt_token_ids"]`` instead of rendering its messages
    (``vllm/renderers/online_renderer.py``, ``_reused_prompt_token_ids``): what a decode that
    continues a chat request from prefill's token needs. vLLM 0.23 renders the messages."""
    try:
        from vllm.renderers import online_renderer
    except ImportError:
        return False
    return hasattr(online_renderer, "_reused_prompt_token_ids")


def p2p_cache_hit_source() -> Any | None:
    """vLLM 0.33+ labels each connector's external prefix-cache hits by tier
    (``KVConnectorBase_V1._cache_hit_source``, ``vllm.v1.metrics.cache_hit_source``): ours come
    from a peer instance, ``P2P``. None where vLLM has no such label."""
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:
        return None
    return getattr(CacheHitSource, "P2P", None)


def registers_kv_cache_access() -> Any:
    """vLLM 0.34's ``KVCacheAccess`` flag for a connector that registers the KV cache with an
    RDMA engine (Mooncake does): the growable ("extensible") KV cache then backs each segment
    by one physical allocation, so one registration covers it. vLLM calls
    ``kv_cache_access()`` only where the enum exists (``vllm/config/kv_transfer.py``)."""
    from vllm.config.kv_transfer import KVCacheAccess

    return KVCacheAccess.REGISTERS


def head_major_layout_requested() -> bool:
    """Whether ``VLLM_KV_CACHE_LAYOUT`` asks for head-major caches: the only setting
    vllm-ascend's attention backend shapes its K and V tensors by
    (``AscendAttentionBackend.get_kv_cache_shape``, 0.30.0rc2: ``HND`` or ``LBHNC``)."""
    import os

    return os.environ.get("VLLM_KV_CACHE_LAYOUT", "") in ("HND", "LBHNC")


def resolved_kv_cache_layout(vllm_config: Any) -> str | None:
    """The layout vLLM resolved for the KV cache (0.30+), or None where it does not say (0.23
    keeps the layout in a module global and its CPU backend is always head-major)."""
    resolve = getattr(vllm_config.cache_config, "get_resolved_kv_cache_layout", None)
    if resolve is None:
        return None
    try:
        return resolve().name
    except Exception:  # not resolved yet (no worker reported), or a backend vLLM cannot name
        return None


def data_parallel_index(parallel_config: Any) -> int:
    """This engine's data-parallel rank. vLLM 0.32+ runs each DP engine of a dense model as an
    independent DP 1 engine, resetting ``data_parallel_rank`` to 0 and keeping the rank in
    ``data_parallel_index``; older releases have no such field and keep the rank where it was."""
    return getattr(parallel_config, "data_parallel_index", parallel_config.data_parallel_rank)
