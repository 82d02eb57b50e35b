"""The legs of a request whose first token comes from prefill (:mod:`.continuation`).

Prefill answers the first token; the client gets it at once (:mod:`.splice` writes it as vLLM's
opening chunks, or as the whole answer when it ends the answer) while decode continues from the
prompt and that token. A stream whose decode leg fails after the first token ends with an error
event; a request whose token is part of a character (:mod:`.token_texts`), or whose prefill
returned no token ids, falls back to decode sampling the first token from the KV prefill holds,
or computing the prompt itself where prefill holds none (a streamed prefill leg cut short, or
whose token ended the answer).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from . import continuation
from .balancer import Upstream
from .client_request import ClientRequest
from .continuation import FirstToken
from .errors import NO_ANSWER_FAILURES, UpstreamUnreachable, describe_error, error_response
from .flags import is_true
from .legs import Legs
from .model_limits import ModelLimits
from .payloads import (
    InvalidPrefillResponse,
    kv_transfer_params_from_prefill,
    new_transfer_id,
    overlapped_decode_params,
)
from .prefill_ranks import RankChoice
from .splice import DONE, ContinuationMismatch, Splice, error_event
from .token_texts import TokenTexts
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


class _PrefillStream:
    """A streamed prefill leg's answer: read up to its token, then the rest (a few bytes that
    follow at once) before its instance counts as free again."""

    def __init__(
        self, legs: Legs, upstream: Upstream, choice: RankChoice, response: httpx.Response
    ) -> None:
        self._legs = legs
        self._upstream = upstream
        self._choice = choice
        self._response = response
        self._lines = response.aiter_lines()
        self._closed = False

    async def until_token(self) -> list[dict[str, Any]]:
        """The stream's chunks up to the first that carries token ids (or an error)."""
        chunks = []
        async for line in self._lines:
            chunk = _data(line)
            if chunk is None:
                continue
            chunks.append(chunk)
            choices = chunk.get("choices") or []
            if "error" in chunk or (choices and (choices[0] or {}).get("token_ids")):
                break
        return chunks

    async def drain(self) -> list[dict[str, Any]]:
        """The chunks left, read to the end; the instance is released."""
        chunks = []
        try:
            async for line in self._lines:
                chunk = _data(line)
                if chunk is not None:
                    chunks.append(chunk)
        except httpx.HTTPError as error:
            logger.info("prefill %s: its stream's end broke off: %r", self._upstream.url, error)
        finally:
            await self.close()
        return chunks

    def drain_later(self) -> None:
        task = asyncio.create_task(self.drain())
        _background.add(task)
        task.add_done_callback(_background.discard)

    async def close(self) -> None:
        """Close the leg and release its instance, once; the release holds even when the
        close is cancelled (a client that left), so the instance is never counted busy for
        good."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._response.aclose()
        finally:
            self._legs.prefill.release(self._upstream)
            self._legs.prefill_ranks.finished(self._upstream.url, self._choice)


#: Streams drained after the request went on (a reference keeps each task alive).
_background: set[asyncio.Task] = set()


def _finish_reason(chunks: list[dict[str, Any]]) -> Any:
    """The last finish reason a stream's chunks gave (None: none did)."""
    reasons = [
        choice.get("finish_reason")
        for chunk in chunks
        for choice in (chunk.get("choices") or [])[:1]
        if isinstance(choice, dict) and choice.get("finish_reason") is not None
    ]
    return reasons[-1] if reasons else None


