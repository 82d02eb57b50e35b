"""A minimal P/D proxy for vLLM's in-tree ``MooncakeConnector`` (benchmark use only).

vLLM 0.32 ships no proxy that speaks the connector's current protocol (its example proxy predates
``transfer_id``), so the benchmark brings this one. Protocol, per request:

* the prefill (P) instance's engine id comes from its bootstrap server,
  ``GET http://P:VLLM_MOONCAKE_BOOTSTRAP_PORT/query`` -> ``{"0": {"engine_id": E, ...}}``;
* a fresh ``transfer_id`` names the transfer on both sides;
* P gets the request for one non-streamed token with ``kv_transfer_params =
  {do_remote_decode: true, do_remote_prefill: false, transfer_id}``, and *at the same time* the
  decode (D) instance gets the client's request with ``kv_transfer_params = {do_remote_prefill:
  true, do_remote_decode: false, remote_bootstrap_addr, remote_engine_id: E, transfer_id}``; D
  waits for P to push the prompt's KV cache, then streams the answer, which is relayed as is.

If P fails before D has produced anything, the client's stream ends with an error event instead
of waiting for D's abort timeout. Run as ``python -m benchmarks.e2e.mooncake_proxy --help``; like
``vllm_ascend_mooncake.proxy`` it is a FastAPI app on uvicorn with one shared httpx client, so
the two P/D systems pay comparable proxy overheads.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger("benchmarks.e2e.mooncake_proxy")

#: Keys that only make sense for the decode leg: P returns one non-streamed token, and vLLM
#: rejects ``min_tokens`` greater than ``max_tokens``.
_DECODE_ONLY_KEYS = ("stream_options", "min_tokens")
_HEALTH_TIMEOUT_S = 5.0


class BootstrapError(RuntimeError):
    """P's bootstrap server did not (yet) report an engine id."""


def engine_id_from_bootstrap(payload: Any, data_parallel_rank: int = 0) -> str:
    """The prefill engine id in a bootstrap ``/query`` answer (keyed by data-parallel rank)."""
    if not isinstance(payload, dict):
        raise BootstrapError(f"bootstrap /query answered {json.dumps(payload)[:200]}")
    entry = payload.get(str(data_parallel_rank))
    if not isinstance(entry, dict) or not entry.get("engine_id"):
        raise BootstrapError(
            f"no engine_id for data-parallel rank {data_parallel_rank} in "
            f"{json.dumps(payload)[:200]} (have all prefill workers registered?)"
        )
    return str(entry["engine_id"])


def prefill_leg_body(client_body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    """The client's request rewritten for P: one non-streamed token, KV kept for D.

    ``ignore_eos`` is forced because a P request that stops on EOS finishes as "stopped", not
    "length capped", and the connector then drops the transfer (D would wait for its timeout).
    """
    body = {key: value for key, value in client_body.items() if key not in _DECODE_ONLY_KEYS}
    body["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": transfer_id,
    }
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    body["ignore_eos"] = True
    return body


def decode_leg_body(
    client_body: dict[str, Any], transfer_id: str, bootstrap_url: str, engine_id: str
) -> dict[str, Any]:
    """The client's request for D, told where to get the prompt's KV cache."""
    body = dict(client_body)
    body["kv_transfer_params"] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_bootstrap_addr": bootstrap_url,
        "remote_engine_id": engine_id,
        "transfer_id": transfer_id,
    }
    return body


def sse_error_event(message: str) -> bytes:
    """An OpenAI-style error event, as vLLM itself emits when a stream fails."""
    payload = {"error": {"message": message, "type": "BadGatewayError", "code": 502}}
    return f"data: {json.dumps(payload)}\n\ndata: [DONE]\n\n".encode()


@dataclass
class PrefillCounters:
    """Outcome of every P leg, so the benchmark can tell a silent P failure from a slow D."""

    succeeded: int = 0
    failed: int = 0
    last_error: str | None = None


