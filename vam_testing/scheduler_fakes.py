"""The connector's scheduler side on its own, with real vLLM requests and block lists.

Shared by ``tests/connector/test_scheduler.py`` and ``benchmarks/micro/bench_scheduler.py``: a
:class:`~vllm_ascend_mooncake.connector.scheduler.ConnectorScheduler` configured as vLLM would for a
prefill or a decode instance (on CPU, no engine), vLLM ``Request`` objects carrying
``kv_transfer_params``, and the ``KVCacheBlocks`` an allocation hands the connector. Imports vLLM.
"""

from __future__ import annotations

from typing import Any

from vllm import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request

from vllm_ascend_mooncake.connector.config import parse_config
from vllm_ascend_mooncake.connector.scheduler import ConnectorScheduler

#: The prefill engine id every scheduler here gets unless told otherwise (decode's params name it).
ENGINE_ID = "engine-p"


def connector_scheduler(
    role: str,
    *,
    prefill_tp: int,
    decode_tp: int = 1,
    num_kv_heads: int,
    block_size: int,
    extra: dict[str, Any] | None = None,
    engine_id: str = ENGINE_ID,
    kv_cache_config: Any = None,
) -> ConnectorScheduler:
    """The scheduler side of a ``role`` (``"kv_producer"`` or ``"kv_consumer"``) instance of a
    prefill TP ``prefill_tp`` -> decode TP ``decode_tp`` deployment, no data parallelism;
    ``extra`` adds to (or replaces) its ``kv_connector_extra_config``. No worker answers a
    pairing probe here, so ``pair_before_pull`` is off unless ``extra`` turns it on (the
    probe's own tests do, and answer it)."""
    return ConnectorScheduler(
        parse_config(
            kv_role=role,
            engine_id=engine_id,
            extra={
                "prefill": {"tp_size": prefill_tp},
                "decode": {"tp_size": decode_tp},
                "pair_before_pull": False,
                **(extra or {}),
            },
            local_tp=prefill_tp if role == "kv_producer" else decode_tp,
            local_dp=1,
            num_kv_heads=num_kv_heads,
            is_mla=False,
            block_size=block_size,
            device_type="cpu",
        ),
        kv_cache_config,
    )


def vllm_request(
    request_id: str, num_tokens: int, params: dict[str, Any] | None, max_tokens: int = 4
) -> Request:
    """A vLLM request of ``num_tokens`` prompt tokens with ``params`` as its
    ``kv_transfer_params`` (none when ``params`` is None or empty)."""
    sampling = SamplingParams(
        max_tokens=max_tokens, extra_args={"kv_transfer_params": params} if params else None
    )
    return Request(request_id, list(range(num_tokens)), sampling, None)


def kv_blocks(ids: list[int]) -> KVCacheBlocks:
    """What vLLM's allocation hands ``update_state_after_alloc``: one KV cache group."""
    return KVCacheBlocks(([KVCacheBlock(i) for i in ids],))


__all__ = ["ENGINE_ID", "connector_scheduler", "kv_blocks", "vllm_request"]
