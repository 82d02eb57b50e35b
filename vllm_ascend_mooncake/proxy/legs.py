"""The proxy's two legs where decode samples the answer's first token, and what every mode shares.

*Serial* legs send the prefill leg (one token, ``do_remote_decode``) and then the client's request
with prefill's ``kv_transfer_params`` to decode. *Overlapped* legs, once the proxy knows where a
prefill instance's KV can be read, send both at once: prefill holds the KV under a transfer id
decode is told, and decode is admitted while prefill computes. Both relay decode's answer. The
shared pieces (a prefill leg pinned to an engine, the decode leg after a prefill answer, hold
renewals) serve :mod:`.continued` too, whose client gets prefill's own first token.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response

from .balancer import Balancer, Upstream
from .client_request import ClientRequest
from .continuation import reason_label
from .errors import NO_ANSWER_FAILURES, error_response
from .holds import HoldKeeper
from .metrics import ProxyMetrics
from .payloads import (
    InvalidPrefillResponse,
    decode_body,
    kv_transfer_params_from_prefill,
    new_transfer_id,
    overlapped_decode_params,
    overlapped_prefill_body,
    prefill_address,
    prefill_body,
    same_endpoint,
)
from .prefill_ranks import PrefillRanks, RankChoice
from .upstreams import UpstreamClient, passthrough

logger = logging.getLogger(__name__)


class Legs:
    """Sends and relays the legs of one request over the prefill and decode instances."""

    def __init__(
        self,
        upstreams: UpstreamClient,
        prefill: Balancer,
        decode: Balancer,
        metrics: ProxyMetrics,
    ) -> None:
        self.upstreams = upstreams
        self.prefill = prefill
        self.decode = decode
        self.metrics = metrics
        #: where each prefill instance's engines serve their KV, learned from their answers
        self.prefill_ranks = PrefillRanks()
        #: set by the app: renews prefill's hold while a decode request may be queued
        self.hold_keeper: HoldKeeper | None = None

    async def prefill_leg(
        self,
        upstream: Upstream,
        choice: RankChoice,
        path: str,
        headers: dict[str, str],
        json_body: dict[str, Any],
    ) -> httpx.Response:
        """One prefill leg on ``upstream``, pinned to ``choice``'s engine, read to the end."""
        self.prefill_ranks.started(upstream.url, choice)
        try:
            response = await self.upstreams.open_on(
                self.prefill, upstream, "POST", path, choice.headers(headers), json_body
            )
            return await self.upstreams.read_all(self.prefill, upstream, response)
        finally:
            self.prefill_ranks.finished(upstream.url, choice)

    async def fetch_prefill(
        self, path: str, headers: dict[str, str], json_body: dict[str, Any]
    ) -> tuple[Upstream, httpx.Response]:
        """The serial prefill leg: the best instance that answers, each pinned to the engine the
        proxy picks there (one whose address it has yet to learn, if any)."""
        return await self.upstreams.first_that_connects(
            self.prefill,
            "POST",
            path,
            lambda upstream: self.prefill_leg(
                upstream, self.prefill_ranks.choose(upstream.url), path, headers, json_body
            ),
        )

    def prefill_params(self, upstream: Upstream, response: httpx.Response) -> dict[str, Any] | None:
        """A successful prefill answer's ``kv_transfer_params``; remembers where its KV lives."""
        kv_transfer_params = kv_transfer_params_from_prefill(response.content)
        self.prefill_ranks.learn(upstream.url, kv_transfer_params)
        return kv_transfer_params

    def prefill_failed(
        self, upstream: Upstream, response: httpx.Response, request_id: str
    ) -> Response:
        """A prefill's error answer, passed to the client unchanged."""
        logger.warning(
            "request %s: prefill %s answered %d; passing it to the client",
            request_id,
            upstream.url,
            response.status_code,
        )
        return passthrough(response, request_id)

    def invalid_prefill(self, upstream: Upstream, path: str, error: Exception) -> JSONResponse:
        return error_response(
            502,
            f"prefill instance {upstream.url} answered {path} with a response the proxy cannot "
            f"pass to a decode instance: {error}",
            "BadGatewayError",
        )

    async def serial(
        self,
        request: ClientRequest,
    ) -> Response:
        """Prefill first; then decode, with the block ids prefill answered."""
        request.trace.mark("prefill_sent")
        prefill_upstream, prefill_response = await self.fetch_prefill(
            request.path, request.headers, prefill_body(request.body)
        )
        request.trace.mark("prefill_answered")
        if not prefill_response.is_success:
            return self.prefill_failed(prefill_upstream, prefill_response, request.request_id)
        try:
            kv_transfer_params = self.prefill_params(prefill_upstream, prefill_response)
        except InvalidPrefillResponse as error:
            return self.invalid_prefill(prefill_upstream, request.path, error)
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
        keeping = self.keep_hold(kv_transfer_params)
        decode_upstream, decode_response = await self.until_answered(
            keeping,
            self.upstreams.open(
                self.decode,
                "POST",
                request.path,
                request.headers,
                decode_body(request.body, kv_transfer_params),
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
        return await self.upstreams.relay(
            self.decode,
            decode_upstream,
            decode_response,
            request.request_id,
            request.trace,
            cut_short=lambda: self.abandon_hold(keeping),
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
        decode_upstream, decode_response = await self.upstreams.open(
            self.decode, "POST", request.path, request.headers, decode_body(request.body, None)
        )
        request.trace.mark("decode_answered")
        return await self.upstreams.relay(
            self.decode, decode_upstream, decode_response, request.request_id, request.trace
        )

    async def overlapped(
        self,
        prefill_upstream: Upstream,
        choice: RankChoice,
        request: ClientRequest,
    ) -> Response | None:
        """Both legs at once; None when prefill cannot be reached (the caller goes serial)."""
        transfer_id = new_transfer_id(request.request_id)
        assert choice.address is not None
        decode_params = overlapped_decode_params(choice.address, transfer_id)
        request.trace.transfer_id, request.trace.mode = transfer_id, "overlapped"
        request.trace.mark("decode_sent")
        request.trace.mark("prefill_sent")
        decode_leg = asyncio.create_task(
            self.upstreams.open(
                self.decode,
                "POST",
                request.path,
                request.headers,
                decode_body(request.body, decode_params),
            )
        )
        try:
            prefill_response = await self.prefill_leg(
                prefill_upstream,
                choice,
                request.path,
                request.headers,
                overlapped_prefill_body(request.body, transfer_id),
            )
            request.trace.mark("prefill_answered")
        except NO_ANSWER_FAILURES as error:
            await self.abandon(decode_leg)
            self.prefill_ranks.forget(prefill_upstream.url)
            self.metrics.serial_fallbacks.inc()
            logger.warning(
                "request %s: prefill %s failed before answering (%s); going serial",
                request.request_id,
                prefill_upstream.url,
                error,
            )
            return None
        except BaseException:
            await self.abandon(decode_leg)
            raise
        if not prefill_response.is_success:
            await self.abandon(decode_leg)
            return self.prefill_failed(prefill_upstream, prefill_response, request.request_id)
        try:
            kv_transfer_params = self.prefill_params(prefill_upstream, prefill_response)
        except InvalidPrefillResponse as error:
            await self.abandon(decode_leg)
            return self.invalid_prefill(prefill_upstream, request.path, error)
        held_id = (kv_transfer_params or {}).get("remote_request_id")
        held_at = prefill_address(kv_transfer_params)
        if held_id != transfer_id or not same_endpoint(held_at, choice.address):
            # Decode would wait in vain: this prefill did not hold the KV under our id, or
            # workers at another address than decode was told (an engine that ignored the
            # data-parallel pin) hold it. A restart under a new engine id behind the same
            # address is not a reason: decode's early pull follows it (see same_endpoint).
            await self.abandon(decode_leg)
            logger.warning(
                "request %s: prefill %s held the KV %s; sending the decode leg again with what "
                "it returned",
                request.request_id,
                prefill_upstream.url,
                f"under {held_id!r}, not transfer id {transfer_id}"
                if held_id != transfer_id
                else f"at {held_at}, not at {choice.address} as decode was told",
            )
            request.trace.transfer_id = (kv_transfer_params or {}).get("remote_request_id")
            request.trace.mode = "resent"
            self.metrics.decode_resends.inc()
            decode_leg = asyncio.create_task(
                self.upstreams.open(
                    self.decode,
                    "POST",
                    request.path,
                    request.headers,
                    decode_body(request.body, kv_transfer_params),
                )
            )
        keeping = self.keep_hold(kv_transfer_params)
        decode_upstream, decode_response = await self.until_answered(keeping, decode_leg)
        request.trace.mark("decode_answered")
        logger.debug(
            "request %s: %s prefilled on %s alongside decode on %s (transfer %s)",
            request.request_id,
            request.path,
            prefill_upstream.url,
            decode_upstream.url,
            transfer_id,
        )
        return await self.upstreams.relay(
            self.decode,
            decode_upstream,
            decode_response,
            request.request_id,
            request.trace,
            cut_short=lambda: self.abandon_hold(keeping),
        )

    def decode_samples_first_token(self, reason: str, request_id: str) -> None:
        """Count a request whose first token decode samples again, under a label of a fixed
        set (:func:`.continuation.reason_label`); the reason itself, which may name what the
        client sent, goes to the log only."""
        label = reason_label(reason)
        self.metrics.decode_first_tokens.labels(label).inc()
        if label != reason:
            logger.debug(
                "request %s: decode samples the first token again: %.200s", request_id, reason
            )

    def keep_hold(self, kv_transfer_params: dict[str, Any] | None) -> asyncio.Task | None:
        """Renew prefill's hold on the transfer while the decode leg may wait in decode's
        queue (:mod:`.holds`)."""
        if self.hold_keeper is None:
            return None
        return self.hold_keeper.keep(kv_transfer_params)

    async def until_answered(
        self,
        keeping: asyncio.Task | None,
        decode_leg: Awaitable[tuple[Upstream, httpx.Response]],
    ) -> tuple[Upstream, httpx.Response]:
        """The decode leg's answer. When it fails, or the client leaves before it (the leg is
        closed, so vLLM aborts it), nobody will read the transfer: the renewals stop and
        prefill is told to free the hold unless a decode rank leased it. Otherwise they go
        on until prefill says the transfer was read, or until a streamed answer's relay ends
        before decode's stream did (``UpstreamClient.relay``'s ``cut_short``: the client hung
        up while decode queued or streamed), which frees the hold the same way, once."""
        try:
            upstream, response = await decode_leg
        except BaseException:
            self.abandon_hold(keeping)
            raise
        if not response.is_success:
            self.abandon_hold(keeping)
        return upstream, response

    def drop_hold(self, kv_transfer_params: dict[str, Any] | None) -> None:
        """Nobody will read the transfer prefill answered it holds (and no renewal runs for
        it): free prefill's hold now."""
        if self.hold_keeper is not None:
            self.hold_keeper.drop(kv_transfer_params)

    def abandon_hold(self, keeping: asyncio.Task | None) -> None:
        """Nobody will read the transfer ``keeping`` renews: free prefill's hold now."""
        if keeping is not None and self.hold_keeper is not None:
            self.hold_keeper.abandon(keeping)

    async def abandon(self, decode_leg: asyncio.Task) -> None:
        """Stop a decode leg whose prefill failed: closing its connection makes vLLM abort it."""
        decode_leg.cancel()
        await asyncio.wait([decode_leg])
        if decode_leg.cancelled() or decode_leg.exception() is not None:
            return
        upstream, response = decode_leg.result()
        await response.aclose()
        self.decode.release(upstream)