def _min_tokens(body: dict[str, Any]) -> int:
    value = body.get("min_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _data(line: str) -> dict[str, Any] | None:
    """An event line's JSON object; None for other lines and ``[DONE]``."""
    if not line.startswith("data:"):
        return None
    payload = line[len("data:") :].strip()
    if not payload or payload == "[DONE]":
        return None
    chunk = json.loads(payload)
    return chunk if isinstance(chunk, dict) else None


class ContinuedLegs:
    """Runs continued requests over :class:`.legs.Legs`' instances."""

    def __init__(
        self, legs: Legs, token_texts: TokenTexts, model_limits: ModelLimits | None = None
    ) -> None:
        self.legs = legs
        #: which tokens a continued decode prompt may end with
        self.token_texts = token_texts
        #: the prefill instances' max_model_len (None: never asked)
        self.model_limits = model_limits

    async def _fills_context(
        self, upstream: Upstream, first: FirstToken, request: ClientRequest
    ) -> bool:
        """Whether decode's prompt (the prompt and prefill's token) would fill the model's
        context (:mod:`.model_limits`): vLLM refuses such a prompt, and colocated the answer
        is that token alone, as vLLM clamps ``max_tokens`` to the room the prompt leaves."""
        if self.model_limits is None:
            return False
        limit = await self.model_limits.max_model_len(upstream.url, request.headers)
        return limit is not None and len(first.prompt_token_ids) + len(first.token_ids) >= limit

    async def route(
        self,
        request: ClientRequest,
    ) -> Response:
        """Prefill's token to the client at once; then decode continues from it (the module
        docstring of :mod:`.continuation`)."""
        request.trace.mode = "continued"
        request.trace.mark("prefill_sent")
        streamed_leg = await self._streamed_prefill(request)
        if isinstance(streamed_leg, Response):
            return streamed_leg
        if streamed_leg is not None:
            prefill_upstream, first, params = streamed_leg
        else:
            prefill_upstream, prefill_response = await self.legs.fetch_prefill(
                request.path, request.headers, continuation.prefill_body(request.body)
            )
            request.trace.mark("prefill_answered")
            if not prefill_response.is_success:
                return self.legs.prefill_failed(
                    prefill_upstream, prefill_response, request.request_id
                )
            try:
                first = continuation.first_token(request.path, prefill_response.content)
                params = kv_transfer_params_from_prefill(prefill_response.content)
            except InvalidPrefillResponse as error:
                return self.legs.invalid_prefill(prefill_upstream, request.path, error)
            if params is not None or first is None or not first.ends_answer(request.body):
                # an answer its token ended holds nothing by design: no news of the address
                self.legs.prefill_ranks.learn(prefill_upstream.url, params)
        ends_answer = first is not None and first.ends_answer(request.body)
        fills_context = (
            first is not None
            and not ends_answer
            and await self._fills_context(prefill_upstream, first, request)
        )
        reason = None
        if first is None:
            reason = "no token ids from prefill"
        elif fills_context and _min_tokens(request.body) > len(first.token_ids):
            reason = "max_model_len"  # colocated refuses it: min_tokens beyond the room left
        elif fills_context:
            ends_answer = True  # the answer is prefill's token (vLLM clamps max_tokens to it)
        elif (
            first.chat
            and not ends_answer
            and not self.legs.prefill_ranks.chat_prompt_ids(prefill_upstream.url)
        ):
            reason = "chat on vLLM before 0.30"  # its decode would render the messages
        elif not ends_answer and not await self.token_texts.whole_characters(
            prefill_upstream.url, request.body.get("model"), first.token_ids[-1]
        ):
            reason = "partial character"  # decode's prompt would end in one (.token_texts)
        if reason is not None:
            # Decode samples the first token again from the KV prefill holds.
            self.legs.decode_samples_first_token(reason, request.request_id)
            request.trace.mode = "serial"
            return await self.legs.decode_after(prefill_upstream, params, request)
        assert first is not None
        splice = Splice(first, request.body)
        streamed = is_true(request.body.get("stream"))
        if ends_answer:
            if params is not None:  # held for a decode leg that will not come (fills_context)
                self.legs.drop_hold(params)
            request.trace.mark("first_chunk")
            request.trace.emit()
            if streamed:
                return StreamingResponse(
                    _iterate(splice.opening_events(ends_answer=True)),
                    media_type="text/event-stream",
                    headers={REQUEST_ID_HEADER: request.request_id},
                )
            return JSONResponse(
                splice.prefill_answer(), headers={REQUEST_ID_HEADER: request.request_id}
            )
        assert params is not None
        request.trace.transfer_id = params.get("remote_request_id")

        # Renewed from prefill's answer until decode read the transfer; freed at once if the
        # request ends before that (the client left, decode failed).
        keeping = self.legs.keep_hold(params)

        def decode_leg() -> asyncio.Task:
            request.trace.mark("decode_sent")
            return asyncio.create_task(
                self.legs.until_answered(
                    keeping,
                    self.legs.upstreams.open(
                        self.legs.decode,
                        "POST",
                        request.path,
                        request.headers,
                        continuation.decode_body(request.body, first),
                    ),
                )
            )

        if streamed:
            return self._stream(splice, decode_leg, request, keeping)
        leg = decode_leg()
        try:
            decode_upstream, decode_response = await leg
        except BaseException:
            # A leg cancelled before it ran never reached until_answered: free the hold here.
            self.legs.abandon_hold(keeping)
            await self.legs.abandon(leg)  # a leg that opened as the client left is closed too
            raise
        await self.legs.upstreams.read_all(self.legs.decode, decode_upstream, decode_response)
        request.trace.mark("decode_answered")
        request.trace.emit()
        if not decode_response.is_success:
            return passthrough(decode_response, request.request_id)
        try:
            answer = splice.merge(json.loads(decode_response.content))
        except (ValueError, ContinuationMismatch) as error:
            logger.error(
                "request %s: decode %s: %s", request.request_id, decode_upstream.url, error
            )
            return error_response(502, f"decode {decode_upstream.url}: {error}", "BadGatewayError")
        return JSONResponse(answer, headers={REQUEST_ID_HEADER: request.request_id})

    async def _streamed_prefill(
        self,
        request: ClientRequest,
    ) -> tuple[Upstream, FirstToken | None, dict[str, Any] | None] | Response | None:
        """The prefill leg streamed, where the proxy knows where the best prefill engine serves
        its KV (a first answer taught it; data-parallel instances are read whole instead):
        prefill holds the KV under a transfer id of the proxy's, and its token reaches the
        proxy as soon as it is sampled, before prefill builds its whole answer. Returns the
        instance, its token and the params decode reads with; a response for the client when
        prefill failed with an answer; None when the leg must go whole (the engine's address is
        not known, or prefill did not answer at all or broke off before its token)."""
        legs = self.legs
        upstream = legs.prefill.ranked()[0]
        choice = legs.prefill_ranks.choose(upstream.url)
        if choice.address is None or choice.dp_rank is not None:
            return None
        if not legs.prefill.is_healthy(upstream):
            return None
        transfer_id = new_transfer_id(request.request_id)
        body = continuation.prefill_body(request.body, transfer_id, stream=True)
        legs.prefill_ranks.started(upstream.url, choice)
        try:
            response = await legs.upstreams.open_on(
                legs.prefill, upstream, "POST", request.path, choice.headers(request.headers), body
            )
        except NO_ANSWER_FAILURES as error:
            legs.prefill_ranks.finished(upstream.url, choice)
            legs.prefill_ranks.forget(upstream.url)
            logger.warning(
                "request %s: prefill %s failed before answering (%s); asking again",
                request.request_id,
                upstream.url,
                error,
            )
            return None
        except BaseException:
            legs.prefill_ranks.finished(upstream.url, choice)
            raise
        reader = _PrefillStream(legs, upstream, choice, response)
        handed_on = False
        try:
            if not response.is_success:
                await response.aread()
                return legs.prefill_failed(upstream, response, request.request_id)
            held = "kv_transfer_params" in body
            held_at = overlapped_decode_params(choice.address, transfer_id) if held else None
            try:
                chunks = await reader.until_token()
            except NO_ANSWER_FAILURES as error:
                # Prefill died or dropped the connection before its token (a killed engine
                # ends its stream mid-body): the client has seen nothing, so another instance
                # is asked, as for a prefill that never answered.
                legs.drop_hold(held_at)
                failure = f"POST {request.path}: {describe_error(error)} before its first token"
                legs.upstreams.outcomes.failed(legs.prefill, upstream, failure)
                legs.prefill_ranks.forget(upstream.url)
                logger.warning(
                    "request %s: prefill %s's stream broke off before its token (%s); asking again",
                    request.request_id,
                    upstream.url,
                    describe_error(error),
                )
                return None
            except (httpx.HTTPError, ValueError) as error:
                legs.drop_hold(held_at)  # whatever prefill got to hold, nobody reads it
                return legs.invalid_prefill(upstream, request.path, error)
            request.trace.mark("prefill_answered")
            error = next((chunk["error"] for chunk in chunks if "error" in chunk), None)
            if error is not None:
                legs.drop_hold(held_at)
                return legs.invalid_prefill(
                    upstream, request.path, ValueError(json.dumps(error)[:500])
                )
            first = continuation.first_token_from_stream(request.path, chunks, held_at)
            if first is None and held_at is not None and _finish_reason(chunks) != "length":
                # No token ids (the stream was read to its end): prefill holds the KV under
                # transfer_id only if its one token was length-capped; the connector holds
                # none of a request aborted (a stream cut short), failed or ended by its token.
                # Decode computes the prompt itself instead of waiting for KV nobody holds.
                logger.warning(
                    "request %s: prefill %s's stream ended without its token (finish reason "
                    "%r); the decode instance will recompute the prompt",
                    request.request_id,
                    upstream.url,
                    _finish_reason(chunks),
                )
                legs.drop_hold(held_at)
                return upstream, None, None
            if first is not None and (
                first.ends_answer(request.body)
                or await self._fills_context(upstream, first, request)
            ):
                chunks += await reader.drain()  # its usage chunk: the whole answer's usage
                first = continuation.first_token_from_stream(request.path, chunks, held_at)
            else:
                reader.drain_later()
                handed_on = True
            return upstream, first, first.kv_transfer_params if first is not None else held_at
        finally:
            # Every way out but the hand-off to drain_later closes the leg, a client that
            # hung up while prefill computed (CancelledError) included.
            if not handed_on:
                await reader.close()

    def _stream(
        self,
        splice: Splice,
        start_decode_leg: Callable[[], asyncio.Task],
        request: ClientRequest,
        keeping: asyncio.Task | None,
    ) -> Response:
        """The client's stream of a continued request: prefill's token, then decode's events
        rewritten by :class:`.splice.DecodeStream`. The decode leg starts once the token is on
        its way (nothing delays it); one that fails once the stream began ends it with an error
        event. A stream that ends before decode's did (the client hung up, before the decode
        leg was sent, while decode queued or while it streamed) frees prefill's hold
        (``keeping``) unless decode leased it."""
        request_id, trace = request.request_id, request.trace
        legs: list[asyncio.Task] = []
        relayed_to_the_end = False

        async def events() -> AsyncIterator[bytes]:
            nonlocal relayed_to_the_end
            yield b"".join(splice.opening_events(ends_answer=False))
            trace.mark("first_chunk")
            legs.append(start_decode_leg())
            try:
                upstream, response = await legs[0]
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
                relayed_to_the_end = True
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
            if not relayed_to_the_end:
                self.legs.abandon_hold(keeping)  # once: the keeper forgets an abandoned hold
            for leg in legs:
                if not leg.done():
                    leg.cancel()
                await asyncio.wait([leg])
                if not leg.cancelled() and leg.exception() is None:
                    upstream, response = leg.result()
                    await response.aclose()
                    self.legs.decode.release(upstream)
            trace.emit()

        return UpstreamStreamResponse(
            events(),
            close,
            status_code=200,
            headers={"content-type": "text/event-stream", REQUEST_ID_HEADER: request_id},
        )
