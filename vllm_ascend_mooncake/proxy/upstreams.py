"""The proxy's HTTP connection layer: a request opened on the best instance of a role.

:meth:`UpstreamClient.open` sends to the instances of one role in the balancer's order until
one answers (only failures before any answer move on, see ``errors.NO_ANSWER_FAILURES``: a
request an instance began answering is never sent twice), counts the instance busy until its
answer is read or relayed,
and reports each connection's outcome to the ejection bookkeeping (:mod:`.health`).
:meth:`UpstreamClient.relay` gives an opened answer to the client, event streams chunk by chunk,
and releases the instance however the stream ends.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import httpx
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from .balancer import Balancer, Upstream
from .errors import NO_ANSWER_FAILURES, UpstreamUnreachable, describe_error
from .health import UpstreamOutcomes
from .metrics import ProxyMetrics
from .trace import RequestTrace

logger = logging.getLogger(__name__)
_Opened = TypeVar("_Opened")

REQUEST_ID_HEADER = "X-Request-Id"


def relayed_headers(upstream_response: httpx.Response, request_id: str | None) -> dict[str, str]:
    """Headers to give the client: the upstream's content type and the request's id."""
    headers = {}
    if "content-type" in upstream_response.headers:
        headers["content-type"] = upstream_response.headers["content-type"]
    if request_id is not None:
        headers[REQUEST_ID_HEADER] = request_id
    return headers


def passthrough(upstream_response: httpx.Response, request_id: str | None) -> Response:
    """Return a fully read upstream response to the client with its status and body unchanged."""
    return Response(
        content=upstream_response.content,
        status_code=upstream_response.status_code,
        headers=relayed_headers(upstream_response, request_id),
    )


class UpstreamStreamResponse(StreamingResponse):
    """A relayed stream that runs ``close`` once it is over, however it ends.

    A ``finally`` in the chunk generator is not enough: if the client hangs up before the
    first chunk, the generator never starts and its ``finally`` never runs, which would leave
    the upstream connection open and the instance counted as busy for good. Closing the
    upstream connection also tells vLLM to abort the request.
    """

    def __init__(
        self,
        content: AsyncIterator[bytes],
        close: Callable[[], Awaitable[None]],
        *,
        status_code: int,
        headers: dict[str, str],
    ) -> None:
        super().__init__(content, status_code=status_code, headers=headers)
        self._close = close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()


class UpstreamClient:
    """Opens, reads and relays requests to instances through one shared HTTP client."""

    def __init__(
        self, client: httpx.AsyncClient, metrics: ProxyMetrics, outcomes: UpstreamOutcomes
    ) -> None:
        self.client = client
        self.metrics = metrics
        self.outcomes = outcomes

    async def open(
        self,
        balancer: Balancer,
        method: str,
        path: str,
        headers: dict[str, str],
        json_body: dict[str, Any] | None = None,
    ) -> tuple[Upstream, httpx.Response]:
        """Send to the best instance that answers; the body is left unread.

        The returned instance is counted as busy until the caller releases it.
        """
        return await self.first_that_connects(
            balancer,
            method,
            path,
            lambda upstream: self.open_on(balancer, upstream, method, path, headers, json_body),
        )

    async def first_that_connects(
        self,
        balancer: Balancer,
        method: str,
        path: str,
        send: Callable[[Upstream], Awaitable[_Opened]],
    ) -> tuple[Upstream, _Opened]:
        """``send`` to each instance in rank order until one answers.

        Only failures before any answer (``NO_ANSWER_FAILURES``) move on to the next instance:
        that one refused the connection, or dropped it unanswered (starting up, dying, or an
        idle keep-alive closed at reuse). Ejections are logged once by
        :class:`UpstreamOutcomes`; each failover is logged at DEBUG only, so a dead instance
        cannot flood the log.
        """
        attempts = []
        for upstream in balancer.ranked():
            try:
                opened = await send(upstream)
            except NO_ANSWER_FAILURES as error:
                attempts.append(f"{upstream.url} ({describe_error(error)})")
                self.metrics.failovers.labels(balancer.role).inc()
                logger.debug(
                    "%s instance %s did not answer %s %s (%s); trying the next one",
                    balancer.role,
                    upstream.url,
                    method,
                    path,
                    describe_error(error),
                )
                continue
            return upstream, opened
        raise UpstreamUnreachable(balancer.role, path, attempts)

    async def open_on(
        self,
        balancer: Balancer,
        upstream: Upstream,
        method: str,
        path: str,
        headers: dict[str, str],
        json_body: dict[str, Any] | None = None,
    ) -> httpx.Response:
        """Send to one instance, counted busy until released; the body is left unread.

        A failure before any answer counts towards the instance's ejection; any answer, an HTTP
        error status included (the client gets it unchanged), proves it reachable.
        """
        balancer.acquire(upstream)
        request = self.client.build_request(
            method, f"{upstream.url}{path}", headers=headers, json=json_body
        )
        try:
            response = await self.client.send(request, stream=True)
        except NO_ANSWER_FAILURES as error:
            balancer.release(upstream)
            self.outcomes.failed(balancer, upstream, f"{method} {path}: {describe_error(error)}")
            raise
        except BaseException:
            balancer.release(upstream)
            raise
        self.outcomes.succeeded(balancer, upstream, f"it answered {method} {path}")
        return response

    async def read_all(
        self, balancer: Balancer, upstream: Upstream, response: httpx.Response
    ) -> httpx.Response:
        """Read an opened response to the end and release its instance."""
        try:
            await response.aread()
        finally:
            await response.aclose()
            balancer.release(upstream)
        return response

    async def fetch(
        self,
        balancer: Balancer,
        method: str,
        path: str,
        headers: dict[str, str],
        json_body: dict[str, Any] | None = None,
    ) -> tuple[Upstream, httpx.Response]:
        """Like :meth:`open`, but read the whole body and release the instance."""
        upstream, response = await self.open(balancer, method, path, headers, json_body)
        return upstream, await self.read_all(balancer, upstream, response)

    async def relay(
        self,
        balancer: Balancer,
        upstream: Upstream,
        response: httpx.Response,
        request_id: str,
        trace: RequestTrace | None = None,
        cut_short: Callable[[], None] | None = None,
    ) -> Response:
        """Give an opened upstream response to the client: event streams chunk by chunk.
        ``cut_short`` runs once if a stream ends before the upstream's did (the client hung up,
        or the upstream's stream broke off): the upstream request is aborted then."""
        trace = trace or RequestTrace()
        is_event_stream = response.headers.get("content-type", "").startswith("text/event-stream")
        if not (response.is_success and is_event_stream):
            answer = passthrough(await self.read_all(balancer, upstream, response), request_id)
            trace.emit()
            return answer
        relayed_to_the_end = False

        async def chunks() -> AsyncIterator[bytes]:
            nonlocal relayed_to_the_end
            try:
                async for chunk in response.aiter_raw():
                    trace.mark("first_chunk")
                    yield chunk
            except httpx.HTTPError as error:
                logger.error(
                    "request %s: stream from %s broke off: %r", request_id, upstream.url, error
                )
                raise
            relayed_to_the_end = True

        async def close() -> None:
            if not relayed_to_the_end and cut_short is not None:
                cut_short()  # before any await: a close cancelled mid-way still runs it
            try:
                await response.aclose()
            finally:
                balancer.release(upstream)
                trace.emit()

        return UpstreamStreamResponse(
            chunks(),
            close,
            status_code=response.status_code,
            headers=relayed_headers(response, request_id),
        )
