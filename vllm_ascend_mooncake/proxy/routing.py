"""Which route a request takes, decided once per request, top to bottom.

1. every prefill instance left is one no decode can read (:mod:`.pairing`): decode alone;
2. the first token from prefill (the default, :mod:`.continuable` lets the request through):
   :mod:`.continued_route`;
3. otherwise decode samples the first token again (counted by reason): both legs at once
   (:mod:`.overlapped_route`) where overlap is on and the proxy knows where the best prefill
   engine serves its KV, else, or when that prefill cannot be reached, :mod:`.serial_route`.
"""

from __future__ import annotations

import dataclasses

import httpx
from fastapi.responses import Response

from .client_request import ClientRequest
from .continuable import FROM_DECODE, FROM_PREFILL, blocker, count_decode_first_token
from .continued_route import ContinuedRoute
from .errors import UpstreamUnreachable, upstream_failure_response
from .formats.token_texts import TokenTexts
from .metrics import ProxyMetrics
from .model_limits import ModelLimits
from .overlapped_route import OverlappedRoute
from .pool import InstancePool
from .serial_route import SerialRoute
from .trace import RequestTrace


class Router:
    """The routes over one pool of instances, and the choice between them."""

    def __init__(
        self,
        pool: InstancePool,
        metrics: ProxyMetrics,
        token_texts: TokenTexts,
        model_limits: ModelLimits | None = None,
        timeout_s: float = 600.0,
        overlap_legs: bool = True,
    ) -> None:
        self.pool = pool
        self.metrics = metrics
        #: what an upstream that did not answer in time was given (named in the 504)
        self.timeout_s = timeout_s
        self.overlap_legs = overlap_legs
        self.serial = SerialRoute(pool)
        self.overlapped = OverlappedRoute(pool, metrics)
        self.continued = ContinuedRoute(pool, metrics, self.serial, token_texts, model_limits)

    async def route(self, request: ClientRequest, first_token: str = FROM_DECODE) -> Response:
        """Run ``request`` on its route; ``first_token`` says where the client (or the proxy's
        ``--first-token``) wants the answer's first token from. An upstream that cannot be
        reached or read gives 502, or 504 when it was too slow."""
        try:
            return await self._route(request, first_token)
        except (UpstreamUnreachable, httpx.HTTPError) as error:
            return upstream_failure_response(error, self.timeout_s)

    async def _route(self, request: ClientRequest, first_token: str) -> Response:
        if self.pool.only_unpairable_prefills():
            return await self.serial.decode_alone(request)
        if first_token == FROM_PREFILL:
            reason = blocker(request.path, request.body)
            if reason is None:
                return await self.continued.run(request)
        else:
            reason = "asked" if first_token == FROM_DECODE else f"header {first_token!r}"
        count_decode_first_token(self.metrics, reason, request.request_id)
        known = self.pool.known_prefill() if self.overlap_legs else None
        if known is not None:
            overlapped = await self.overlapped.run(*known, request)
            if overlapped is not None:
                return overlapped
            # the serial retry starts its own stamps
            retry_trace = RequestTrace(dict(request.trace.stamps), metrics=self.metrics)
            request = dataclasses.replace(request, trace=retry_trace)
        return await self.serial.run(request)
