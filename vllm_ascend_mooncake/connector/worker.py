"""Worker side of the connector: register the KV cache, run the sender or receiver, report.

Every rank reports each request exactly once (vLLM counts one report per worker): a prefill rank
that no decode rank reads reports at once; a decode rank reports after its own pulls and fix-up.
A failed pull is reported finished *and* its blocks as load errors in the same step, so vLLM's
``kv_load_failure_policy`` decides between recompute and error; its bytes are never used.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

from ..core.groups import describe_groups
from ..core.layout import (
    BlockOrder,
    ChunkPacking,
    Region,
    head_chunk_token_bytes,
    packing_text,
)
from ..core.packing import chunk_packing
from ..datapath.failures import FailureKind
from ..datapath.orders import StepOrders
from ..datapath.pairing import pair_with_prefills, parse_endpoints
from ..datapath.prefill_service import PrefillSender
from ..datapath.receiver import Receiver
from ..datapath.registration import (
    LayerHeads,
    cache_parts,
    regions_from_split_caches,
    regions_from_vllm_views,
)
from ..datapath.transport import MemoryRange, Transport
from ..datapath.wire import ModelIdentity
from ..log import get_logger
from ..timeline import TimelineLog
from . import vllm_compat
from .attention_layers import (
    AttentionGeometry,
    LayerGeometry,
    attention_geometry,
    check_planned_heads,
    draft_layer_heads,
    draft_layer_names,
    refuse_hybrid_layers,
    refuse_unsupported_parallelism,
)
from .config import ConnectorConfig
from .identity import model_identity
from .kv_groups import group_of_layer, region_groups, transfer_group_specs
from .stats import TransferStats
from .vllm_defects import mla_plain_rope_on_cpu
from .wiring import (
    DecodeSide,
    KVCacheMemory,
    WorkerIdentity,
    build_decode_side,
    build_prefill_side,
    create_transport,
    decode_settings,
    prefill_settings,
)

logger = get_logger(__name__)
timeline_log = TimelineLog(get_logger(f"{__name__}.timeline"))

#: Why transfers are refused between vLLM's ``unregister_kv_caches`` and ``restore_kv_caches``.
ASLEEP = (
    "the instance is asleep (vLLM sleep mode): its KV cache is unregistered and its contents "
    "are discarded; wake it up (POST /wake_up) before sending requests"
)
#: Before vLLM's sleep mode discards the KV cache, the longest a decode worker waits for its reads
#: under way to settle (Mooncake's own transfer timeout, ``MC_TRANSFER_TIMEOUT``, is 30 s).
SLEEP_DRAIN_S = 30.0


def _chunk_packing(
    identity: ModelIdentity, views: Mapping[str, Any], head_size: int | None = None
) -> ChunkPacking:
    """The backend's head-major chunk packing (:mod:`..core.packing`), when it accounts for every
    byte of these views' (block, head) chunks; otherwise unknown (with a warning: only different
    block sizes on prefill and decode are then refused, equal ones are unaffected).

    The bytes a chunk holds per token come from each view's shape *and* strides
    (:func:`..core.layout.head_chunk_token_bytes`), every view alike, never from its last
    dimension alone: a chunk is whatever one head's contiguous bytes in a block are.
    ``head_size``: the views' layers' own (a draft model's), else the model's."""
    if not views or identity.is_mla:
        return ()
    head_size = head_size or identity.head_size
    first = next(iter(views.values()))
    element_size = first.element_size()
    packing = chunk_packing(
        identity.attention_backend, identity.kv_cache_dtype, head_size, element_size
    )
    if not packing:
        return ()
    held = {
        (
            head_chunk_token_bytes(
                tuple(view.shape),
                tuple(view.stride()),
                view.element_size(),
                block_size=identity.block_size,
            )
            if view.element_size() == element_size
            else None
        )
        for view in views.values()
    }
    stated = sum(group.bytes_per_token for group in packing)
    if held == {stated}:
        return packing
    if held == {None}:  # token-major (or split) views: tokens are rows, no packing applies
        logger.debug("KV views of shape %s are not head-major: no chunk packing", first.shape)
        return ()
    logger.warning(
        "attention backend %s (head size %d, %d B elements, KV cache dtype %s): the known chunk "
        "packing (%s) does not hold the bytes of the KV views' (block, head) chunks: %s per head "
        "and token in views of shape %s, strides %s, %s (%d-token blocks); treating its blocks "
        "as unsplittable (prefill and decode then need equal --block-size)",
        identity.attention_backend,
        head_size,
        element_size,
        identity.kv_cache_dtype,
        packing_text(packing),
        " / ".join(
            "not head-major" if b is None else f"{b} B"
            for b in sorted(held, key=lambda b: -1 if b is None else b)
        ),
        tuple(first.shape),
        tuple(first.stride()),
        first.dtype,
        identity.block_size,
    )
    return ()


def _layer_order(name: str) -> tuple[int, str]:
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        return extract_layer_index(name), name
    except Exception:
        return 1 << 30, name


class ConnectorWorker:
    def __init__(
        self, config: ConnectorConfig, vllm_config: Any, kv_cache_config: Any = None
    ) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.config = config
        self._vllm_config = vllm_config
        #: the engine's KV cache groups (vLLM 0.30+ hands it over; None before)
        self._kv_cache_config = kv_cache_config
        self.tp_rank = get_tensor_model_parallel_rank()
        self.transport: Transport | None = None
        self.sender: PrefillSender | None = None
        self.receiver: Receiver | None = None
        self._decode: DecodeSide | None = None
        self._load_errors: set[int] = set()
        #: the memory unregistered for sleep, None while awake
        self._unregistered: list[MemoryRange] | None = None
        self.stats = TransferStats()

    # -- registration ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from vllm.platforms import current_platform

        config, vllm_config = self.config, self._vllm_config
        ordered = dict(sorted(kv_caches.items(), key=lambda item: _layer_order(item[0])))
        layers = vllm_config.compilation_config.static_forward_context
        refuse_unsupported_parallelism(vllm_config.parallel_config)
        groups = transfer_group_specs(self._kv_cache_config, config.block_size)
        refuse_hybrid_layers(ordered, layers)
        model = vllm_config.model_config
        drafts: set[str] = set()
        if config.draft_kv_heads:  # past the target's layers, all on this rank (PP 1 only)
            target_layers = model.get_num_layers(vllm_config.parallel_config)
            drafts = draft_layer_names(ordered, layers, target_layers)
        geometry = attention_geometry(
            ordered,
            layers,
            default=LayerGeometry(
                model.get_num_kv_heads(vllm_config.parallel_config), model.get_head_size()
            ),
            is_mla=config.is_mla,
            draft_layers=drafts,
        )
        topology = config.topology()
        check_planned_heads(
            geometry, topology, config.is_producer, config.local.tp_size, config.draft_kv_heads
        )
        identity = model_identity(
            vllm_config,
            ordered,
            block_size=config.block_size,
            num_kv_heads=config.num_kv_heads,
            head_size=geometry.head_size,
            is_mla=config.is_mla,
            kv_cache_groups=describe_groups(groups) if len(groups) > 1 else (),
        )
        layer_heads = draft_layer_heads(geometry, topology, config.draft_kv_heads)
        memory = self._describe(ordered, identity, geometry, layer_heads)
        if len(groups) > 1:
            memory = dataclasses.replace(
                memory,
                region_groups=region_groups(
                    [r.name for r in memory.regions], group_of_layer(self._kv_cache_config)
                ),
            )
        self._check_resolved_layout(memory.regions)
        self.transport = create_transport(
            config.transport,
            config.side_channel_host,
            config.mooncake,
            device_type=current_platform.device_type,
        )
        who = WorkerIdentity(
            engine_id=config.engine_id,
            incarnation=uuid.uuid4().hex,
            tp_rank=self.tp_rank,
            tp_size=config.local.tp_size,
            dp_rank=config.dp_rank,
            dp_size=config.local.dp_size,
            model=identity,
        )
        if config.is_producer:
            side = build_prefill_side(
                who, topology, self.transport, memory, prefill_settings(config, self.tp_rank)
            )
            self.sender, metadata = side.sender, side.metadata
        else:
            layouts = [region.layout for region in memory.regions]
            self._decode = build_decode_side(
                who, topology, self.transport, memory, decode_settings(config, layouts)
            )
            self.receiver, metadata = self._decode.receiver, self._decode.metadata
            endpoints = parse_endpoints(config.prefill_side_channels)
            if endpoints:
                try:
                    paired = pair_with_prefills(self._decode.peers, endpoints, config.pair_wait_s)
                except Exception:
                    self._decode.close()  # this engine does not start: nothing may stay open
                    raise
                logger.info(
                    "decode worker %d paired with %d prefill worker(s) of %d listed instance(s)",
                    self.tp_rank,
                    len(paired),
                    len(endpoints),
                )
                if self._decode.pairings is not None:  # the scheduler probes none of them
                    self._decode.pairings.note_paired({p.metadata.engine_id for p in paired})
        regions = memory.regions
        defect = mla_plain_rope_on_cpu(vllm_config.model_config, current_platform.device_type)
        if defect and self.tp_rank == 0:
            logger.warning("%s", defect)
        logger.info(
            "%s worker %d ready: %d KV regions (%s), attention %s, %s",
            config.role,
            self.tp_rank,
            len(regions),
            regions[0].layout.block_order.value if regions else "none",
            metadata.identity.attention_backend or "unknown",
            topology.describe(),
        )

    def _describe(
        self,
        ordered: dict[str, Any],
        identity: ModelIdentity,
        geometry: AttentionGeometry,
        layer_heads: Mapping[str, LayerHeads] | None = None,
    ) -> KVCacheMemory:
        """vLLM's KV caches (layer order) as registered tensors and described regions, each
        layer checked against the head count and head size its attention layer allocated
        (``layer_heads``: the draft layers of a head group of their own)."""
        config = self.config
        if any(isinstance(cache, (tuple, list)) for cache in ordered.values()):
            # vllm-ascend hands over (K, V) tensors per layer, or for MLA (nope, rope) -- or one
            # packed latent -- each its own replicated region (see registration.py).
            regions = regions_from_split_caches(
                ordered,
                num_kv_heads=geometry.num_kv_heads,
                block_size=config.block_size,
                head_size=geometry.head_size,
                is_mla=config.is_mla,
                head_major=vllm_compat.head_major_layout_requested(),
                layer_heads=layer_heads,
            )
            return KVCacheMemory(
                [t for cache in ordered.values() for t in cache_parts(cache)], regions
            )
        # Draft layers with a head size of their own have a chunk packing of their own.
        by_size: dict[int | None, dict[str, Any]] = {}
        for name, view in ordered.items():
            own = (layer_heads or {}).get(name)
            by_size.setdefault(own.head_size if own else None, {})[name] = view
        layer_packing = {
            name: _chunk_packing(identity, views, size)
            for size, views in by_size.items()
            if size is not None
            for name in views
        }
        regions = regions_from_vllm_views(
            ordered,
            num_kv_heads=geometry.num_kv_heads,
            block_size=config.block_size,
            is_mla=config.is_mla,
            packing=_chunk_packing(identity, by_size.get(None, {})),
            layer_heads=layer_heads,
            layer_packing=layer_packing,
        )
        return KVCacheMemory(list(ordered.values()), regions)

    def _check_resolved_layout(self, regions: list[Region]) -> None:
        """Say which block order the KV tensors really have when it is not the head-major one
        this connector asks vLLM for. The tensors decide, not the name vLLM reports: on
        vllm-ascend the requested layout changes only that name, its attention backend shapes
        the cache by ``VLLM_KV_CACHE_LAYOUT`` alone."""
        if self.config.is_mla or not regions:
            return
        orders = {region.layout.block_order for region in regions}
        if orders == {BlockOrder.HEAD_MAJOR} or all(r.layout.num_heads == 1 for r in regions):
            return
        resolved = vllm_compat.resolved_kv_cache_layout(self._vllm_config)
        logger.warning(
            "the KV cache tensors are %s (vLLM reports layout %s), not the preferred head-major "
            "%s: heterogeneous TP then re-lays blocks out after each pull, or reads through the "
            "staging buffer; on vllm-ascend, export VLLM_KV_CACHE_LAYOUT=HND for both instances "
            "to get head-major tensors",
            " and ".join(sorted(order.value for order in orders)),
            resolved or "none",
            vllm_compat.RESOLVED_HEAD_MAJOR_LAYOUT,
        )

    # -- sleep mode (vLLM 0.33+) ---------------------------------------------------------------

    def unregister_kv_caches(self) -> None:
        """Before vLLM discards the KV cache (sleep): stop serving and reading, then drop the
        registrations. Held blocks are released (their bytes are about to be lost), and until
        :meth:`restore_kv_caches` every claim on this prefill and every pull on this decode is
        refused with :data:`ASLEEP`. Idempotent."""
        if self.transport is None or self._unregistered is not None:
            return
        if self.sender is not None:
            self.sender.suspend(ASLEEP)
        if self.receiver is not None:
            self.receiver.suspend(ASLEEP, SLEEP_DRAIN_S)
        self._unregistered = self.transport.unregister()
        logger.info(
            "%s worker %d: KV cache unregistered for sleep (%d memory region(s))",
            self.config.role,
            self.tp_rank,
            len(self._unregistered),
        )

    def restore_kv_caches(self) -> None:
        """After wake-up: register the same memory again (vLLM keeps the KV cache's addresses,
        so what peers know of this worker stays true) and serve again. Transfers released for
        the sleep stay refused: the tracker remembers them as for any release."""
        if self.transport is None or self._unregistered is None:
            return
        self.transport.register(self._unregistered)
        self._unregistered = None
        if self.sender is not None:
            self.sender.resume()
        if self.receiver is not None:
            self.receiver.resume()
        logger.info(
            "%s worker %d: KV cache registered again after wake-up", self.config.role, self.tp_rank
        )

    # -- per step ------------------------------------------------------------------------------

    def start_load_kv(self, orders: StepOrders) -> None:
        if self.sender is not None:
            tracker = self.sender.tracker
            for transfer_id in orders.drops:
                tracker.drop(transfer_id)
            for held in orders.holds:
                now = time.time()
                if held.finished_at:
                    self.stats.record_hold_delay(max(0.0, now - held.finished_at))
                tracker.hold(
                    held.transfer_id,
                    request_id=held.request_id,
                    block_ids=held.block_ids,
                    num_prompt_tokens=held.num_prompt_tokens,
                    group_sizes=held.group_sizes,
                )
                timeline_log.emit(
                    "prefill",
                    held.transfer_id,
                    {
                        "arrived": held.arrived_at or None,
                        "scheduled": held.scheduled_at or None,
                        "finished": held.finished_at or None,
                        "held": now,
                    },
                    rank=self.tp_rank,
                    request=held.request_id,
                )
        if self.receiver is not None:
            for pull in orders.pulls:
                self.receiver.submit(pull)
            for request_id in orders.cancels:
                self.receiver.cancel(request_id)
        if self._decode is not None and self._decode.pairings is not None:
            for pairing in orders.pairings:
                self._decode.pairings.submit(pairing)

    def get_finished(self, idle: bool = False) -> tuple[set[str], set[str]]:
        """Requests whose transfers ended; in an idle step, waits briefly for one to end."""
        sending: set[str] = set()
        recving: set[str] = set()
        if idle:  # see ConnectorConfig.idle_step_wait_ms
            wait_s = self.config.idle_step_wait_s
            if self.receiver is not None:
                self.receiver.wait_for_news(wait_s)
            if self._decode is not None and self._decode.pairings is not None:
                self._decode.pairings.wait_for_verdict(wait_s)
            if self.sender is not None:
                self.sender.tracker.wait_for_news(wait_s)
        if self.sender is not None:
            sending = self.sender.tracker.take_finished()
            self.stats.record_expired(self.sender.tracker.take_expired_count())
        if self._decode is not None and self._decode.pairings is not None:
            for verdict in self._decode.pairings.take_verdicts():
                self.stats.record_pairing(verdict)
        if self.receiver is not None:
            done, failed = self.receiver.take_finished()
            recving = done | set(failed)
            for request_id, failure in failed.items():
                if failure.kind is FailureKind.INCOMPATIBLE_PEER and failure.prefill_engine_id:
                    self.stats.record_unpairable(failure.prefill_engine_id, failure.reason)
                if failure.cancelled:  # vLLM frees the blocks of a finished request unused
                    logger.info("KV load of request %s cancelled: %s", request_id, failure.reason)
                    continue
                self._load_errors.update(failure.local_block_ids)
                if failure.kind is FailureKind.CLIENT_LEFT:  # its abort is on its way to vLLM
                    logger.info("KV load of request %s ended: %s", request_id, failure.reason)
                    continue
                logger.warning(
                    "KV load failed for request %s (%s): %s",
                    request_id,
                    failure.kind.value,
                    failure.reason,
                )
                self.stats.record_failure(failure.kind)
            reported = time.monotonic()
            for pull in self.receiver.take_stats():
                phases = {}
                if pull.timeline is not None:
                    pull.timeline.reported = reported
                    phases = pull.timeline.phases()
                    timeline_log.emit(
                        "decode",
                        pull.transfer_id,
                        pull.timeline.wall_stamps(),
                        rank=self.tp_rank,
                        request=pull.request_id,
                    )
                    if logger.isEnabledFor(logging.DEBUG):
                        logger.debug(
                            "pull of %s (transfer %s), ms per phase: %s",
                            pull.request_id,
                            pull.transfer_id,
                            ", ".join(f"{k} {1e3 * v:.2f}" for k, v in phases.items()),
                        )
                self.stats.record_pull(pull.seconds, pull.num_bytes, pull.num_descriptors, phases)
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self._decode is not None:
            self._decode.close()
        if self.transport is not None:
            self.transport.close()
