"""The prefill and decode instances behind one narrow interface: what every route asks of them.

A route (:mod:`.serial_route`, :mod:`.overlapped_route`, :mod:`.continued_route`) sends a leg,
reads or relays its answer and keeps prefill's hold on the transfer through
:class:`InstancePool` only: which instance, which data-parallel engine (:mod:`.prefill_ranks`),
the failover and the busy counts (:mod:`.upstreams`, :mod:`.balancer`) and the hold renewals
(:mod:`.holds`) stay behind it, so no route reaches into them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response

from ..handoff import TRANSFER_ID_KEY, awaited_prefill_params
from .balancer import Balancer, Upstream
from .client_request import ClientRequest
from .errors import error_response
from .holds import HoldKeeper
from .prefill_ranks import PrefillRanks, RankChoice
from .upstreams import UpstreamClient, passthrough

logger = logging.getLogger(__name__)


class InstancePool:
    """The prefill and decode instances, opened, read and relayed for the routes."""

    def __init__(
        self,
        upstreams: UpstreamClient,
        prefill: Balancer,
        decode: Balancer,
        hold_keeper: HoldKeeper | None = None,
    ) -> None:
        self._upstreams = upstreams
        self._prefill = prefill
        self._decode = decode
        #: where each prefill instance's engines serve their KV, learned from their answers
        self.prefill_ranks = PrefillRanks()
        #: renews prefill's hold while a decode request may be queued (None: renewals off)
        self.hold_keeper = hold_keeper

    # -- which prefill instance ------------------------------------------------------------------

    def only_unpairable_prefills(self) -> bool:
        """Whether every prefill instance left is one no decode can read (:mod:`.pairing`)."""
        return self._prefill.only_unpairable_left()

    def known_prefill(self) -> tuple[Upstream, RankChoice] | None:
        """The best prefill instance and its engine, when the proxy knows where that engine
        serves its KV and the instance is healthy (an ejected best one, which every one is
        then, would likely waste a decode leg sent beside it); None otherwise."""
        upstream = self._prefill.ranked()[0]
        choice = self.prefill_ranks.choose(upstream.url)
        if choice.address is None or not self._prefill.is_healthy(upstream):
            return None
        return upstream, choice

    def learn(self, upstream: Upstream, kv_transfer_params: dict[str, Any] | None) -> None:
        """Remember where the engine that answered these params serves its KV."""
        self.prefill_ranks.learn(upstream.url, kv_transfer_params)

    def forget(self, upstream: Upstream) -> None:
        """The instance failed before answering: what it taught may be stale once it is back."""
        self.prefill_ranks.forget(upstream.url)

    def prompt_prefix(self, upstream: Upstream) -> bool:
        """Whether the instance computes prompts but their last token (a hybrid model)."""
        return self.prefill_ranks.prompt_prefix(upstream.url)

    def chat_prompt_ids(self, upstream: Upstream) -> bool:
        """Whether the instance's vLLM takes chat prompts as forwarded token ids."""
        return self.prefill_ranks.chat_prompt_ids(upstream.url)

    # -- prefill legs ----------------------------------------------------------------------------

    async def prefill_leg(
        self,
        upstream: Upstream,
        choice: RankChoice,
        path: str,
        headers: dict[str, str],
        json_body: dict[str, Any],
        held_as: str | None = None,
    ) -> httpx.Response:
        """One prefill leg on ``upstream``, pinned to ``choice``'s engine, read to the end.
        ``held_as``: the transfer id the body asks prefill to hold the KV under; a client that
        hangs up before the answer is read (prefill may hold it already, and nobody will read
        it) frees that hold where the engine's address is known."""
        try:
            response = await self.open_prefill(upstream, choice, path, headers, json_body)
        except asyncio.CancelledError:
            self._drop_unread(choice, held_as)
            raise
        try:
            return await self._upstreams.read_all(self._prefill, upstream, response)
        except asyncio.CancelledError:
            self._drop_unread(choice, held_as)
            raise
        finally:
            self.prefill_ranks.finished(upstream.url, choice)

    def _drop_unread(self, choice: RankChoice, held_as: str | None) -> None:
        """Free what prefill may hold under ``held_as`` (a drop that comes before the hold is
        remembered there); nothing where the engine's address is not known."""
        if held_as is not None and choice.address is not None:
            self.drop_hold(awaited_prefill_params(choice.address, held_as))

    async def fetch_prefill(
        self,
        path: str,
        headers: dict[str, str],
        json_body: dict[str, Any],
        held_as: str | None = None,
    ) -> tuple[Upstream, httpx.Response]:
        """A prefill leg on the best instance that answers, each pinned to the engine the
        proxy picks there (one whose address it has yet to learn, if any), read to the end.
        ``held_as``: a transfer id the leg asks prefill to hold the KV under where that engine's
        address is known (so :meth:`prefill_leg` can free it); elsewhere it is not named."""

        def leg(upstream: Upstream) -> Awaitable[httpx.Response]:
            choice = self.prefill_ranks.choose(upstream.url)
            asked = json_body.get("kv_transfer_params")
            if held_as is None or choice.address is None or not isinstance(asked, dict):
                return self.prefill_leg(upstream, choice, path, headers, json_body)
            body = {**json_body, "kv_transfer_params": {**asked, TRANSFER_ID_KEY: held_as}}
            return self.prefill_leg(upstream, choice, path, headers, body, held_as)

        return await self._upstreams.first_that_connects(self._prefill, "POST", path, leg)

    async def open_prefill(
        self,
        upstream: Upstream,
        choice: RankChoice,
        path: str,
        headers: dict[str, str],
        json_body: dict[str, Any],
    ) -> httpx.Response:
        """A prefill leg opened on ``upstream``'s ``choice`` engine, its body left unread; the
        instance and engine count it until :meth:`close_prefill`."""
        self.prefill_ranks.started(upstream.url, choice)
        try:
            return await self._upstreams.open_on(
                self._prefill, upstream, "POST", path, choice.headers(headers), json_body
            )
        except BaseException:
            self.prefill_ranks.finished(upstream.url, choice)
            raise

    async def close_prefill(
        self, upstream: Upstream, choice: RankChoice, response: httpx.Response
    ) -> None:
        """Close an opened prefill leg; the release holds even when the close is cancelled (a
        client that left), so the instance is never counted busy for good."""
        try:
            await response.aclose()
        finally:
            self._prefill.release(upstream)
            self.prefill_ranks.finished(upstream.url, choice)

    def prefill_broke_off(self, upstream: Upstream, failure: str) -> None:
        """An opened prefill leg broke off before its answer: it counts towards the instance's
        ejection, and what the instance taught is forgotten."""
        self._upstreams.outcomes.failed(self._prefill, upstream, failure)
        self.forget(upstream)

    @staticmethod
    def prefill_failed(upstream: Upstream, response: httpx.Response, request_id: str) -> Response:
        """A prefill's error answer, passed to the client unchanged."""
        logger.warning(
            "request %s: prefill %s answered %d; passing it to the client",
            request_id,
            upstream.url,
            response.status_code,
        )
        return passthrough(response, request_id)

    @staticmethod
    def invalid_prefill(upstream: Upstream, path: str, error: Exception) -> JSONResponse:
        """A prefill answer no decode leg can use: 502 naming the instance."""
        return error_response(
            502,
            f"prefill instance {upstream.url} answered {path} with a response the proxy cannot "
            f"pass to a decode instance: {error}",
            "BadGatewayError",
        )

    # -- decode legs -----------------------------------------------------------------------------

    async def open_decode(
        self, path: str, headers: dict[str, str], json_body: dict[str, Any]
    ) -> tuple[Upstream, httpx.Response]:
        """A decode leg on the best instance that answers, its body left unread."""
        return await self._upstreams.open(self._decode, "POST", path, headers, json_body)

    async def read_decode(self, upstream: Upstream, response: httpx.Response) -> httpx.Response:
        """An opened decode answer read to the end; its instance released."""
        return await self._upstreams.read_all(self._decode, upstream, response)

    async def close_decode(self, upstream: Upstream, response: httpx.Response) -> None:
        """Close an opened decode answer (vLLM aborts the request) and release its instance."""
        try:
            await response.aclose()
        finally:
            self._decode.release(upstream)

    async def relay_decode(
        self,
        upstream: Upstream,
        response: httpx.Response,
        request: ClientRequest,
        cut_short: Callable[[], None] | None = None,
    ) -> Response:
        """Give an opened decode answer to the client (:meth:`.upstreams.UpstreamClient.relay`)."""
        return await self._upstreams.relay(
            self._decode, upstream, response, request.request_id, request.trace, cut_short
        )

    async def abandon(self, decode_leg: asyncio.Task) -> None:
        """Stop a decode leg nobody will read: closing its connection makes vLLM abort it."""
        decode_leg.cancel()
        await asyncio.wait([decode_leg])
        if decode_leg.cancelled() or decode_leg.exception() is not None:
            return
        await self.close_decode(*decode_leg.result())

    # -- prefill's hold on the transfer ----------------------------------------------------------

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
