"""The continued route (the default): the answer's first token is the one prefill samples.

Prefill answers the first token; the client gets it at once (:mod:`.formats.splice` writes it as
vLLM's opening chunks, or as the whole answer when it ends the answer) while decode continues
from the prompt and that token. Which requests may take this route is :mod:`.continuable`'s
call. The steps, in order:

1. the prefill leg (:meth:`ContinuedRoute._prefill`): streamed under a transfer id of the
   proxy's where the engine's address is known, so the token reaches the proxy as soon as it is
   sampled (:meth:`ContinuedRoute._streamed_prefill`), else read whole;
2. whether decode can continue from the token after all (:meth:`ContinuedRoute._fallback`): a
   token that is part of a character (:mod:`.formats.token_texts`), a prefill that returned no
   token ids or a chat decode that cannot take prompt ids fall back to decode sampling the first
   token from the KV prefill holds (:meth:`.serial_route.SerialRoute.decode_after`), or
   computing the prompt itself where prefill holds none;
3. prefill's token as the whole answer (:meth:`ContinuedRoute._answer_from_prefill`) when it ends
   the answer or fills the model's context, or
4. the decode leg continuing it (:meth:`ContinuedRoute._continue_on_decode`), streamed
   (:meth:`ContinuedRoute._stream`: a decode leg that fails after the first token ends the
   stream with an error event) or joined into one answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..handoff import PROMPT_PREFIX_KEY, awaited_prefill_params, new_transfer_id
from .balancer import Upstream
from .bodies import continued_decode_body, continued_prefill_body
from .client_request import ClientRequest
from .continuable import count_decode_first_token
from .errors import NO_ANSWER_FAILURES, UpstreamUnreachable, describe_error, error_response
from .flags import is_true
from .formats.prefill_answer import (
    FirstToken,
    InvalidPrefillResponse,
    append_chunks,
    chunks_until_token,
    finish_reason,
    first_token,
    first_token_from_stream,
    kv_transfer_params_from_prefill,
)
from .formats.splice import DONE, ContinuationMismatch, Splice, error_event
from .formats.token_texts import TokenTexts, text_shows_whole
from .metrics import ProxyMetrics
from .model_limits import ModelLimits
from .pool import InstancePool
from .prefill_ranks import RankChoice
from .serial_route import SerialRoute
from .upstreams import REQUEST_ID_HEADER, UpstreamStreamResponse, passthrough

logger = logging.getLogger(__name__)

#: What the prefill leg gave: its instance, its token (None: it gave none) and the params a
#: decode leg reads the KV with (None: prefill holds none).
PrefillGave = tuple[Upstream, FirstToken | None, dict[str, Any] | None]


#: Why decode samples the first token of a hybrid model's answer: prefill computed the prompt
#: but its last token (``handoff.PROMPT_PREFIX_KEY``).
PROMPT_PREFIX = "prompt prefix"


def _prompt_prefix_params(
    params: dict[str, Any] | None, first: FirstToken | None
) -> dict[str, Any] | None:
    """The params decode reads a prompt prefix with: prefill's own say so already; those the
    proxy made of a streamed token (``formats.prefill_answer``) are corrected to the tokens
    prefill computed, all but the prompt's last."""
    if params is None or params.get(PROMPT_PREFIX_KEY) is True or first is None:
        return params
    corrected = {k: v for k, v in params.items() if k != "remote_output_token_ids"}
    corrected["remote_num_tokens"] = len(first.prompt_token_ids) - 1
    corrected[PROMPT_PREFIX_KEY] = True
    return corrected


