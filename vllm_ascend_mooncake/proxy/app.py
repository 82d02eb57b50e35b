"""The proxy's HTTP app: each completion request runs on a prefill instance and a decode one.

Clients see one OpenAI-compatible server. This module reads a request (its body, its id, a
client that leaves) and hands it to :mod:`.routing`, which picks its route: by default the
answer's first token is the one prefill samples (:mod:`.continued_route`, rules in
:mod:`.continuable`); requests whose parameters decode could not continue exactly, and every
request under ``--first-token decode`` or ``X-First-Token-From: decode``, take the routes where
decode samples the first token again (:mod:`.overlapped_route`, :mod:`.serial_route`). Upstream
answers that are errors reach the client unchanged, so it sees what vLLM said, not the proxy's
paraphrase.

Every route reaches the instances through :mod:`.pool`. Instances that do not accept
connections, or fail their background health check, are ejected (:mod:`.balancer`,
:mod:`.health`): requests go to the others until the instance is back. A prefill instance every
decode instance reports it cannot read is routed around, :mod:`.pairing`.
``GET /health`` is the proxy's own liveness; ``GET /ready`` says whether both roles can serve.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .balancer import Balancer, EjectionPolicy
from .client_request import ClientRequest
from .continuable import FIRST_TOKEN_HEADER, FIRST_TOKEN_SOURCES, FROM_PREFILL
from .errors import (
    UpstreamUnreachable,
    error_response,
    upstream_failure_response,
)
from .formats.token_texts import TokenTexts
from .health import (
    DEFAULT_HEALTH_INTERVAL_S,
    DEFAULT_HEALTH_TIMEOUT_S,
    HealthChecker,
    UpstreamOutcomes,
    readiness,
)
from .holds import HoldKeeper
from .metrics import CONTENT_TYPE, ProxyMetrics
from .model_limits import ModelLimits
from .pairing import PairingWatch
from .pool import InstancePool
from .routing import Router
from .trace import RequestTrace
from .upstreams import (
    REQUEST_ID_HEADER,
    UpstreamClient,
    passthrough,
)

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
        first_token: str = FROM_PREFILL,
    ) -> None:
        self.client = client
        self.prefill = prefill
        self.decode = decode
        self.timeout_s = timeout_s
        self.overlap_legs = overlap_legs
        self.max_body_bytes = max_body_bytes
        #: where answers' first token comes from unless a request says otherwise
        self.first_token = first_token
        self.metrics = ProxyMetrics((prefill, decode))
        self.outcomes = UpstreamOutcomes(self.metrics)
        self.upstreams = UpstreamClient(client, self.metrics, self.outcomes)
        #: set by the app while background health checks run; None when they are off
        self.health_checker: HealthChecker | None = None
        self.pool = InstancePool(self.upstreams, prefill, decode)
        self.router = Router(
            self.pool,
            self.metrics,
            TokenTexts(client),
            ModelLimits(client),
            timeout_s=timeout_s,
            overlap_legs=overlap_legs,
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
            self.router.route(
                ClientRequest(
                    path,
                    headers,
                    client_body,
                    request_id,
                    RequestTrace({"received": received}, metrics=self.metrics),
                ),
                first_token=request.headers.get(FIRST_TOKEN_HEADER, self.first_token).lower(),
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
    first_token: str = FROM_PREFILL,
    unpairable_retry: EjectionPolicy | None = None,
) -> FastAPI:
    """Build the proxy app for the given prefill and decode instances (base URLs).

    ``health_interval_s`` 0 turns the background health checks off; an ejected instance is then
    tried again by one request once its back-off is over. With them on, the probes decide.
    ``renew_holds``: keep prefill's hold on each transfer until decode read it (:mod:`.holds`).
    ``first_token``: ``"prefill"`` (continue from prefill's token where a request allows it,
    :mod:`.continuable`) or ``"decode"`` (decode samples every answer's first token again).
    ``unpairable_retry``: when a prefill instance no decode can read is tried again
    (:mod:`.pairing`, which needs the health checks).
    """
    _check_options(
        first_token=first_token,
        timeout_s=timeout_s,
        max_body_bytes=max_body_bytes,
        connect_timeout_s=connect_timeout_s,
        health_interval_s=health_interval_s,
        health_timeout_s=health_timeout_s,
    )
    policy = ejection or EjectionPolicy()
    health_checks = health_interval_s > 0
    prefill = Balancer(
        "prefill",
        prefill_urls,
        policy,
        request_trials=not health_checks,
        unpairable_retry=unpairable_retry,
    )
    decode = Balancer("decode", decode_urls, policy, request_trials=not health_checks)

    def start(client: httpx.AsyncClient) -> DisaggregatingProxy:
        proxy = DisaggregatingProxy(
            client, prefill, decode, timeout_s, overlap_legs, max_body_bytes, first_token
        )
        if renew_holds:
            proxy.pool.hold_keeper = HoldKeeper(on_renewal=proxy.metrics.hold_renewals.inc)
        if health_checks:
            proxy.health_checker = HealthChecker(
                client, (prefill, decode), proxy.outcomes, health_interval_s, health_timeout_s
            )
            proxy.health_checker.pairing = PairingWatch(
                client, prefill, decode, proxy.pool.prefill_ranks, health_timeout_s
            )
        logger.info(
            "proxying to prefill %s and decode %s; health checks %s",
            [upstream.url for upstream in prefill.upstreams],
            [upstream.url for upstream in decode.upstreams],
            f"every {health_interval_s:g} s" if health_checks else "off",
        )
        return proxy

    app = FastAPI(
        title="vllm-ascend-mooncake P/D proxy",
        lifespan=_lifespan(start, timeout_s, connect_timeout_s),
    )
    _add_endpoints(app)
    return app


def _check_options(
    *,
    first_token: str,
    timeout_s: float,
    max_body_bytes: int,
    connect_timeout_s: float,
    health_interval_s: float,
    health_timeout_s: float,
) -> None:
    """Refuse options no proxy can run with, before anything starts."""
    if first_token not in FIRST_TOKEN_SOURCES:
        raise ValueError(f"first_token must be one of {FIRST_TOKEN_SOURCES}, got {first_token!r}")
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


def _lifespan(
    start: Callable[[httpx.AsyncClient], DisaggregatingProxy],
    timeout_s: float,
    connect_timeout_s: float,
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's life: one shared HTTP client, the proxy ``start`` builds on it, and its
    background work (health checks, hold renewals) stopped at the end."""

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
            proxy = app.state.proxy = start(client)
            if proxy.health_checker is not None:
                proxy.health_checker.start()
            try:
                yield
            finally:
                if proxy.health_checker is not None:
                    await proxy.health_checker.stop()
                if proxy.pool.hold_keeper is not None:
                    await proxy.pool.hold_keeper.close()

    return lifespan


def _add_endpoints(app: FastAPI) -> None:
    """The OpenAI endpoints, the proxy's health, readiness and metrics."""

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