class MooncakeProxy:
    """Routes each completion to P and D concurrently under one ``transfer_id``."""

    def __init__(
        self, client: httpx.AsyncClient, prefill_url: str, decode_url: str, bootstrap_url: str
    ) -> None:
        self.client = client
        self.prefill_url = prefill_url
        self.decode_url = decode_url
        self.bootstrap_url = bootstrap_url
        self.counters = PrefillCounters()
        self._engine_id: str | None = None

    async def engine_id(self) -> str:
        """P's engine id (a fresh uuid each time P starts), asked once and then cached."""
        if self._engine_id is None:
            response = await self.client.get(
                f"{self.bootstrap_url}/query", timeout=_HEALTH_TIMEOUT_S
            )
            response.raise_for_status()
            self._engine_id = engine_id_from_bootstrap(response.json())
        return self._engine_id

    async def run_prefill(self, body: dict[str, Any], transfer_id: str) -> str | None:
        """Send the P leg; return None on success or a description of the failure."""
        try:
            response = await self.client.post(
                f"{self.prefill_url}/v1/completions",
                json=prefill_leg_body(body, transfer_id),
                headers={"X-data-parallel-rank": "0"},
            )
        except httpx.HTTPError as error:
            failure = f"prefill request failed: {type(error).__name__}: {error}"
        else:
            if response.is_success:
                self.counters.succeeded += 1
                return None
            failure = f"prefill answered HTTP {response.status_code}: {response.text[:300]}"
        self.counters.failed += 1
        self.counters.last_error = failure
        logger.error("transfer %s: %s", transfer_id, failure)
        return failure

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        try:
            engine_id = await self.engine_id()
        except (httpx.HTTPError, BootstrapError) as error:
            return _error(503, f"prefill bootstrap server not ready: {error}")
        transfer_id = str(uuid.uuid4())
        prefill = asyncio.create_task(self.run_prefill(body, transfer_id))
        decode_request = self.client.build_request(
            "POST",
            f"{self.decode_url}/v1/completions",
            json=decode_leg_body(body, transfer_id, self.bootstrap_url, engine_id),
        )
        try:
            decode = await self.client.send(decode_request, stream=True)
        except httpx.HTTPError as error:
            await prefill
            return _error(502, f"decode request failed: {type(error).__name__}: {error}")
        is_stream = decode.headers.get("content-type", "").startswith("text/event-stream")
        if not (decode.is_success and is_stream):
            try:
                content = await decode.aread()
            finally:
                await decode.aclose()
            await prefill
            return Response(
                content,
                status_code=decode.status_code,
                media_type=decode.headers.get("content-type"),
            )
        return StreamingResponse(
            _relay(decode, prefill, transfer_id), media_type="text/event-stream"
        )

    async def health(self) -> JSONResponse:
        """200 only when P and D answer ``/health`` and P's bootstrap server knows its engine."""
        report: dict[str, Any] = {}
        for role, url in (("prefill", self.prefill_url), ("decode", self.decode_url)):
            try:
                response = await self.client.get(f"{url}/health", timeout=_HEALTH_TIMEOUT_S)
                report[role] = response.status_code == 200
            except httpx.HTTPError:
                report[role] = False
        try:
            self._engine_id = None  # re-ask: a restarted P has a new engine id
            report["engine_id"] = await self.engine_id()
        except (httpx.HTTPError, BootstrapError) as error:
            report["engine_id"] = None
            report["bootstrap_error"] = str(error)
        healthy = report["prefill"] and report["decode"] and report["engine_id"] is not None
        return JSONResponse(report, status_code=200 if healthy else 503)


async def _relay(
    decode: httpx.Response, prefill: asyncio.Task[str | None], transfer_id: str
) -> AsyncIterator[bytes]:
    """Relay D's stream; if P fails before D's first chunk, end with an error event instead."""
    chunks = decode.aiter_raw()
    try:
        first_chunk = asyncio.ensure_future(chunks.__anext__())
        done, _ = await asyncio.wait({first_chunk, prefill}, return_when=asyncio.FIRST_COMPLETED)
        if first_chunk not in done and prefill.result() is not None:
            first_chunk.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await first_chunk
            yield sse_error_event(f"transfer {transfer_id}: {prefill.result()}")
            return
        try:
            yield await first_chunk
        except StopAsyncIteration:
            return
        async for chunk in chunks:
            yield chunk
    finally:
        await decode.aclose()
        if not prefill.done():
            await prefill


def _error(status_code: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "ProxyError", "code": status_code}},
        status_code=status_code,
    )


def create_app(
    prefill_url: str, decode_url: str, bootstrap_url: str, timeout_s: float = 600.0
) -> FastAPI:
    """The proxy as an ASGI app (one shared httpx client, no connection limit)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            trust_env=False,
        ) as client:
            app.state.proxy = MooncakeProxy(client, prefill_url, decode_url, bootstrap_url)
            yield

    app = FastAPI(title="benchmark proxy for vLLM's MooncakeConnector", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await request.app.state.proxy.completions(request)

    @app.get("/health")
    async def health(request: Request) -> Response:
        return await request.app.state.proxy.health()

    @app.get("/proxy_stats")
    async def proxy_stats(request: Request) -> Response:
        counters: PrefillCounters = request.app.state.proxy.counters
        return JSONResponse(
            {
                "prefill_succeeded": counters.succeeded,
                "prefill_failed": counters.failed,
                "last_prefill_error": counters.last_error,
            }
        )

    return app


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.e2e.mooncake_proxy",
        description="P/D proxy for vLLM's MooncakeConnector (transfer_id protocol).",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", required=True, help="P base URL, e.g. http://127.0.0.1:8100")
    parser.add_argument("--decode", required=True, help="D base URL")
    parser.add_argument(
        "--bootstrap", required=True, help="P's bootstrap server, e.g. http://127.0.0.1:8998"
    )
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    # One INFO line per upstream request would be proxy overhead that ours does not have.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    import uvicorn

    uvicorn.run(
        create_app(args.prefill, args.decode, args.bootstrap, args.timeout_s),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main()
