"""A stand-in for a vLLM OpenAI server, reduced to what the proxy depends on.

It records every request it receives and answers like vLLM does: a completion JSON (with a
top-level ``kv_transfer_params``) or, for ``"stream": true``, a server-sent event stream ending
in ``data: [DONE]``. Tests change its attributes to make it fail, stall or misbehave.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

#: Put as ``kv_transfer_params`` to leave the key out of the response entirely.
OMIT = object()
STREAM_TOKENS = 4
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class ReceivedRequest:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    at: float = field(default_factory=time.monotonic)


@dataclass
class FakeVllm:
    """One fake instance; ``reset()`` restores the well-behaved defaults between tests."""

    name: str
    received: list[ReceivedRequest] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.received.clear()
        self.kv_transfer_params: Any = {
            "remote_engine_id": f"engine-{self.name}",
            "remote_block_ids": [3, 1, 4],
            "remote_host": "127.0.0.1",
            "remote_port": 5555,
        }
        #: Answer like the connector's prefill: the full address, held under the request's
        #: ``transfer_id`` when it has one (so the proxy may overlap later requests' legs).
        self.hands_off_like_the_connector = False
        #: The data-parallel engines behind this API server (when handing off like the
        #: connector): a request pinned with ``X-data-parallel-rank`` goes to that engine, as in
        #: vLLM, unless ``ignores_dp_pin``; any other to ``unpinned_dp_rank``.
        self.dp_size = 1
        self.unpinned_dp_rank = 0
        self.ignores_dp_pin = False
        #: ``(status, body bytes, content type)`` to answer every generation request with.
        self.canned_answer: tuple[int, bytes, str] | None = None
        self.health_status = 200
        #: seconds ``/health`` waits before answering (a hung instance)
        self.health_delay_s = 0.0
        #: ``/health`` requests received (not kept in ``received``: probes come all the time)
        self.health_checks = 0
        self.delay_s = 0.0
        #: While clear, a stream stops after its first event, so tests can see it arrive alone.
        self.stream_gate = threading.Event()
        self.stream_gate.set()

    def generation_requests(self) -> list[ReceivedRequest]:
        return [request for request in self.received if request.path in GENERATION_PATHS]

    def stream_events(self, path: str) -> list[bytes]:
        """The exact SSE events this instance streams for ``path``, in order."""
        events = []
        for index in range(STREAM_TOKENS):
            if path == "/v1/chat/completions":
                choice = {"index": 0, "delta": {"content": f"t{index}"}}
            else:
                choice = {"index": 0, "text": f"t{index}"}
            chunk = {"id": f"{self.name}-stream", "choices": [choice]}
            events.append(f"data: {json.dumps(chunk)}\n\n".encode())
        events.append(b"data: [DONE]\n\n")
        return events

    def serving_rank(self, headers: dict[str, str]) -> int:
        """The engine that serves a request with these headers."""
        pinned = headers.get("x-data-parallel-rank")
        if pinned is None or self.ignores_dp_pin:
            return self.unpinned_dp_rank
        return int(pinned)

    def connector_params(self, request_body: dict[str, Any], dp_rank: int = 0) -> dict[str, Any]:
        """What the connector's prefill (engine ``dp_rank`` of ``dp_size``) answers with."""
        asked = request_body.get("kv_transfer_params") or {}
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": f"engine-{self.name}",
            "remote_request_id": asked.get("transfer_id", f"{self.name}-request"),
            "remote_host": "127.0.0.1",
            "remote_port": 5555,
            "remote_tp_size": 1,
            "remote_block_ids": [3, 1, 4],
            "remote_num_tokens": 70,
        }
        if self.dp_size > 1:  # each engine: its own id (vLLM appends _dp<rank>) and ports
            params["remote_engine_id"] += f"_dp{dp_rank}"
            params["remote_port"] += dp_rank
            params.update(remote_dp_rank=dp_rank, remote_dp_size=self.dp_size)
        return params

    def completion(
        self,
        path: str,
        request_body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """The JSON this instance answers a non-streamed request to ``path`` with."""
        if path == "/v1/chat/completions":
            choice = {"index": 0, "message": {"role": "assistant", "content": self.name}}
        else:
            choice = {"index": 0, "text": self.name}
        answer: dict[str, Any] = {"id": f"{self.name}-completion", "choices": [choice]}
        if self.hands_off_like_the_connector:
            answer["kv_transfer_params"] = self.connector_params(
                request_body or {}, self.serving_rank(headers or {})
            )
        elif self.kv_transfer_params is not OMIT:
            answer["kv_transfer_params"] = self.kv_transfer_params
        return answer

    def app(self) -> FastAPI:
        app = FastAPI()

        async def generate(request: Request) -> Response:
            body = await request.json()
            self.received.append(
                ReceivedRequest(request.url.path, body, dict(request.headers.items()))
            )
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if self.canned_answer is not None:
                status, content, media_type = self.canned_answer
                return Response(content, status_code=status, media_type=media_type)
            if body.get("stream"):
                return StreamingResponse(
                    self._stream(request.url.path), media_type="text/event-stream"
                )
            return JSONResponse(self.completion(request.url.path, body, dict(request.headers)))

        app.add_api_route("/v1/completions", generate, methods=["POST"])
        app.add_api_route("/v1/chat/completions", generate, methods=["POST"])

        @app.get("/v1/models")
        async def models(request: Request) -> JSONResponse:
            self.received.append(ReceivedRequest("/v1/models", {}, dict(request.headers)))
            return JSONResponse({"object": "list", "data": [{"id": "tiny", "owned_by": self.name}]})

        @app.get("/health")
        async def health() -> Response:
            self.health_checks += 1
            if self.health_delay_s:
                await asyncio.sleep(self.health_delay_s)
            return Response(status_code=self.health_status)

        return app

    async def _stream(self, path: str) -> AsyncIterator[bytes]:
        first, *rest = self.stream_events(path)
        yield first
        await asyncio.to_thread(self.stream_gate.wait, 10)
        for event in rest:
            yield event
