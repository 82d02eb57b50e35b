"""Scheduler side of the connector: which requests to pull or hold, and the params to hand out.

Decode: a request arriving with valid ``kv_transfer_params`` loads its uncached prompt blocks
asynchronously; the pull (decode blocks <- prefill blocks, suffix-aligned when the decode side
already caches a prefix) goes to the workers in the next step's metadata. Prefill: a request that
finishes its single token keeps its blocks (delayed free) until every decode rank that reads them
reports done; its response carries the params the proxy forwards to decode.

When the proxy overlaps the legs, decode admits a request before prefill has answered: it knows
how many prompt blocks to allocate from its own prompt, and the pull learns the prefill's block ids
from the read lease. A prefill request that was given a transfer id but ends without a hand-off
is dropped, so the decode waiting for it is refused at once.

vLLM asserts on any finished id it is not waiting for (a request it already freed, one that never
loaded asynchronously), and such an assert kills the engine core. So this side keeps the ids it
handed to vLLM as asynchronous loads and delayed frees, and :meth:`ConnectorScheduler.filter_output`
drops anything else from the workers' reports with a log line. A pull with no local blocks (an
abort before scheduling, a request that loads nothing) only releases prefill's hold and is never
reported at all.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from ..core.groups import GroupKind, GroupSpec, describe_groups, flatten_groups
from ..core.topology import Topologies
from ..datapath.orders import HoldOrder, PairingOrder, PullOrder, StepOrders
from ..handoff import HOLD_IF_STOPPED_KEY, MAX_TRANSFER_ID_CHARS, TRANSFER_ID_KEY
from ..log import get_logger
from ..timeline import TimelineLog
from .config import ConnectorConfig, is_loopback
from .kv_groups import transfer_group_ids, transfer_group_specs
from .params import (
    MAX_OUTPUT_TOKENS,
    InvalidTransferParams,
    RemotePrefill,
    parse_remote_prefill,
    release_target,
    transfer_id_of,
)
from .prefill_pairings import Pairing, PrefillPairings
from .vllm_compat import chat_takes_forwarded_prompt_ids

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = get_logger(__name__)
timeline_log = TimelineLog(get_logger(f"{__name__}.timeline"))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ConnectorScheduler:
    def __init__(self, config: ConnectorConfig, kv_cache_config: Any = None) -> None:
        self.config = config
        #: the engine's KV cache groups a request's KV moves in, and their ids in vLLM's block
        #: tables (vLLM's hybrid manager; one full-attention group without a config)
        self._groups: tuple[GroupSpec, ...] = transfer_group_specs(
            kv_cache_config, config.block_size
        )
        self._group_ids = transfer_group_ids(kv_cache_config)
        #: whether a pull must leave decode a prompt token to compute (:meth:`_check_window`)
        self._partial_groups = any(g.kind is not GroupKind.FULL for g in self._groups)
        #: decode: the prefill TP sizes this instance can read (any that pairs with its own)
        self._topologies = Topologies(config.topology(), local_is_decode=not config.is_producer)
        self._remote: dict[str, RemotePrefill] = {}
        self._orders = StepOrders()
        self._loading: set[str] = set()  # async loads vLLM waits for in finished_recving
        # transfer id -> the live request that pulls it: the sequences of an n > 1 request share
        # their params, but prefill holds one copy and frees it after the first read
        self._pulling: dict[str, str] = {}
        self._holding: set[str] = set()  # delayed frees vLLM waits for in finished_sending
        # timeline stamps (wall clock) of requests in flight, dropped when they finish:
        # prefill: request id -> when the scheduler first saw it;
        # decode: request id -> (transfer id, {stamp name: time}) until its first decode step
        self._first_seen: dict[str, float] = {}
        self._load_stamps: dict[str, tuple[str, dict[str, float]]] = {}
        self._warned_loopback: set[str] = set()  # prefill engines already warned about
        #: decode: the prefill engines paired, being paired, or found unreadable
        self.pairings = PrefillPairings(probe_first=config.pair_before_pull)
        #: prefill: whether this vLLM takes chat prompts as forwarded token ids (see params)
        self._chat_prompt_ids = config.is_producer and chat_takes_forwarded_prompt_ids()

    # -- prefill -----------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """Prefill of a model with sliding-window or state layers: compute the prompt but its
        last token, which decode computes (it must not recompute a token it loaded: the
        window may have dropped what that token attends to, and a state would advance by it
        twice). Once per request, also across preemptions; a request that skips the prefix
        cache (prompt logprobs) loads nothing on decode and keeps its prompt."""
        params = request.kv_transfer_params
        if (
            not self.config.is_producer
            or not self._partial_groups
            or not params
            or not params.get("do_remote_decode")
            or params.get(_PROMPT_PREFIX_KEY)
            or request.num_prompt_tokens < 2
            or request.prompt_token_ids is None
            or _skips_prefix_cache(request)
        ):
            return
        request.prompt_token_ids.pop()
        request._all_token_ids.pop()
        request.num_prompt_tokens -= 1
        params[_PROMPT_PREFIX_KEY] = True

    # -- decode ------------------------------------------------------------------------------

    def _remote_prefill(self, request: Request) -> RemotePrefill | None:
        """Validated params of a decode request that should pull its prompt, else None."""
        if request.request_id in self._remote:
            return self._remote[request.request_id]
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        transfer_id = params.get("remote_request_id")
        owner = self._pulling.get(transfer_id) if isinstance(transfer_id, str) else None
        if owner is not None and owner != request.request_id:
            logger.info(
                "request %s: transfer %s is pulled by request %s (n > 1 shares params); "
                "computing this one locally, from the prefix cache where it can",
                request.request_id,
                transfer_id,
                owner,
            )
            params["do_remote_prefill"] = False
            return None
        if self.config.is_producer:
            logger.warning(
                "request %s asks to pull KV, but this is a prefill (kv_producer) instance; "
                "computing it locally",
                request.request_id,
            )
            params["do_remote_prefill"] = False
            return None
        try:
            remote = parse_remote_prefill(
                params,
                topologies=self._topologies,
                block_size=self.config.block_size,
                prompt_token_ids=request.prompt_token_ids or (),
                groups=self._groups,
            )
            if self._partial_groups and remote.remote_num_tokens is None:
                # admitted before prefill answered: prefill (the same model) stops one short
                remote = msgspec.structs.replace(
                    remote,
                    remote_num_tokens=request.num_prompt_tokens - 1,
                    remote_prompt_prefix=True,
                )
            self._check_window(remote, request.num_prompt_tokens)
        except InvalidTransferParams as exc:
            logger.warning(
                "request %s: ignoring kv_transfer_params (%s); computing the prompt locally",
                request.request_id,
                exc,
            )
            params["do_remote_prefill"] = False
            self._release_rejected(request)
            return None
        if self._compute_unpairable(request, remote):
            return None
        self._remote[request.request_id] = remote
        self._pulling[remote.remote_request_id] = request.request_id
        self._warn_if_unreachable(remote)
        return remote

    def _check_window(self, remote: RemotePrefill, num_prompt_tokens: int) -> None:
        """A model with sliding-window or state layers pulls only fewer tokens than its prompt
        (this connector's prefill computes all but the last, :meth:`on_new_request`): a pull of
        the whole prompt makes vLLM recompute its last token, whose window reaches into a block
        prefill no longer holds whenever ``(n - W + 1)`` is a multiple of the block size, and
        which would advance a loaded state by that token a second time."""
        if self._partial_groups and remote.prefill_tokens(num_prompt_tokens) >= num_prompt_tokens:
            raise InvalidTransferParams(
                "this model has sliding-window or state layers, and prefill computed the whole "
                "prompt (a prefill without remote_prompt_prefix, e.g. of another connector or "
                "release): vLLM would recompute its last token over a dropped window or an "
                "already advanced state"
            )

    def _compute_unpairable(self, request: Request, remote: RemotePrefill) -> bool:
        """Whether the prefill engine holding ``request``'s KV cannot be read by this decode
        (a probe or a pull found so): then the prompt is computed here and prefill's hold
        released, instead of a pull failing the request."""
        reason = self.pairings.unpairable_reason(remote.remote_engine_id)
        if reason is None:
            return False
        logger.info(
            "request %s: prefill engine %s cannot pair with this decode instance (%s); "
            "computing the prompt locally",
            request.request_id,
            remote.remote_engine_id,
            reason,
        )
        request.kv_transfer_params["do_remote_prefill"] = False
        self._release_rejected(request)
        return True

    def _pairing(self, request: Request, remote: RemotePrefill) -> Pairing:
        """Pull, wait for the pairing probe, or compute (:mod:`.prefill_pairings`)."""
        decision = self.pairings.decide(
            PairingOrder(
                remote.remote_engine_id,
                remote.remote_host,
                remote.remote_port,
                remote.remote_tp_size,
            ),
            self._orders.pairings,
        )
        if decision is Pairing.COMPUTE:
            self._remote.pop(request.request_id, None)
            if self._pulling.get(remote.remote_request_id) == request.request_id:
                del self._pulling[remote.remote_request_id]
            self._compute_unpairable(request, remote)
        return decision

    def _warn_if_unreachable(self, remote: RemotePrefill) -> None:
        """A prefill advertising loopback to a decode that has a network address is almost
        always a multi-host deployment whose prefill kept the default: say so once per prefill."""
        if not is_loopback(remote.remote_host) or is_loopback(self.config.side_channel_host):
            return
        key = remote.remote_engine_id or remote.remote_host
        if key in self._warned_loopback or len(self._warned_loopback) >= 64:
            return
        self._warned_loopback.add(key)
        logger.warning(
            "prefill %s advertises its KV side channel on the loopback address %s while this "
            "decode instance advertises %s: unless both run on this host, pulls will fail. Set "
            "VLLM_HOST_IP (or kv_connector_extra_config side_channel_host) on the prefill "
            "instance to an address this host can reach",
            remote.remote_engine_id,
            remote.remote_host,
            self.config.side_channel_host,
        )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.config.is_producer:
            params = request.kv_transfer_params
            if params and params.get("do_remote_decode"):
                self._first_seen.setdefault(request.request_id, time.time())
        remote = self._remote_prefill(request)
        if remote is None:
            return 0, False
        count = remote.prefill_tokens(request.num_prompt_tokens) - num_computed_tokens
        if count <= 0:
            return 0, False
        decision = self._pairing(request, remote)
        if decision is Pairing.WAIT:
            return None, False  # vLLM asks again next step
        if decision is Pairing.COMPUTE:
            return 0, False
        return count, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        remote = self._remote.pop(request.request_id, None)
        if remote is None:
            return
        params = request.kv_transfer_params
        params["do_remote_prefill"] = False  # one transfer per request
        local: tuple[int, ...] = ()
        sizes: tuple[int, ...] = ()
        if num_external_tokens > 0:
            prefill_tokens = remote.prefill_tokens(request.num_prompt_tokens)
            cached_tokens = prefill_tokens - num_external_tokens
            local, sizes = flatten_groups(
                [
                    self._wanted_blocks(blocks.blocks[gid], group, prefill_tokens, cached_tokens)
                    for gid, group in zip(self._group_ids, self._groups, strict=True)
                ]
            )
        admitted_at = time.time()
        if local:
            self._loading.add(request.request_id)
            self._load_stamps[request.request_id] = (
                remote.remote_request_id,
                {"arrived": request.arrival_time, "admitted": admitted_at},
            )
        # Without local blocks vLLM loads nothing (e.g. prompt_logprobs skip external KV): the
        # pull only releases prefill's hold and the workers never report it.
        self._orders.pulls.append(
            self._pull_order(
                request,
                remote,
                local,
                sizes,
                arrived_at=request.arrival_time,
                admitted_at=admitted_at,
            )
        )

    @staticmethod
    def _wanted_blocks(
        table: list[Any], group: GroupSpec, num_tokens: int, cached_tokens: int
    ) -> list[int]:
        """The decode blocks of one group that a load of ``num_tokens`` tokens fills, its first
        ``cached_tokens`` cached here already: the group's trailing positions its kind keeps
        (:meth:`GroupSpec.wanted_count`), in the position-indexed block table vLLM allocated."""
        end = _cdiv(num_tokens, group.block_size)
        wanted = table[end - group.wanted_count(num_tokens, cached_tokens) : end]
        ids = [block.block_id for block in wanted]
        if len(table) < end or any(getattr(block, "is_null", False) for block in wanted):
            raise AssertionError(
                f"vLLM allocated {len(table)} blocks of a {group.describe()} group for a "
                f"{num_tokens}-token load, positions {end - len(ids)}..{end - 1} not all real: "
                f"{ids[:8]} (a connector bug: please report it)"
            )
        return ids

    def _release_rejected(self, request: Request) -> None:
        """Params this decode will not pull with still name a prefill holding the KV: tell it
        (a release-only pull) so it frees the blocks now, not at its ``release_timeout_s``."""
        target = release_target(request.kv_transfer_params)
        if target is None:
            return
        self._orders.pulls.append(
            PullOrder(
                request_id=request.request_id,
                transfer_id=target.remote_request_id,
                local_block_ids=(),
                remote_block_ids=None,
                remote_host=target.remote_host,
                remote_port=target.remote_port,
                remote_engine_id=target.remote_engine_id,
                num_prompt_tokens=request.num_prompt_tokens,
            )
        )

    def _pull_order(
        self,
        request: Request,
        remote: RemotePrefill,
        local: tuple[int, ...],
        local_group_sizes: tuple[int, ...] = (),
        arrived_at: float = 0.0,
        admitted_at: float = 0.0,
    ) -> PullOrder:
        blocks = remote.remote_block_ids
        return PullOrder(
            request_id=request.request_id,
            transfer_id=remote.remote_request_id,
            local_block_ids=local,
            local_group_sizes=local_group_sizes,
            remote_group_sizes=tuple(remote.remote_group_sizes or ()),
            remote_block_ids=None if blocks is None else tuple(blocks),
            remote_host=remote.remote_host,
            remote_port=remote.remote_port,
            remote_engine_id=remote.remote_engine_id,
            num_prompt_tokens=remote.prefill_tokens(request.num_prompt_tokens),
            remote_tp_size=remote.remote_tp_size,
            arrived_at=arrived_at,
            admitted_at=admitted_at,
        )

    def note_scheduled(self, new_request_ids: list[str]) -> None:
        """Decode: requests vLLM schedules for the first time this step; a loaded one ends its
        timeline here (its first decode step)."""
        if not self._load_stamps:
            return
        now = time.time()
        for request_id in new_request_ids:
            entry = self._load_stamps.pop(request_id, None)
            if entry is None:
                continue
            transfer_id, stamps = entry
            stamps["first_step"] = now
            timeline_log.emit("decode_scheduler", transfer_id, stamps, request=request_id)

    # -- both ----------------------------------------------------------------------------------

    def build_step_orders(self) -> StepOrders:
        orders, self._orders = self._orders, StepOrders()
        return orders

    def filter_output(self, output: KVConnectorOutput) -> None:
        """Keep only the finished ids vLLM is waiting for (it asserts on any other).

        Each reported id leaves the waiting set: vLLM takes every id exactly once.
        """
        output.finished_recving = _expected(output.finished_recving, self._loading, "loaded")
        if output.finished_recving and self._load_stamps:
            now = time.time()
            for request_id in output.finished_recving:
                entry = self._load_stamps.get(request_id)
                if entry is not None:
                    entry[1]["load_reported"] = now
        output.finished_sending = _expected(output.finished_sending, self._holding, "sent")

    def request_finished(
        self, request: Request, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``block_ids``: the request's blocks per KV cache group, position-indexed, as vLLM's
        ``request_finished_all_groups`` passes them (``(ids,)`` for one group)."""
        self._load_stamps.pop(request.request_id, None)
        scheduled_at = self._first_seen.pop(request.request_id, 0.0)
        params = request.kv_transfer_params
        if not params:
            return False, None
        transfer_id = params.get("remote_request_id")
        if isinstance(transfer_id, str) and self._pulling.get(transfer_id) == request.request_id:
            del self._pulling[transfer_id]
        if request.request_id in self._loading:
            # Aborted while loading: vLLM keeps its blocks until the load is reported, so a
            # pull still waiting for prefill should give up now rather than at prefill_wait_s.
            self._orders.cancels.append(request.request_id)
        if params.get("do_remote_prefill"):
            # Finished before it was ever scheduled (aborted or rejected): an empty pull tells
            # the prefill ranks to free their blocks now instead of at their timeout.
            remote = self._remote.pop(request.request_id, None) or self._try_parse(request)
            params["do_remote_prefill"] = False
            if remote is not None:
                self._orders.pulls.append(self._pull_order(request, remote, ()))
            else:
                self._release_rejected(request)
            return False, None
        if not params.get("do_remote_decode") or not self.config.is_producer:
            return False, None
        from vllm.v1.request import RequestStatus

        transfer_id = transfer_id_of(params, request.request_id)
        if params.get(TRANSFER_ID_KEY, transfer_id) != transfer_id:
            logger.warning(
                "request %s: ignoring transfer_id %.64r (not a string of 1 to %d characters); "
                "its KV is held under the request id, so a decode admitted under that transfer "
                "id waits for it in vain",
                request.request_id,
                params[TRANSFER_ID_KEY],
                MAX_TRANSFER_ID_CHARS,
            )
        prompt_blocks, group_sizes = self._held_blocks(block_ids, request.num_prompt_tokens)
        prefix = bool(params.get(_PROMPT_PREFIX_KEY))
        # a token sampled after a prompt prefix is nobody's answer, stopped or not: decode
        # computes the last prompt token and samples the answer's first
        handed_off = request.status == RequestStatus.FINISHED_LENGTH_CAPPED or (
            request.status == RequestStatus.FINISHED_STOPPED
            and (prefix or params.get(HOLD_IF_STOPPED_KEY, True) is not False)
        )
        # Aborted or errored, or ended by its token where the answer is complete: nobody reads it.
        if not handed_off or not prompt_blocks:
            if transfer_id != request.request_id:
                self._orders.drops.append(transfer_id)  # a decode may already be waiting
            return False, None
        self._holding.add(request.request_id)
        self._orders.holds.append(
            HoldOrder(
                request.request_id,
                transfer_id,
                prompt_blocks,
                request.num_prompt_tokens,
                group_sizes=group_sizes,
                finished_at=time.time(),
                arrived_at=request.arrival_time,
                scheduled_at=scheduled_at,
            )
        )
        return True, RemotePrefill(
            remote_engine_id=self.config.engine_id,
            remote_request_id=transfer_id,
            remote_host=self.config.side_channel_host,
            remote_port=self.config.side_channel_base_port(),
            remote_block_ids=list(prompt_blocks),
            remote_tp_size=self.config.prefill.tp_size,
            remote_num_tokens=request.num_prompt_tokens,
            remote_block_size=self.config.block_size,
            remote_dp_rank=self.config.server_dp_rank,
            remote_dp_size=self.config.server_dp_size,
            remote_output_token_ids=list(request.output_token_ids)[:MAX_OUTPUT_TOKENS],
            remote_chat_prompt_ids=self._chat_prompt_ids,
            remote_group_sizes=list(group_sizes) if group_sizes else None,
            remote_kv_groups=describe_groups(self._groups) if group_sizes else None,
            remote_prompt_prefix=prefix,
        ).to_dict()

    def _held_blocks(
        self, block_ids: Sequence[Sequence[int]], num_prompt_tokens: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A finished prefill request's blocks to hold (flat, and each group's count): per
        group, the prompt's trailing positions its kind keeps (:class:`GroupSpec`). Nothing
        when a group lacks one of them (vLLM 0.23 passes more blocks, never fewer)."""
        held = []
        for gid, group in zip(self._group_ids, self._groups, strict=True):
            table = block_ids[gid] if gid < len(block_ids) else ()
            end = _cdiv(num_prompt_tokens, group.block_size)
            ids = tuple(table[end - group.held_count(num_prompt_tokens) : end])
            if len(table) < end or not ids or 0 in ids:  # 0: vLLM's null block, freed
                return (), ()
            held.append(ids)
        return flatten_groups(held)

    def _try_parse(self, request: Request) -> RemotePrefill | None:
        try:
            return parse_remote_prefill(
                request.kv_transfer_params,
                topologies=self._topologies,
                block_size=self.config.block_size,
                prompt_token_ids=request.prompt_token_ids or (),
                groups=self._groups,
            )
        except InvalidTransferParams:
            return None


#: A prefill request's ``kv_transfer_params`` key marking its prompt cut by its last token
#: (:meth:`ConnectorScheduler.on_new_request`); internal, never in a response.
_PROMPT_PREFIX_KEY = "_vam_prompt_prefix"


def _skips_prefix_cache(request: Request) -> bool:
    skips = getattr(request, "get_skip_reading_prefix_cache", None)
    return bool(skips()) if skips is not None else False


def _expected(reported: set[str] | None, waiting: set[str], what: str) -> set[str] | None:
    """The reported ids that are in ``waiting`` (removed from it); logs the others."""
    if not reported:
        return reported
    unexpected = reported - waiting
    if unexpected:
        logger.error(
            "workers reported KV of %d request(s) %s that vLLM is not waiting for: %s; ignored "
            "(a connector bug: please report it)",
            len(unexpected),
            what,
            sorted(unexpected)[:8],
        )
    kept = reported & waiting
    waiting -= kept
    return kept or None
