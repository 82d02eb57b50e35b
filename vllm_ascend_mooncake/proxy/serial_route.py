"""The serial route: prefill first, then decode with what prefill answered; decode samples the
answer's first token again from the KV prefill holds.

It is what a request takes when it cannot continue from prefill's token (:mod:`.continuable`)
and the proxy does not know yet where the best prefill engine serves its KV (else
:mod:`.overlapped_route` sends both legs at once). Its second half,
:meth:`SerialRoute.decode_after`, also serves a continued request that falls back to decode's
first token (:mod:`.continued_route`).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi.responses import Response

from ..handoff import new_transfer_id
from .balancer import Upstream
from .bodies import decode_body, serial_prefill_body
from .client_request import ClientRequest
from .formats.prefill_answer import InvalidPrefillResponse, kv_transfer_params_from_prefill
from .pool import InstancePool

logger = logging.getLogger(__name__)


class SerialRoute:
    """Prefill, then decode; and decode alone where no prefill can hand off."""

    def __init__(self, pool: InstancePool) -> None:
        self.pool = pool

    async def run(self, request: ClientRequest) -> Response:
        """Prefill first; then decode, with the block ids prefill answered. Where the proxy
        knows where the engine serves its KV, prefill holds it under a transfer id of the
        proxy's, so a client that hangs up before prefill's answer is read frees that hold."""
        request.trace.mark("prefill_sent")
        transfer_id = new_transfer_id(request.request_id)
        prefill_upstream, prefill_response = await self.pool.fetch_prefill(
            request.path,
            request.headers,
            serial_prefill_body(request.body),
            held_as=transfer_id,
        )
        request.trace.mark("prefill_answered")
        if not prefill_response.is_success:
            return self.pool.prefill_failed(prefill_upstream, prefill_response, request.request_id)
        try:
            kv_transfer_params = kv_transfer_params_from_prefill(prefill_response.content)
        except InvalidPrefillResponse as error:
            return self.pool.invalid_prefill(prefill_upstream, request.path, error)
        self.pool.learn(prefill_upstream, kv_transfer_params)
        if kv_transfer_params is None:
            logger.warning(
                "request %s: prefill %s returned no kv_transfer_params; the decode instance "
                "will recompute the prompt",
                request.request_id,
                prefill_upstream.url,
            )
        return await self.decode_after(prefill_upstream, kv_transfer_params, request)

    async def decode_after(
        self,
        prefill_upstream: Upstream,
        kv_transfer_params: dict[str, Any] | None,
        request: ClientRequest,
    ) -> Response:
        """The client's request on decode, with the KV prefill answered it holds; relayed."""
        if kv_transfer_params is not None:
            request.trace.transfer_id = kv_transfer_params.get("remote_request_id")
        request.trace.mark("decode_sent")
        keeping = self.pool.keep_hold(kv_transfer_params)
        decode_upstream, decode_response = await self.pool.until_answered(
            keeping,
            self.pool.open_decode(
                request.path, request.headers, decode_body(request.body, kv_transfer_params)
            ),
        )
        request.trace.mark("decode_answered")
        logger.debug(
            "request %s: %s prefilled on %s, decoding on %s",
            request.request_id,
            request.path,
            prefill_upstream.url,
            decode_upstream.url,
        )
        return await self.pool.relay_decode(
            decode_upstream,
            decode_response,
            request,
            cut_short=lambda: self.pool.abandon_hold(keeping),
        )

    async def decode_alone(self, request: ClientRequest) -> Response:
        """The client's request on decode only, which computes the prompt: what the proxy does
        while every prefill instance left is one no decode can read (:mod:`.pairing`), where a
        prefill leg would add its latency and waste its compute for the same answer."""
        request.trace.mode = "decode_alone"
        request.trace.mark("decode_sent")
        logger.debug(
            "request %s: no prefill instance a decode can read; decode computes the prompt",
            request.request_id,
        )
        decode_upstream, decode_response = await self.pool.open_decode(
            request.path, request.headers, decode_body(request.body, None)
        )
        request.trace.mark("decode_answered")
        return await self.pool.relay_decode(decode_upstream, decode_response, request)
