"""The proxy's HTTP app: each completion request runs on a prefill instance and a decode one.

Clients see one OpenAI-compatible server. For every request the proxy asks a prefill instance for
one token with ``do_remote_decode`` (so it keeps the prompt's KV cache), then sends the client's
request with the prefill's ``kv_transfer_params`` to a decode instance, which pulls that cache
over Mooncake instead of recomputing it, and relays the decode's answer. Upstream answers that
are errors reach the client unchanged, so it sees what vLLM said, not the proxy's paraphrase.

Once a prefill instance has answered once, the proxy knows where its KV can be read and, unless
``overlap_legs`` is off, sends later requests' two legs at the same time: decode admits the
request while prefill computes it and pulls as soon as prefill is done, which saves a round trip
and decode's admission from the time to first token. If the prefill leg fails, the decode leg is
abandoned (vLLM aborts it) and the client gets the prefill's answer, as with serial legs.

Instances that do not accept connections, or fail their background health check, are ejected
(:mod:`.balancer`, :mod:`.health`): requests go to the others until the instance is back. The
connection layer (failover, relaying streams) is :mod:`.upstreams`; which data-parallel engine
of a prefill instance gets a leg, :mod:`.prefill_ranks`.
``GET /health`` is the proxy's own liveness; ``GET /ready`` says whether both roles can serve.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..connector.params import MAX_TRANSFER_ID_CHARS
from .balancer import Balancer, EjectionPolicy, Upstream
from .errors import (
    NO_ANSWER_FAILURES,
    UpstreamUnreachable,
    error_response,
    upstream_failure_response,
)
from .health import (
    DEFAULT_HEALTH_INTERVAL_S,
    DEFAULT_HEALTH_TIMEOUT_S,
    HealthChecker,
    UpstreamOutcomes,
    readiness,
)
from .holds import HoldKeeper
from .metrics import CONTENT_TYPE, ProxyMetrics
from .payloads import (
    InvalidPrefillResponse,
    decode_body,
    kv_transfer_params_from_prefill,
    overlapped_decode_params,
    overlapped_prefill_body,
    prefill_address,
    prefill_body,
    same_endpoint,
)
from .prefill_ranks import PrefillRanks, RankChoice
from .trace import RequestTrace
from .upstreams import REQUEST_ID_HEADER, UpstreamClient, passthrough

logger = logging.getLogger(__name__)

#: First requests to a vLLM CPU engine with TP=2 can take ~100 s (warm-up, compilation).
DEFAULT_TIMEOUT_S = 600.0
#: A host that drops packets should be skipped long before the request timeout (and once
#: skipped it is ejected, so this is paid once, not per request).
CONNECT_TIMEOUT_S = 10.0

#: What the proxy logs as the status of a request whose client left first (nginx's convention).
CLIENT_CLOSED_REQUEST = 499

#: The largest request body accepted (413 above it): a prompt of 100k+ token ids fits many
#: times over, a client cannot make the proxy buffer without bound.
DEFAULT_MAX_BODY_BYTES = 64 << 20

#: Client headers the upstreams need too (vLLM's ``--api-key`` checks ``Authorization``).
_FORWARDED_HEADERS = ("Authorization",)


async def _client_gone(request: Request) -> None:
    """Return once the client has closed its connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class DisaggregatingProxy:
    """Routes requests over the prefill and decode instances through one shared HTTP client."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        prefill: Balancer,
        decode: Balancer,
        timeout_s: float,
        overlap_legs: bool = True,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        self.client = client
        self.prefill = prefill
        self.decode = decode
        self.timeout_s = timeout_s
        self.overlap_legs = overlap_legs
        self.max_body_bytes = max_body_bytes
        self.metrics = ProxyMetrics((prefill, decode))
        self.outcomes = UpstreamOutcomes(self.metrics)
        self.upstreams = UpstreamClient(client, self.metrics, self.outcomes)
        #: set by the app while background health checks run; None when they are off
        self.health_checker: HealthChecker | None = None
        #: set by the app: renews prefill's hold while a decode request may be queued
        self.hold_keeper: HoldKeeper | None = None
        #: where each prefill instance's engines serve their KV, learned from their answers
        self.prefill_ranks = PrefillRanks()

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

    async def generate(self, request: Request, path: str) -> Response:
        """Run one completion request through prefill and decode; every answer, the proxy's own
        errors included, carries the request's ``X-Request-Id``."""
        request_id = request.headers.get(REQUEST_ID_HEADER) or str(uuid.uuid4())
        response = await self._generate(request, path, request_id)
        if REQUEST_ID_HEADER not in response.headers:
            response.headers[REQUEST_ID_HEADER] = request_id
        return response

    async def _generate(self, request: Request, path: str, request_id: str) -> Response:
        received = time.time()
        body = await self._read_body(request)
        if body is None:
            return error_response(
                413,
                f"request body exceeds {self.max_body_bytes} bytes (the proxy's --max-body-mib)",
                "RequestTooLargeError",
            )
        try:
            client_body = json.loads(body)
        except (ValueError, RecursionError) as error:
            reason = "nested too deeply" if isinstance(error, RecursionError) else error
            return error_response(400, f"request body is not JSON: {reason}", "BadRequestError")
        if not isinstance(client_body, dict):
            return error_response(400, "request body must be a JSON object", "BadRequestError")
        headers = {REQUEST_ID_HEADER: request_id}
        for name in _FORWARDED_HEADERS:
            if name in request.headers:
                headers[name] = request.headers[name]
        routing = asyncio.create_task(
            self._route(
                path,
                headers,
                client_body,
                request_id,
                RequestTrace({"received": received}, metrics=self.metrics),
            )
        )
        hang_up = asyncio.create_task(_client_gone(request))
        await asyncio.wait((routing, hang_up), return_when=asyncio.FIRST_COMPLETED)
        hang_up.cancel()  # the response (a stream relays its own) now owns the connection
        if not routing.done():
            # The client left before an answer was ready (prefill still computing, or a
            # non-streamed decode): cancelling closes both legs, which makes vLLM abort them.
            routing.cancel()
            await asyncio.wait((routing,))
            logger.info(
                "request %s: the client left before its answer; both legs closed", request_id
            )
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return routing.result()

    async def _read_body(self, request: Request) -> bytes | None:
        """The request body, or None once it exceeds ``max_body_bytes`` (declared or sent)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return None
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    async def _route(
        self,
        path: str,
        headers: dict[str, str],
        client_body: dict[str, Any],
        request_id: str,
        trace: RequestTrace,
    ) -> Response:
        try:
            if self.overlap_legs:
                prefill_upstream = self.prefill.ranked()[0]
                choice = self.prefill_ranks.choose(prefill_upstream.url)
                # An ejected best prefill (every one is) would likely waste the decode leg.
                if choice.address is not None and self.prefill.is_healthy(prefill_upstream):
                    overlapped = await self._overlapped(
                        prefill_upstream, choice, path, headers, client_body, request_id, trace
                    )
                    if overlapped is not None:
                        return overlapped
                    # the serial retry starts its own stamps
                    trace = RequestTrace(dict(trace.stamps), metrics=self.metrics)
            return await self._serial(path, headers, client_body, request_id, trace)
        except (UpstreamUnreachable, httpx.HTTPError) as error:
            return upstream_failure_response(error, self.timeout_s)

    def _prefill_params(
        self, upstream: Upstream, response: httpx.Response
    ) -> dict[str, Any] | None:
        """A successful prefill answer's ``kv_transfer_params``; remembers where its KV lives."""
        kv_transfer_params = kv_transfer_params_from_prefill(response.content)
        self.prefill_ranks.learn(upstream.url, kv_transfer_params)
        return kv_transfer_params

    def _prefill_failed(
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

    def _invalid_prefill(self, upstream: Upstream, path: str, error: Exception) -> JSONResponse:
        return error_response(
            502,
            f"prefill instance {upstream.url} answered {path} with a response the proxy cannot "
            f"pass to a decode instance: {error}",
            "BadGatewayError",
        )

    async def _serial(
        self,
        path: str,
        headers: dict[str, str],
        client_body: dict[str, Any],
        request_id: str,
        trace: RequestTrace,
    ) -> Response:
        """Prefill first; then decode, with the block ids prefill answered."""
        trace.mark("prefill_sent")
        prefill_upstream, prefill_response = await self.fetch_prefill(
            path, headers, prefill_body(client_body)
        )
        trace.mark("prefill_answered")
        if not prefill_response.is_success:
            return self._prefill_failed(prefill_upstream, prefill_response, request_id)
        try:
            kv_transfer_params = self._prefill_params(prefill_upstream, prefill_response)
        except InvalidPrefillResponse as error:
            return self._invalid_prefill(prefill_upstream, path, error)
        if kv_transfer_params is None:
            logger.warning(
                "request %s: prefill %s returned no kv_transfer_params; the decode instance "
                "will recompute the prompt",
                request_id,
                prefill_upstream.url,
            )
        else:
            trace.transfer_id = kv_transfer_params.get("remote_request_id")
        trace.mark("decode_sent")
        keeping = self._keep_hold(kv_transfer_params)
        decode_upstream, decode_response = await self._until_answered(
            keeping,
            self.upstreams.open(
                self.decode, "POST", path, headers, decode_body(client_body, kv_transfer_params)
            ),
        )
        trace.mark("decode_answered")
        logger.debug(
            "request %s: %s prefilled on %s, decoding on %s",
            request_id,
            path,
            prefill_upstream.url,
            decode_upstream.url,
        )
        return await self.upstreams.relay(
            self.decode, decode_upstream, decode_response, request_id, trace
        )

    async def _overlapped(
        self,
        prefill_upstream: Upstream,
        choice: RankChoice,
        path: str,
        headers: dict[str, str],
        client_body: dict[str, Any],
        request_id: str,
        trace: RequestTrace,
    ) -> Response | None:
        """Both legs at once; None when prefill cannot be reached (the caller goes serial)."""
        # Unique, and short enough for prefill to accept whatever id the client sent.
        suffix = f"-{uuid.uuid4().hex}"
        transfer_id = request_id[: MAX_TRANSFER_ID_CHARS - len(suffix)] + suffix
        assert choice.address is not None
        decode_params = overlapped_decode_params(choice.address, transfer_id)
        trace.transfer_id, trace.mode = transfer_id, "overlapped"
        trace.mark("decode_sent")
        trace.mark("prefill_sent")
        decode_leg = asyncio.create_task(
            self.upstreams.open(
                self.decode, "POST", path, headers, decode_body(client_body, decode_params)
            )
        )
        try:
            prefill_response = await self.prefill_leg(
                prefill_upstream,
                choice,
                path,
                headers,
                overlapped_prefill_body(client_body, transfer_id),
            )
            trace.mark("prefill_answered")
        except NO_ANSWER_FAILURES as error:
            await self._abandon(decode_leg)
            self.prefill_ranks.forget(prefill_upstream.url)
            self.metrics.serial_fallbacks.inc()
            logger.warning(
                "request %s: prefill %s failed before answering (%s); going serial",
                request_id,
                prefill_upstream.url,
                error,
            )
            return None
        except BaseException:
            await self._abandon(decode_leg)
            raise
        if not prefill_response.is_success:
            await self._abandon(decode_leg)
            return self._prefill_failed(prefill_upstream, prefill_response, request_id)
        try:
            kv_transfer_params = self._prefill_params(prefill_upstream, prefill_response)
        except InvalidPrefillResponse as error:
            await self._abandon(decode_leg)
            return self._invalid_prefill(prefill_upstream, path, error)
        held_id = (kv_transfer_params or {}).get("remote_request_id")
        held_at = prefill_address(kv_transfer_params)
        if held_id != transfer_id or not same_endpoint(held_at, choice.address):
            # Decode would wait in vain: this prefill did not hold the KV under our id, or
            # workers at another address than decode was told (an engine that ignored the
            # data-parallel pin) hold it. A restart under a new engine id behind the same
            # address is not a reason: decode's early pull follows it (see same_endpoint).
            await self._abandon(decode_leg)
            logger.warning(
                "request %s: prefill %s held the KV %s; sending the decode leg again with what "
                "it returned",
                request_id,
                prefill_upstream.url,
                f"under {held_id!r}, not transfer id {transfer_id}"
                if held_id != transfer_id
                else f"at {held_at}, not at {choice.address} as decode was told",
            )
            trace.transfer_id = (kv_transfer_params or {}).get("remote_request_id")
            trace.mode = "resent"
            self.metrics.decode_resends.inc()
            decode_leg = asyncio.create_task(
                self.upstreams.open(
                    self.decode, "POST", path, headers, decode_body(client_body, kv_transfer_params)
                )
            )
        keeping = self._keep_hold(kv_transfer_params)
        decode_upstream, decode_response = await self._until_answered(keeping, decode_leg)
        trace.mark("decode_answered")
        logger.debug(
            "request %s: %s prefilled on %s alongside decode on %s (transfer %s)",
            request_id,
            path,
            prefill_upstream.url,
            decode_upstream.url,
            transfer_id,
        )
        return await self.upstreams.relay(
            self.decode, decode_upstream, decode_response, request_id, trace
        )

    def _keep_hold(self, kv_transfer_params: dict[str, Any] | None) -> asyncio.Task | None:
        """Renew prefill's hold on the transfer while the decode leg may wait in decode's
        queue (:mod:`.holds`)."""
        if self.hold_keeper is None:
            return None
        return self.hold_keeper.keep(kv_transfer_params)

    @staticmethod
    async def _until_answered(
        keeping: asyncio.Task | None, decode_leg: Awaitable[tuple[Upstream, httpx.Response]]
    ) -> tuple[Upstream, httpx.Response]:
        """The decode leg's answer; the renewals stop when it fails (nobody will read the
        transfer), and otherwise once prefill says the transfer was read."""
        try:
            upstream, response = await decode_leg
        except BaseException:
            if keeping is not None:
                keeping.cancel()
            raise
        if keeping is not None and not response.is_success:
            keeping.cancel()
        return upstream, response

    async def _abandon(self, decode_leg: asyncio.Task) -> None:
        """Stop a decode leg whose prefill failed: closing its connection makes vLLM abort it."""
        decode_leg.cancel()
        await asyncio.wait([decode_leg])
        if decode_leg.cancelled() or decode_leg.exception() is not None:
            return
        upstream, response = decode_leg.result()
        await response.aclose()
        self.decode.release(upstream)

    async def models(self) -> Response:
        """Return a decode instance's ``/v1/models`` (every instance serves the same model)."""
        try:
            _, response = await self.upstreams.fetch(self.decode, "GET", "/v1/models", headers={})
        except (UpstreamUnreachable, httpx.HTTPError) as error:
            return upstream_failure_response(error, self.timeout_s)
        return passthrough(response, request_id=None)

    def health(self) -> JSONResponse:
        """Liveness: the proxy answers. It asks no instance, so a slow or dead upstream can
        never make an orchestrator restart a proxy that is fine."""
        return JSONResponse({"status": "alive"})

    async def ready(self) -> JSONResponse:
        """Readiness, from the health checks' and requests' verdicts (no probe of its own):
        200 while at least one prefill and one decode instance are healthy, 503 otherwise."""
        if self.health_checker is not None:
            await self.health_checker.wait_first_round()
        serving, report = readiness(self.prefill, self.decode)
        return JSONResponse(report, status_code=200 if serving else 503)


def create_app(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    overlap_legs: bool = True,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
    health_interval_s: float = DEFAULT_HEALTH_INTERVAL_S,
    health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S,
    ejection: EjectionPolicy | None = None,
    renew_holds: bool = True,
) -> FastAPI:
    """Build the proxy app for the given prefill and decode instances (base URLs).

    ``health_interval_s`` 0 turns the background health checks off; an ejected instance is then
    tried again by one request once its back-off is over. With them on, the probes decide.
    ``renew_holds``: keep prefill's hold on each transfer until decode read it (:mod:`.holds`).
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if max_body_bytes <= 0:
        raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
    if connect_timeout_s <= 0:
        raise ValueError(f"connect_timeout_s must be positive, got {connect_timeout_s}")
    if health_interval_s < 0:
        raise ValueError(
            f"health_interval_s must be positive, or 0 to turn health checks off; "
            f"got {health_interval_s}"
        )
    if health_timeout_s <= 0:
        raise ValueError(f"health_timeout_s must be positive, got {health_timeout_s}")
    policy = ejection or EjectionPolicy()
    health_checks = health_interval_s > 0
    prefill = Balancer("prefill", prefill_urls, policy, request_trials=not health_checks)
    decode = Balancer("decode", decode_urls, policy, request_trials=not health_checks)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # No connection limit: vLLM queues requests itself, and a pool limit here would only
        # add a second, invisible queue. trust_env=False keeps HTTP(S)_PROXY settings from
        # routing upstream traffic through a forward proxy.
        async with httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, connect_timeout_s)),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            trust_env=False,
        ) as client:
            proxy = DisaggregatingProxy(
                client, prefill, decode, timeout_s, overlap_legs, max_body_bytes
            )
            if renew_holds:
                proxy.hold_keeper = HoldKeeper(on_renewal=proxy.metrics.hold_renewals.inc)
            if health_checks:
                proxy.health_checker = HealthChecker(
                    client, (prefill, decode), proxy.outcomes, health_interval_s, health_timeout_s
                )
            app.state.proxy = proxy
            logger.info(
                "proxying to prefill %s and decode %s; health checks %s",
                [upstream.url for upstream in prefill.upstreams],
                [upstream.url for upstream in decode.upstreams],
                f"every {health_interval_s:g} s" if health_checks else "off",
            )
            if proxy.health_checker is not None:
                proxy.health_checker.start()
            try:
                yield
            finally:
                if proxy.health_checker is not None:
                    await proxy.health_checker.stop()
                if proxy.hold_keeper is not None:
                    await proxy.hold_keeper.close()

    app = FastAPI(title="vllm-ascend-mooncake P/D proxy", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await request.app.state.proxy.generate(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await request.app.state.proxy.generate(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await request.app.state.proxy.models()

    @app.get("/health")
    async def health(request: Request) -> Response:
        return request.app.state.proxy.health()

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        return await request.app.state.proxy.ready()

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(request.app.state.proxy.metrics.exposition(), media_type=CONTENT_TYPE)

    return app
