"""The legs of a request whose first token comes from prefill (:mod:`.continuation`).

Prefill answers the first token; the client gets it at once (:mod:`.splice` writes it as vLLM's
opening chunks, or as the whole answer when it ends the answer) while decode continues from the
prompt and that token. A stream whose decode leg fails after the first token ends with an error
event; a request whose token is part of a character (:mod:`.token_texts`), or whose prefill
returned no token ids, falls back to decode sampling the first token from the KV prefill holds.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from . import continuation
from .errors import UpstreamUnreachable, error_response
from .legs import Legs
from .payloads import InvalidPrefillResponse
from .splice import DONE, ContinuationMismatch, Splice, error_event
from .token_texts import TokenTexts
from .trace import RequestTrace
from .upstreams import REQUEST_ID_HEADER, UpstreamStreamResponse, passthrough

logger = logging.getLogger(__name__)


async def _iterate(events: list[bytes]) -> AsyncIterator[bytes]:
    for event in events:
        yield event


def _error_message(body: bytes) -> str:
    """The message of an upstream's error answer (vLLM's ``{"error": {"message": ...}}``)."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:1000]


class ContinuedLegs:
    """Runs continued requests over :class:`.legs.Legs`' instances."""

    def __init__(self, legs: Legs, token_texts: TokenTexts) -> None:
        self.legs = legs
        #: which tokens a continued decode prompt may end with
        self.token_texts = token_texts

    async def route(
        self,
        path: str,
        headers: dict[str, str],
        client_body: dict[str, Any],
        request_id: str,
        trace: RequestTrace,
    ) -> Response:
        """Prefill's token to the client at once; then decode continues from it (the module
        docstring of :mod:`.continuation`)."""
        trace.mode = "continued"
        trace.mark("prefill_sent")
        prefill_upstream, prefill_response = await self.legs.fetch_prefill(
            path, headers, continuation.prefill_body(client_body)
        )
        trace.mark("prefill_answered")
        if not prefill_response.is_success:
            return self.legs.prefill_failed(prefill_upstream, prefill_response, request_id)
        try:
            first = continuation.first_token(path, prefill_response.content)
            params = self.legs.prefill_params(prefill_upstream, prefill_response)
        except InvalidPrefillResponse as error:
            return self.legs.invalid_prefill(prefill_upstream, path, error)
        ends_answer = first is not None and first.ends_answer(client_body)
        reason = None
        if first is None:
            reason = "no token ids from prefill"
        elif not ends_answer and not await self.token_texts.whole_characters(
            prefill_upstream.url, client_body.get("model"), first.token_ids[-1]
        ):
            reason = "partial character"  # decode's prompt would end in one (.token_texts)
        if reason is not None:
            # Decode samples the first token again from the KV prefill holds.
            self.legs.metrics.decode_first_tokens.labels(reason).inc()
            trace.mode = "serial"
            return await self.legs.decode_after(
                prefill_upstream, params, path, headers, client_body, request_id, trace
            )
        assert first is not None
        splice = Splice(first, client_body)
        streamed = client_body.get("stream") is True
        if ends_answer:
            trace.mark("first_chunk")
            trace.emit()
            if streamed:
                return StreamingResponse(
                    _iterate(splice.opening_events(ends_answer=True)),
                    media_type="text/event-stream",
                    headers={REQUEST_ID_HEADER: request_id},
                )
            return JSONResponse(splice.prefill_answer(), headers={REQUEST_ID_HEADER: request_id})
        assert params is not None
        trace.transfer_id = params.get("remote_request_id")
        trace.mark("decode_sent")
        decode_leg = asyncio.create_task(
            self.legs.until_answered(
                self.legs.keep_hold(params),
                self.legs.upstreams.open(
                    self.legs.decode,
                    "POST",
                    path,
                    headers,
                    continuation.decode_body(client_body, first),
                ),
            )
        )
        if streamed:
            return self._stream(splice, decode_leg, request_id, trace)
        try:
            decode_upstream, decode_response = await decode_leg
        except BaseException:
            decode_leg.cancel()
            raise
        await self.legs.upstreams.read_all(self.legs.decode, decode_upstream, decode_response)
        trace.mark("decode_answered")
        trace.emit()
        if not decode_response.is_success:
            return passthrough(decode_response, request_id)
        try:
            answer = splice.merge(json.loads(decode_response.content))
        except (ValueError, ContinuationMismatch) as error:
            logger.error("request %s: decode %s: %s", request_id, decode_upstream.url, error)
            return error_response(502, f"decode {decode_upstream.url}: {error}", "BadGatewayError")
        return JSONResponse(answer, headers={REQUEST_ID_HEADER: request_id})

    def _stream(
        self,
        splice: Splice,
        decode_leg: asyncio.Task,
        request_id: str,
        trace: RequestTrace,
    ) -> Response:
        """The client's stream of a continued request: prefill's token, then decode's events
        rewritten by :class:`.splice.DecodeStream`; a decode leg that fails once the stream
        began ends it with an error event."""

        async def events() -> AsyncIterator[bytes]:
            for event in splice.opening_events(ends_answer=False):
                yield event
            trace.mark("first_chunk")
            try:
                upstream, response = await decode_leg
            except (UpstreamUnreachable, httpx.HTTPError) as error:
                logger.error("request %s: decode leg failed: %s", request_id, error)
                yield error_event(f"the decode leg failed after the first token: {error}")
                yield DONE
                return
            trace.mark("decode_answered")
            if not response.is_success:
                body = await response.aread()
                logger.warning(
                    "request %s: decode %s answered %d after the first token was sent",
                    request_id,
                    upstream.url,
                    response.status_code,
                )
                yield error_event(_error_message(body), "DecodeError", response.status_code)
                yield DONE
                return
            stream = splice.decode_stream()
            try:
                async for data in response.aiter_raw():
                    rewritten = stream.feed(data)
                    if rewritten:
                        trace.mark("decode_first_chunk")
                        yield rewritten
            except ContinuationMismatch as error:
                logger.error("request %s: decode %s: %s", request_id, upstream.url, error)
                yield error_event(f"decode {upstream.url}: {error}")
                yield DONE
            except httpx.HTTPError as error:
                logger.error(
                    "request %s: stream from %s broke off: %r", request_id, upstream.url, error
                )
                raise

        async def close() -> None:
            if not decode_leg.done():
                decode_leg.cancel()
            await asyncio.wait([decode_leg])
            if not decode_leg.cancelled() and decode_leg.exception() is None:
                upstream, response = decode_leg.result()
                await response.aclose()
                self.legs.decode.release(upstream)
            trace.emit()

        return UpstreamStreamResponse(
            events(),
            close,
            status_code=200,
            headers={"content-type": "text/event-stream", REQUEST_ID_HEADER: request_id},
        )