class ContinuedRoute:
    """Runs continued requests over the pool's instances."""

    def __init__(
        self,
        pool: InstancePool,
        metrics: ProxyMetrics,
        serial: SerialRoute,
        token_texts: TokenTexts,
        model_limits: ModelLimits | None = None,
    ) -> None:
        self.pool = pool
        self.metrics = metrics
        #: the fallback: decode samples the first token from the KV prefill holds
        self.serial = serial
        #: which tokens a continued decode prompt may end with
        self.token_texts = token_texts
        #: the prefill instances' max_model_len (None: never asked)
        self.model_limits = model_limits

    async def run(self, request: ClientRequest) -> Response:
        """Prefill's token to the client at once; then decode continues from it."""
        request.trace.mode = "continued"
        request.trace.mark("prefill_sent")
        prefilled = await self._prefill(request)
        if isinstance(prefilled, Response):
            return prefilled
        prefill_upstream, first, params = prefilled
        try:
            reason, ends_answer = await self._fallback(prefill_upstream, first, params, request)
        except asyncio.CancelledError:  # the client left: nobody will read what prefill holds
            self.pool.drop_hold(params)
            raise
        if reason is not None:
            # Decode samples the first token again from the KV prefill holds.
            count_decode_first_token(self.metrics, reason, request.request_id)
            if reason == PROMPT_PREFIX:
                params = _prompt_prefix_params(params, first)
            request.trace.mode = "serial"
            return await self.serial.decode_after(prefill_upstream, params, request)
        assert first is not None
        splice = Splice(first, request.body)
        if ends_answer:
            return self._answer_from_prefill(splice, params, request)
        assert params is not None
        return await self._continue_on_decode(splice, first, params, request)

    # -- 1. the prefill leg ----------------------------------------------------------------------

    async def _prefill(self, request: ClientRequest) -> PrefillGave | Response:
        """The prefill leg, streamed where it can be, else read whole; a response for the
        client when prefill answered an error or what no decode can use."""
        streamed = await self._streamed_prefill(request)
        if streamed is not None:
            return streamed
        prefill_upstream, prefill_response = await self.pool.fetch_prefill(
            request.path, request.headers, continued_prefill_body(request.body)
        )
        request.trace.mark("prefill_answered")
        if not prefill_response.is_success:
            return self.pool.prefill_failed(prefill_upstream, prefill_response, request.request_id)
        try:
            first = first_token(request.path, prefill_response.content)
            params = kv_transfer_params_from_prefill(prefill_response.content)
        except InvalidPrefillResponse as error:
            return self.pool.invalid_prefill(prefill_upstream, request.path, error)
        if params is not None or first is None or not first.ends_answer(request.body):
            # an answer its token ended holds nothing by design: no news of the address
            self.pool.learn(prefill_upstream, params)
        return prefill_upstream, first, params

    async def _streamed_prefill(self, request: ClientRequest) -> PrefillGave | Response | None:
        """The prefill leg streamed, where the proxy knows where the best prefill engine serves
        its KV (a first answer taught it; data-parallel instances are read whole instead):
        prefill holds the KV under a transfer id of the proxy's, and its token reaches the
        proxy as soon as it is sampled, before prefill builds its whole answer. Returns the
        instance, its token and the params decode reads with; a response for the client when
        prefill failed with an answer; None when the leg must go whole (the engine's address is
        not known, or prefill did not answer at all or broke off before its token)."""
        known = self.pool.known_prefill()
        if known is None or known[1].dp_rank is not None:
            return None
        upstream, choice = known
        assert choice.address is not None
        transfer_id = new_transfer_id(request.request_id)
        body = continued_prefill_body(request.body, transfer_id, stream=True)
        try:
            response = await self.pool.open_prefill(
                upstream, choice, request.path, request.headers, body
            )
        except NO_ANSWER_FAILURES as error:
            self.pool.forget(upstream)
            logger.warning(
                "request %s: prefill %s failed before answering (%s); asking again",
                request.request_id,
                upstream.url,
                error,
            )
            return None
        reader = _PrefillStream(self.pool, upstream, choice, response)
        held_at = None
        if "kv_transfer_params" in body:
            held_at = awaited_prefill_params(choice.address, transfer_id)
        try:
            if not response.is_success:
                await response.aread()
                return self.pool.prefill_failed(upstream, response, request.request_id)
            return await self._read_token(reader, upstream, held_at, request)
        except asyncio.CancelledError:
            # The client hung up while prefill computed or before its token was read: prefill
            # may hold the KV under our transfer id already (its request ended with the token),
            # and nobody will read it. A drop that comes before the hold is remembered there.
            self.pool.drop_hold(held_at)
            raise
        finally:
            # Every way out but the hand-off to drain_later closes the leg, a client that
            # hung up while prefill computed (CancelledError) included.
            await reader.close_unless_draining()

    async def _read_token(
        self,
        reader: _PrefillStream,
        upstream: Upstream,
        held_at: dict[str, Any] | None,
        request: ClientRequest,
    ) -> PrefillGave | Response | None:
        """The streamed prefill leg read up to its token (all of it when the token is the whole
        answer, whose usage comes last; else the rest is drained in the background)."""
        chunks = await self._until_token(reader, upstream, held_at, request)
        if chunks is None or isinstance(chunks, Response):
            return chunks
        request.trace.mark("prefill_answered")
        error = next((chunk["error"] for chunk in chunks if "error" in chunk), None)
        if error is not None:
            self.pool.drop_hold(held_at)
            return self.pool.invalid_prefill(
                upstream, request.path, ValueError(json.dumps(error)[:500])
            )
        first = first_token_from_stream(request.path, chunks, held_at)
        if first is None and held_at is not None and finish_reason(chunks) != "length":
            # No token ids (the stream was read to its end): prefill holds the KV under
            # transfer_id only if its one token was length-capped; the connector holds
            # none of a request aborted (a stream cut short), failed or ended by its token.
            # Decode computes the prompt itself instead of waiting for KV nobody holds.
            logger.warning(
                "request %s: prefill %s's stream ended without its token (finish reason "
                "%r); the decode instance will recompute the prompt",
                request.request_id,
                upstream.url,
                finish_reason(chunks),
            )
            self.pool.drop_hold(held_at)
            return upstream, None, None
        if first is not None and (
            first.ends_answer(request.body) or await self._fills_context(upstream, first, request)
        ):
            chunks += await reader.drain()  # its usage chunk: the whole answer's usage
            first = first_token_from_stream(request.path, chunks, held_at)
        else:
            reader.drain_later()
        return upstream, first, first.kv_transfer_params if first is not None else held_at

    async def _until_token(
        self,
        reader: _PrefillStream,
        upstream: Upstream,
        held_at: dict[str, Any] | None,
        request: ClientRequest,
    ) -> list[dict[str, Any]] | Response | None:
        """The prefill stream's chunks up to its token; None when it broke off before it (the
        client has seen nothing, so another instance is asked, as for a prefill that never
        answered), a response for the client when it is unreadable. Whatever prefill got to
        hold is freed on both, nobody reads it."""
        try:
            return await reader.until_token()
        except NO_ANSWER_FAILURES as error:
            # Prefill died or dropped the connection before its token (a killed engine ends
            # its stream mid-body).
            self.pool.drop_hold(held_at)
            failure = f"POST {request.path}: {describe_error(error)} before its first token"
            self.pool.prefill_broke_off(upstream, failure)
            logger.warning(
                "request %s: prefill %s's stream broke off before its token (%s); asking again",
                request.request_id,
                upstream.url,
                describe_error(error),
            )
            return None
        except (httpx.HTTPError, ValueError) as error:
            self.pool.drop_hold(held_at)
            return self.pool.invalid_prefill(upstream, request.path, error)

    # -- 2. can decode continue from the token? --------------------------------------------------

    async def _fallback(
        self,
        prefill_upstream: Upstream,
        first: FirstToken | None,
        params: dict[str, Any] | None,
        request: ClientRequest,
    ) -> tuple[str | None, bool]:
        """Why decode samples the first token again after all (None: it continues), and
        whether prefill's token is the whole answer."""
        prefix = params is not None and params.get(PROMPT_PREFIX_KEY) is True
        if prefix or self.pool.prompt_prefix(prefill_upstream):
            # a hybrid model's prefill stops one prompt token short: its token answers nothing
            return PROMPT_PREFIX, False
        ends_answer = first is not None and first.ends_answer(request.body)
        if first is None:
            return "no token ids from prefill", ends_answer
        if ends_answer:
            return None, True
        if await self._fills_context(prefill_upstream, first, request):
            if _min_tokens(request.body) > len(first.token_ids):
                # colocated refuses it: min_tokens beyond the room left
                return "max_model_len", False
            return None, True  # the answer is prefill's token (vLLM clamps max_tokens to it)
        if first.chat and not self.pool.chat_prompt_ids(prefill_upstream):
            return "chat on vLLM before 0.30", False  # its decode would render the messages
        if not (
            text_shows_whole(first.text, len(first.token_ids), request.body)
            or await self.token_texts.whole_characters(
                prefill_upstream.url, request.body.get("model"), first.token_ids[-1]
            )
        ):
            return "partial character", False  # decode's prompt would end in one
        return None, False

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

    # -- 3. prefill's token is the answer --------------------------------------------------------

    def _answer_from_prefill(
        self, splice: Splice, params: dict[str, Any] | None, request: ClientRequest
    ) -> Response:
        """Prefill's token as the client's whole answer; a hold kept for a decode leg that will
        not come (a prompt that fills the context) is freed."""
        if params is not None:
            self.pool.drop_hold(params)
        request.trace.mark("first_chunk")
        request.trace.emit()
        headers = {REQUEST_ID_HEADER: request.request_id}
        if is_true(request.body.get("stream")):
            return StreamingResponse(
                _iterate(splice.opening_events(ends_answer=True)),
                media_type="text/event-stream",
                headers=headers,
            )
        return JSONResponse(splice.prefill_answer(), headers=headers)

    # -- 4. decode continues it ------------------------------------------------------------------

    async def _continue_on_decode(
        self, splice: Splice, first: FirstToken, params: dict[str, Any], request: ClientRequest
    ) -> Response:
        """The decode leg from the prompt and prefill's token; its answer joined to the token.
        Prefill's hold is renewed from its answer until decode read the transfer, and freed at
        once if the request ends before that (the client left, decode failed)."""
        request.trace.transfer_id = params.get("remote_request_id")
        keeping = self.pool.keep_hold(params)

        def decode_leg() -> asyncio.Task:
            request.trace.mark("decode_sent")
            return asyncio.create_task(
                self.pool.until_answered(
                    keeping,
                    self.pool.open_decode(
                        request.path, request.headers, continued_decode_body(request.body, first)
                    ),
                )
            )

        if is_true(request.body.get("stream")):
            return self._stream(splice, decode_leg, request, keeping)
        leg = decode_leg()
        try:
            decode_upstream, decode_response = await leg
        except BaseException:
            # A leg cancelled before it ran never reached until_answered: free the hold here.
            self.pool.abandon_hold(keeping)
            await self.pool.abandon(leg)  # a leg that opened as the client left is closed too
            raise
        await self.pool.read_decode(decode_upstream, decode_response)
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

    def _stream(
        self,
        splice: Splice,
        start_decode_leg: Callable[[], asyncio.Task],
        request: ClientRequest,
        keeping: asyncio.Task | None,
    ) -> Response:
        """The client's stream of a continued request: prefill's token, then decode's events
        rewritten by :class:`.formats.splice.DecodeStream`. The decode leg starts once the token
        is on its way (nothing delays it); one that fails once the stream began ends it with an
        error event. A stream that ends before decode's did (the client hung up, before the
        decode leg was sent, while decode queued or while it streamed) frees prefill's hold
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
                self.pool.abandon_hold(keeping)  # once: the keeper forgets an abandoned hold
            for leg in legs:
                if not leg.done():
                    leg.cancel()
                await asyncio.wait([leg])
                if not leg.cancelled() and leg.exception() is None:
                    await self.pool.close_decode(*leg.result())
            trace.emit()

        return UpstreamStreamResponse(
            events(),
            close,
            status_code=200,
            headers={"content-type": "text/event-stream", REQUEST_ID_HEADER: request_id},
        )


class _PrefillStream:
    """A streamed prefill leg's answer: read up to its token, then the rest (a few bytes that
    follow at once) before its instance counts as free again."""

    def __init__(
        self, pool: InstancePool, upstream: Upstream, choice: RankChoice, response: httpx.Response
    ) -> None:
        self._pool = pool
        self._upstream = upstream
        self._choice = choice
        self._response = response
        self._lines = response.aiter_lines()
        self._closed = False
        #: handed to :meth:`drain_later`: the background drain closes it
        self._draining = False

    async def until_token(self) -> list[dict[str, Any]]:
        """The stream's chunks up to the first that carries token ids (or an error)."""
        return await chunks_until_token(self._lines)

    async def drain(self) -> list[dict[str, Any]]:
        """The chunks left, read to the end; the instance is released."""
        chunks: list[dict[str, Any]] = []
        try:
            await append_chunks(self._lines, chunks)
        except httpx.HTTPError as error:
            logger.info("prefill %s: its stream's end broke off: %r", self._upstream.url, error)
        finally:
            await self.close()
        return chunks

    def drain_later(self) -> None:
        """Read the rest in the background (the request goes on); that drain closes the leg."""
        self._draining = True
        task = asyncio.create_task(self.drain())
        _background.add(task)
        task.add_done_callback(_background.discard)

    async def close_unless_draining(self) -> None:
        """Close the leg unless :meth:`drain_later` took it over."""
        if not self._draining:
            await self.close()

    async def close(self) -> None:
        """Close the leg and release its instance, once."""
        if self._closed:
            return
        self._closed = True
        await self._pool.close_prefill(self._upstream, self._choice, self._response)


#: Streams drained after the request went on (a reference keeps each task alive).
_background: set[asyncio.Task] = set()


async def _iterate(events: list[bytes]) -> AsyncIterator[bytes]:
    for event in events:
        yield event


def _error_message(body: bytes) -> str:
    """The message of an upstream's error answer (vLLM's ``{"error": {"message": ...}}``)."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:1000]


def _min_tokens(body: dict[str, Any]) -> int:
    value = body.get("min_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
