"""The overlapped route: both legs at once, decode sampling the answer's first token again.

Once the proxy knows where a prefill engine serves its KV (a first answer taught it), decode
need not wait for prefill's answer: prefill holds the KV under a transfer id of the proxy's
(``handoff.new_transfer_id``) and decode gets that id and the engine's address, and learns the
block ids from its read lease. The steps of :meth:`OverlappedRoute.run`, in order: send the
decode leg (``_send``), then prefill's, and wait for prefill's answer (``_prefill_answer``); send
the decode leg again if prefill held the KV elsewhere than decode was told
(``_resend_if_elsewhere``); relay decode's answer while prefill's hold is renewed. A prefill
that cannot be reached makes the request go serial (:mod:`.serial_route`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi.responses import Response

from ..handoff import awaited_prefill_params, new_transfer_id, prefill_address, same_endpoint
from .balancer import Upstream
from .bodies import decode_body, overlapped_prefill_body
from .client_request import ClientRequest
from .errors import NO_ANSWER_FAILURES
from .formats.prefill_answer import InvalidPrefillResponse, kv_transfer_params_from_prefill
from .metrics import ProxyMetrics
from .pool import InstancePool
from .prefill_ranks import RankChoice

logger = logging.getLogger(__name__)


class _GoSerial(Exception):
    """Prefill failed before answering: the caller runs the request serially."""


class OverlappedRoute:
    """Both legs at once, over the pool's instances."""

    def __init__(self, pool: InstancePool, metrics: ProxyMetrics) -> None:
        self.pool = pool
        self.metrics = metrics

    async def run(
        self, prefill_upstream: Upstream, choice: RankChoice, request: ClientRequest
    ) -> Response | None:
        """Both legs at once; None when prefill cannot be reached (the caller goes serial)."""
        assert choice.address is not None
        transfer_id = new_transfer_id(request.request_id)
        decode_leg = self._send(request, awaited_prefill_params(choice.address, transfer_id))
        request.trace.transfer_id, request.trace.mode = transfer_id, "overlapped"
        try:
            answered = await self._prefill_answer(prefill_upstream, choice, request, transfer_id)
        except _GoSerial:
            await self.pool.abandon(decode_leg)
            return None
        except BaseException:
            await self.pool.abandon(decode_leg)
            raise
        if isinstance(answered, Response):
            await self.pool.abandon(decode_leg)
            return answered
        try:
            decode_leg = await self._resend_if_elsewhere(
                decode_leg, answered, prefill_upstream, choice, request, transfer_id
            )
        except asyncio.CancelledError:  # the client left: nobody will read what prefill holds
            self.pool.drop_hold(answered)
            raise
        keeping = self.pool.keep_hold(answered)
        decode_upstream, decode_response = await self.pool.until_answered(keeping, decode_leg)
        request.trace.mark("decode_answered")
        logger.debug(
            "request %s: %s prefilled on %s alongside decode on %s (transfer %s)",
            request.request_id,
            request.path,
            prefill_upstream.url,
            decode_upstream.url,
            transfer_id,
        )
        return await self.pool.relay_decode(
            decode_upstream,
            decode_response,
            request,
            cut_short=lambda: self.pool.abandon_hold(keeping),
        )

    def _send(
        self, request: ClientRequest, kv_transfer_params: dict[str, Any] | None
    ) -> asyncio.Task:
        """The decode leg, opened in the background (prefill's leg is sent right after)."""
        request.trace.mark("decode_sent")
        return asyncio.create_task(
            self.pool.open_decode(
                request.path, request.headers, decode_body(request.body, kv_transfer_params)
            )
        )

    async def _prefill_answer(
        self,
        prefill_upstream: Upstream,
        choice: RankChoice,
        request: ClientRequest,
        transfer_id: str,
    ) -> dict[str, Any] | Response | None:
        """Prefill's ``kv_transfer_params`` (None: it returned none); a response for the client
        when prefill answered an error or what no decode can use. Raises :class:`_GoSerial`
        when prefill did not answer at all."""
        request.trace.mark("prefill_sent")
        try:
            response = await self.pool.prefill_leg(
                prefill_upstream,
                choice,
                request.path,
                request.headers,
                overlapped_prefill_body(request.body, transfer_id),
                held_as=transfer_id,  # a client that hangs up before it is read frees it
            )
        except NO_ANSWER_FAILURES as error:
            self.pool.forget(prefill_upstream)
            self.metrics.serial_fallbacks.inc()
            logger.warning(
                "request %s: prefill %s failed before answering (%s); going serial",
                request.request_id,
                prefill_upstream.url,
                error,
            )
            raise _GoSerial from error
        request.trace.mark("prefill_answered")
        if not response.is_success:
            return self.pool.prefill_failed(prefill_upstream, response, request.request_id)
        try:
            kv_transfer_params = kv_transfer_params_from_prefill(response.content)
        except InvalidPrefillResponse as error:
            return self.pool.invalid_prefill(prefill_upstream, request.path, error)
        self.pool.learn(prefill_upstream, kv_transfer_params)
        return kv_transfer_params

    async def _resend_if_elsewhere(
        self,
        decode_leg: asyncio.Task,
        kv_transfer_params: dict[str, Any] | None,
        prefill_upstream: Upstream,
        choice: RankChoice,
        request: ClientRequest,
        transfer_id: str,
    ) -> asyncio.Task:
        """The decode leg to read: the one sent, or, when prefill did not hold the KV under our
        id or holds it at another address than decode was told (an engine that ignored the
        data-parallel pin), a new one with what prefill returned (decode would wait in vain).
        A restart under a new engine id behind the same address is no reason: decode's early
        pull follows it (``handoff.same_endpoint``)."""
        held_id = (kv_transfer_params or {}).get("remote_request_id")
        held_at = prefill_address(kv_transfer_params)
        if held_id == transfer_id and same_endpoint(held_at, choice.address):
            return decode_leg
        await self.pool.abandon(decode_leg)
        logger.warning(
            "request %s: prefill %s held the KV %s; sending the decode leg again with what "
            "it returned",
            request.request_id,
            prefill_upstream.url,
            f"under {held_id!r}, not transfer id {transfer_id}"
            if held_id != transfer_id
            else f"at {held_at}, not at {choice.address} as decode was told",
        )
        request.trace.transfer_id = held_id
        request.trace.mode = "resent"
        self.metrics.decode_resends.inc()
        return asyncio.create_task(
            self.pool.open_decode(
                request.path, request.headers, decode_body(request.body, kv_transfer_params)
            )
        )
