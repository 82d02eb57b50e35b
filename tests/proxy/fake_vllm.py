"""A stand-in for a vLLM OpenAI server, reduced to what the proxy depends on.

It records every request it receives and answers like vLLM does: a completion JSON (with a
top-level ``kv_transfer_params``) or, for ``"stream": true``, a server-sent event stream ending
in ``data: [DONE]``. Tests change its attributes to make it fail, stall or misbehave.

With ``generates`` set it is a tiny deterministic engine instead (:class:`TinyEngine`): it
tokenizes, generates tokens that depend on the whole context, answers logprobs, token ids and
usage in vLLM's shapes, holds KV like the connector's prefill and continues a prompt like its
decode, so the proxy's joined answers can be compared with the fake's own colocated answer.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import TypeAdapter

#: vLLM's request models read boolean fields as pydantic does in lax mode ("true", 1, "no" ...).
_LAX_BOOL: TypeAdapter[bool | None] = TypeAdapter(bool | None)


def flag(body: dict[str, Any], key: str) -> bool:
    """A boolean request field as vLLM reads it (absent: false)."""
    return bool(_LAX_BOOL.validate_python(body.get(key)))


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


BOS, EOS = 1, 2
#: token ids the tiny engine's vocabulary holds only part of a character of (decode to U+FFFD)
PARTIAL_CHARACTER_TOKENS = frozenset(range(90, 100))


class TinyEngine:
    """A deterministic language model small enough to reason about in tests: the next token is
    a function of the whole context, so a decode that continued from the wrong context answers
    other tokens. Prompts containing ``EOS`` end at once (their first token is EOS)."""

    @staticmethod
    def tokenize(text: str) -> list[int]:
        return [BOS, *(10 + ord(c) % 80 for c in text)]

    @staticmethod
    def render(messages: list[dict[str, Any]]) -> str:
        return "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages) + "<|assistant|>"

    @staticmethod
    def text(token: int) -> str:
        if token == EOS:
            return ""
        return "\ufffd" if token in PARTIAL_CHARACTER_TOKENS else f"w{token} "

    @staticmethod
    def next_token(context: Sequence[int], eos: bool) -> int:
        if eos and len(context) and context[-1] != EOS:
            return EOS
        return 3 + (sum(context) * 31 + len(context) * 7) % 120

    @staticmethod
    def logprob(token: int) -> float:
        return -round(0.01 * (token % 50) + 0.001, 6)

    def generate(self, prompt: list[int], max_tokens: int, eos: bool) -> tuple[list[int], str]:
        """The generated tokens and the finish reason."""
        out: list[int] = []
        while len(out) < max_tokens:
            token = self.next_token([*prompt, *out], eos)
            out.append(token)
            if token == EOS:
                return out, "stop"
        return out, "length"


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
        #: While clear, generation requests are received but not answered.
        self.answer_gate = threading.Event()
        self.answer_gate.set()
        #: Answer as the tiny engine does (:class:`TinyEngine`) instead of canned texts.
        self.generates = False
        #: The engine ignores ``kv_transfer_params["prompt_token_ids"]`` (vLLM before 0.30).
        self.ignores_prompt_token_ids = False
        #: What a prefill says of its vLLM taking them (``remote_chat_prompt_ids``).
        self.says_chat_prompt_ids = True
        #: Whether a prefill says it computed the prompt but its last token (a hybrid model).
        self.says_prompt_prefix = False
        #: The engine ignores ``return_token_ids`` (answers without token ids).
        self.ignores_return_token_ids = False
        #: How a stream ends early: None (it does not), "cut" (the stream ends after its first
        #: chunk, no ``[DONE]``), "error" (an error event follows its first chunk) or "dies"
        #: (the connection closes mid-body after its first chunk, as when the engine is
        #: killed: the client reads an incomplete chunked body); the request is aborted then,
        #: so a prefill holds nothing.
        self.stream_ends_early: str | None = None
        #: The transfers this fake, as the connector's prefill, holds KV under.
        self.held: set[str] = set()
        #: The context length, checked as vLLM checks it (None: unbounded).
        self.max_model_len: int | None = None
        #: The first side-channel port of the connector's prefill this fake answers as.
        self.side_channel_port = 5555
        #: Continuations this instance was asked for that did not continue prefill's hold.
        self.bad_continuations: list[str] = []
        self.engine = TinyEngine()
        #: The engine id this fake answers as the connector's prefill (a restart changes it).
        self.engine_id = f"engine-{self.name}"
        #: As the connector's decode: the prefill engine ids its ``/metrics`` reports unpairable
        #: (``vllm:mooncake_hetero_unpairable_prefill_engines``); None: no ``/metrics`` (404).
        self.unpairable_engines: list[str] | None = []
        #: ``/metrics`` requests received
        self.metrics_scrapes = 0

    def metrics_page(self) -> str:
        """A decode's Prometheus page as vLLM exports it, with the connector's counter."""
        name = "vllm:mooncake_hetero_unpairable_prefill_engines"
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0',
            f"# HELP {name} Decode: prefill engines found unable to pair.",
            f"# TYPE {name} counter",
        ]
        for engine in self.unpairable_engines or []:
            labels = f'engine="0",model_name="tiny",prefill_engine="{engine}"'
            lines += [f"{name}_total{{{labels}}} 1.0", f"{name}_created{{{labels}}} 1.7e9"]
        return "\n".join(lines) + "\n"

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
            "remote_engine_id": self.engine_id,
            "remote_request_id": asked.get("transfer_id", f"{self.name}-request"),
            "remote_host": "127.0.0.1",
            "remote_port": self.side_channel_port,
            "remote_tp_size": 1,
            "remote_block_ids": [3, 1, 4],
            "remote_num_tokens": 70,
            "remote_chat_prompt_ids": self.says_chat_prompt_ids,
        }
        if self.says_prompt_prefix:
            params["remote_prompt_prefix"] = True
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

    # -- the tiny engine ---------------------------------------------------------------------

    def _prompt_ids(self, path: str, body: dict[str, Any]) -> list[int]:
        if path == "/v1/chat/completions":
            reused = (body.get("kv_transfer_params") or {}).get("prompt_token_ids")
            if reused is not None and not self.ignores_prompt_token_ids:
                return list(reused)
            return self.engine.tokenize(self.engine.render(body["messages"]))
        prompt = body["prompt"]
        return list(prompt) if isinstance(prompt, list) else self.engine.tokenize(prompt)

    def _check_continuation(self, prompt: list[int], params: dict[str, Any]) -> None:
        """What the connector's decode checks: its prompt is prefill's, or prefill's followed
        by exactly the tokens prefill sampled."""
        if not params.get("do_remote_prefill"):
            return
        held = params.get("remote_num_tokens")
        tail = prompt[held:] if isinstance(held, int) else None
        if held is None or (tail and tail != params.get("remote_output_token_ids")):
            self.bad_continuations.append(f"prompt of {len(prompt)} tokens vs {params}")

    def _answer_limit(self, prompt: list[int], asked: int, min_tokens: int) -> int:
        """vLLM's checks of a prompt against ``max_model_len`` (0.32's input processor and
        ``get_max_tokens``): a prompt that fills the context is refused, leaving no room for
        one token; the answer's limit is clamped to the room left."""
        if self.max_model_len is None:
            return asked
        if len(prompt) > self.max_model_len:
            raise ValueError(
                f"The decoder prompt (length {len(prompt)}) is longer than the maximum model "
                f"length of {self.max_model_len}."
            )
        if len(prompt) == self.max_model_len:
            raise ValueError(
                f"The decoder prompt (length {len(prompt)}) plus the number of requested output "
                f"tokens (at least 1) is longer than the maximum model length of "
                f"{self.max_model_len}."
            )
        limit = min(asked, self.max_model_len - len(prompt))
        if min_tokens > limit:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={limit}")
        return limit

    def engine_answer(self, path: str, body: dict[str, Any]) -> tuple[dict, list[dict]]:
        """The non-streamed answer and the stream chunks (without ``[DONE]``) for ``body``;
        raises ValueError for what vLLM answers with 400."""
        chat = path == "/v1/chat/completions"
        prompt = self._prompt_ids(path, body)
        params = body.get("kv_transfer_params") or {}
        self._check_continuation(prompt, params)
        asked = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        limit = self._answer_limit(prompt, asked, body.get("min_tokens") or 0)
        eos = "EOS" in json.dumps(body.get("messages") or body.get("prompt")) and not body.get(
            "ignore_eos"
        )
        tokens, finish = self.engine.generate(prompt, limit, eos)
        texts = [self.engine.text(t) for t in tokens]
        ids = flag(body, "return_token_ids") and not self.ignores_return_token_ids
        want_logprobs = body.get("logprobs") not in (None, False, 0)
        base = {"id": f"{self.name}-x", "created": 1, "model": body.get("model", "tiny")}
        usage = {
            "prompt_tokens": len(prompt),
            "total_tokens": len(prompt) + len(tokens),
            "completion_tokens": len(tokens),
        }

        def logprobs(start: int, stop: int) -> Any:
            if not want_logprobs:
                return None
            if chat:
                return {
                    "content": [
                        {
                            "token": texts[i],
                            "logprob": self.engine.logprob(tokens[i]),
                            "bytes": list(texts[i].encode()),
                            "top_logprobs": [],
                        }
                        for i in range(start, stop)
                    ]
                }
            return {
                "text_offset": [len("".join(texts[:i])) for i in range(start, stop)],
                "token_logprobs": [self.engine.logprob(tokens[i]) for i in range(start, stop)],
                "tokens": texts[start:stop],
                "top_logprobs": [
                    {texts[i]: self.engine.logprob(tokens[i])} for i in range(start, stop)
                ],
            }

        def choice(start: int, stop: int, last: bool, first: bool) -> dict[str, Any]:
            text = "".join(texts[start:stop])
            content = {"delta": {"content": text}} if chat else {"text": text}
            entry = {
                "index": 0,
                **content,
                "logprobs": logprobs(start, stop),
                "finish_reason": finish if last else None,
                "stop_reason": None,
                "token_ids": tokens[start:stop] if ids else None,
            }
            if not chat:
                entry["prompt_token_ids"] = prompt if ids and first else None
            return entry

        whole = choice(0, len(tokens), True, True)
        if chat:
            whole["message"] = {"role": "assistant", "content": whole.pop("delta")["content"]}
        answer = {
            **base,
            "object": "chat.completion" if chat else "text_completion",
            "choices": [whole],
            "usage": usage,
            "kv_transfer_params": self._engine_hand_off(body, prompt, tokens, finish),
        }
        if chat:
            answer["prompt_token_ids"] = prompt if ids else None
        chunk_base = {**base, "object": "chat.completion.chunk" if chat else "text_completion"}
        chunks = []
        if chat:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
            chunks.append(
                {**chunk_base, "choices": [role], "prompt_token_ids": prompt if ids else None}
            )
        for i in range(len(tokens)):
            chunks.append(
                {**chunk_base, "choices": [choice(i, i + 1, i == len(tokens) - 1, i == 0)]}
            )
        if flag(body.get("stream_options") or {}, "include_usage"):
            chunks.append({**chunk_base, "choices": [], "usage": usage})
        return answer, chunks

    def _engine_hand_off(
        self, body: dict[str, Any], prompt: list[int], tokens: list[int], finish: str
    ) -> dict[str, Any] | None:
        """The connector's prefill: a hold when asked, unless the answer stopped and the
        request said not to hold then."""
        asked = body.get("kv_transfer_params") or {}
        if not asked.get("do_remote_decode"):
            return None
        if finish == "stop" and asked.get("hold_if_stopped") is False:
            return None
        if flag(body, "stream") and self.stream_ends_early is not None:
            return None  # aborted: the connector holds nothing
        params = {
            **self.connector_params(body),
            "remote_num_tokens": len(prompt),
            "remote_output_token_ids": tokens,
        }
        self.held.add(params["remote_request_id"])
        return params

    async def _engine_stream(self, chunks: list[dict]) -> AsyncIterator[bytes]:
        for index, chunk in enumerate(chunks):
            yield f"data: {json.dumps(chunk)}\n\n".encode()
            if index == 0:
                await asyncio.to_thread(self.stream_gate.wait, 10)
                if self.stream_ends_early == "cut":
                    return
                if self.stream_ends_early == "dies":
                    raise ConnectionAbortedError(f"{self.name} was killed mid-stream")
                if self.stream_ends_early == "error":
                    error = {"message": "the engine failed", "type": "InternalServerError"}
                    yield f"data: {json.dumps({'error': {**error, 'code': 500}})}\n\n".encode()
                    break
        yield b"data: [DONE]\n\n"

    def app(self) -> FastAPI:
        app = FastAPI()

        async def generate(request: Request) -> Response:
            body = await request.json()
            self.received.append(
                ReceivedRequest(request.url.path, body, dict(request.headers.items()))
            )
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            await asyncio.to_thread(self.answer_gate.wait, 10)
            if self.canned_answer is not None:
                status, content, media_type = self.canned_answer
                return Response(content, status_code=status, media_type=media_type)
            if self.generates:
                try:
                    answer, chunks = self.engine_answer(request.url.path, body)
                except ValueError as error:
                    message = {"message": str(error), "type": "BadRequestError", "code": 400}
                    return JSONResponse({"error": message}, status_code=400)
                if flag(body, "stream"):
                    return StreamingResponse(
                        self._engine_stream(chunks), media_type="text/event-stream"
                    )
                return JSONResponse(answer)
            if flag(body, "stream"):
                return StreamingResponse(
                    self._stream(request.url.path), media_type="text/event-stream"
                )
            return JSONResponse(self.completion(request.url.path, body, dict(request.headers)))

        app.add_api_route("/v1/completions", generate, methods=["POST"])
        app.add_api_route("/v1/chat/completions", generate, methods=["POST"])

        @app.post("/detokenize")
        async def detokenize(request: Request) -> JSONResponse:
            body = await request.json()
            self.received.append(ReceivedRequest("/detokenize", body, dict(request.headers)))
            return JSONResponse({"prompt": "".join(self.engine.text(t) for t in body["tokens"])})

        @app.get("/v1/models")
        async def models(request: Request) -> JSONResponse:
            self.received.append(ReceivedRequest("/v1/models", {}, dict(request.headers)))
            card = {"id": "tiny", "owned_by": self.name, "max_model_len": self.max_model_len}
            return JSONResponse({"object": "list", "data": [card]})

        @app.get("/metrics")
        async def metrics() -> Response:
            self.metrics_scrapes += 1
            if self.unpairable_engines is None:
                return Response(status_code=404)
            return Response(self.metrics_page(), media_type="text/plain; version=0.0.4")

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
