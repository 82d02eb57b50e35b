"""The vLLM-facing connector: a thin facade over the scheduler side and the worker side.

vLLM builds this class once in the scheduler process (role SCHEDULER) and once per worker (role
WORKER). Transfers happen between steps, outside the forward pass, so the layer-wise hooks are
no-ops.

A step's orders (holds, pulls, drops, cancels) are applied when vLLM binds the step's metadata,
before the forward, not in ``start_load_kv``: vLLM 0.32 calls ``start_load_kv`` after the forward
when no load is synchronous, which delayed every hold (and so decode's read) and every pull by a
whole forward of the instance's other requests (a 256-token prefill: 40 ms on 2 CPU cores).

Hooks that only some vLLM releases call (sleep mode, KV cache access, cache-hit sources, loaded
groups) are defined here for all of them; :mod:`.vllm_compat` holds what differs between releases.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ..datapath.orders import StepOrders
from . import vllm_compat
from .config import config_from_vllm
from .kv_groups import transfer_group_ids
from .scheduler import ConnectorScheduler
from .stats import TransferPromMetrics, TransferStats

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


@dataclass
class StepMetadata(KVConnectorMetadata):
    orders: StepOrders = field(default_factory=StepOrders)
    #: set in the worker once its orders were handed to the worker side (they run once)
    applied: bool = False


class MooncakeHeteroConnector(KVConnectorBase_V1, vllm_compat.SupportsHMA):
    """P/D disaggregation over Mooncake with heterogeneous TP (GQA head merge and slice).

    ``SupportsHMA`` keeps vLLM's hybrid KV cache manager on: a model whose layers differ in kind
    (sliding window beside full attention) gets a KV cache group per kind, each moved with its
    own block ids (:mod:`.kv_groups`); kinds the transfer cannot move are refused at start-up."""

    # vLLM 0.33+ labels external prefix-cache hits by tier: a pull comes from a peer instance.
    _cache_hit_source = vllm_compat.p2p_cache_hit_source()

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._config = config_from_vllm(vllm_config)
        self._scheduler: ConnectorScheduler | None = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = ConnectorScheduler(self._config, kv_cache_config)
        else:
            from .worker import ConnectorWorker

            self._worker = ConnectorWorker(self._config, vllm_config, kv_cache_config)

    # -- class-level hooks ---------------------------------------------------------------------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Head-major blocks: a head slice is one byte range, so pulls land in place."""
        if vllm_config.model_config is not None and vllm_config.model_config.use_mla:
            return None
        return vllm_compat.HEAD_MAJOR_LAYOUT

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """vLLM 0.34+: the workers register the KV cache with Mooncake (RDMA on NPUs and GPUs),
        so each segment of a growable KV cache must be one physical allocation."""
        return vllm_compat.registers_kv_cache_access()

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33+: sleep and wake are followed by :meth:`unregister_kv_caches` and
        :meth:`restore_kv_caches` (the KV cache keeps its addresses, its contents are lost)."""
        return True

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TransferStats | None:
        return TransferStats(data=data) if data is not None else TransferStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> TransferPromMetrics:
        return TransferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- scheduler side ------------------------------------------------------------------------

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """vLLM 0.33+: a pull restores the request's blocks of every transferred group."""
        return transfer_group_ids(self._kv_cache_config)

    def on_new_request(self, request: Request) -> None:
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if scheduler_output.scheduled_new_reqs:
            self._scheduler.note_scheduled(
                [new.req_id for new in scheduler_output.scheduled_new_reqs]
            )
        orders = self._scheduler.build_step_orders()
        orders.idle = scheduler_output.total_num_scheduled_tokens == 0
        return StepMetadata(orders)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        stats = connector_output.kv_connector_stats
        if isinstance(stats, TransferStats):
            for engine_id, reason in stats.unpairable_engines():
                self._scheduler.pairings.note_unpairable(engine_id, reason)
            for verdict in stats.pairings():
                self._scheduler.pairings.note_verdict(verdict)
        self._scheduler.filter_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM without its hybrid manager (one KV cache group)."""
        return self._scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid manager: the request's blocks per KV cache group."""
        return self._scheduler.request_finished(request, block_ids)

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33+, before sleep (or discarding the KV cache): stop serving and reading KV
        and drop the Mooncake registrations. Idempotent."""
        self._worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """vLLM 0.33+, after wake-up: register the KV cache again and serve; transfers held
        before the sleep stay refused. Idempotent."""
        self._worker.restore_kv_caches()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._apply_orders(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._apply_orders(self._get_connector_metadata())

    def _apply_orders(self, metadata: KVConnectorMetadata) -> None:
        """Hand the step's orders to the worker side, once, as early as vLLM lets us (binding,
        before the forward); ``start_load_kv`` only catches a runner that never binds."""
        assert isinstance(metadata, StepMetadata)
        if metadata.applied or self._worker is None:
            return
        metadata.applied = True
        self._worker.start_load_kv(metadata.orders)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any):
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        metadata = self._connector_metadata
        idle = isinstance(metadata, StepMetadata) and metadata.orders.idle
        sending, recving = self._worker.get_finished(idle)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> TransferStats | None:
        if self._worker is None:
            return None
        return self._worker.stats.take()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
