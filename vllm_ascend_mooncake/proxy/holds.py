"""Keep prefill's hold on a request's KV while its decode request may still be queued.

Prefill frees the blocks of a transfer that no decode worker claimed within its
``release_timeout_s``. A decode request that waits in decode's vLLM queue (``--max-num-seqs``
reached) has not claimed yet, and vLLM's scheduler tells the connector nothing about waiting
requests (it looks at one only when it can run it), so under overload the claim comes after the
release: a failed pull (HTTP 500) or a recompute. The proxy knows the transfer is still wanted:
from prefill's answer until prefill says the transfer was read (or released), it sends every
prefill worker holding it a ``KeepHold`` once a third of the hold's lease is spent. Prefill
bounds every hold (``MAX_HOLD_TIMEOUTS`` release timeouts in all), so a decode that vanished, or
a proxy that renews for ever, still frees prefill's memory.

Renewals go over the connector's side channel (ZMQ, signed with ``VAM_SIDE_CHANNEL_SECRET`` when
it is set) on the proxy's event loop: one socket per prefill worker (:class:`_PeerChannel`),
exchanges tagged so each reply finds its renewal, at most :data:`MAX_EXCHANGES_PER_PEER` in
flight per worker. No thread or queue is shared between workers, so a dead or frozen prefill
delays no other prefill's renewals (they used to share four threads, each held up to 2 s by a
silent worker, and healthy holds expired behind them). A renewal is not given up because one
reply was late: each exchange may take a share of what is left of the lease, and a silent worker
is asked again until the lease is over.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from ..datapath.side_channel import (
    MAX_MESSAGE_BYTES,
    PeerRefused,
    PeerSilent,
    SideChannelClient,
    SideChannelError,
    refusal_checked,
    zmq_address,
)
from ..datapath.wire import Message
from ..handoff import SECRET_ENV, ClaimReply, DropHold, KeepHold, prefill_address

logger = logging.getLogger(__name__)

#: How long a renewal waits for its first answer while the hold's lease is unknown (prefill
#: has not answered yet), and how many such tries a worker gets before it is left alone.
RENEW_TIMEOUT_S = 2.0
UNKNOWN_LEASE_TRIES = 3
#: Once the lease is known, each try may take this share of what is left of it (so a late
#: reply still leaves time to ask again), but never less than MIN_TRY_S.
TRIES_PER_LEASE = 3
MIN_TRY_S = 0.2
#: Pause before asking again a worker that does not hold the transfer yet (it registers a hold
#: one engine step after answering), and how many times it is asked so.
PENDING_PAUSE_S = 0.5
MAX_PENDING_ANSWERS = 20
#: A hold is renewed once this share of its lease is spent (the rest leaves time for late
#: replies and tries again), at most every MIN_RENEW_PAUSE_S.
RENEW_AFTER = 1 / 3
MIN_RENEW_PAUSE_S = 0.5
#: Exchanges in flight to one prefill worker at most; more wait their turn (within their own
#: timeout), so a dead worker's renewals cannot pile up without bound.
MAX_EXCHANGES_PER_PEER = 64

Peer = tuple[str, int]


class _PeerChannel:
    """One prefill worker's side channel on the event loop: tagged exchanges, each with its own
    timeout, at most :data:`MAX_EXCHANGES_PER_PEER` at a time."""

    def __init__(self, context: zmq.asyncio.Context, signer: SideChannelClient, peer: Peer) -> None:
        self.peer = peer
        self._signer = signer
        self._socket = context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._socket.setsockopt(zmq.IMMEDIATE, 1)  # nothing queued for a worker not connected
        if ":" in peer[0]:
            self._socket.setsockopt(zmq.IPV6, 1)
        self._socket.connect(zmq_address(*peer))
        self._bound = asyncio.Semaphore(MAX_EXCHANGES_PER_PEER)
        self._tags = itertools.count()
        self._waiting: dict[bytes, asyncio.Future[list[bytes]]] = {}
        self._reader = asyncio.create_task(self._read())
        #: renewals using this channel; it closes when the last one ends
        self.users = 0

    async def exchange(self, message: Message, timeout_s: float) -> Message:
        """``message``'s reply within ``timeout_s`` (waiting for a turn included); raises
        :class:`SideChannelError` (:class:`PeerSilent` when no reply came in time)."""
        host, port = self.peer
        tag = b"%x" % next(self._tags)
        try:
            async with asyncio.timeout(timeout_s), self._bound:
                answered = asyncio.get_running_loop().create_future()
                self._waiting[tag] = answered
                await self._socket.send_multipart(self._signer.request_frames(message, tag))
                frames = await answered
        except TimeoutError as exc:
            raise PeerSilent(f"no reply from {host}:{port} within {timeout_s:.2f} s") from exc
        except zmq.ZMQError as exc:
            raise SideChannelError(f"side channel to {host}:{port} failed: {exc}") from exc
        finally:
            self._waiting.pop(tag, None)
        return refusal_checked(self._signer.read_reply(frames, host, port), message, host, port)

    async def _read(self) -> None:
        """Hand each reply to the exchange its tag names; a late one (given up on) is dropped."""
        while True:
            try:
                frames = await self._socket.recv_multipart()
            except zmq.ZMQError as exc:
                logger.info("side channel to %s:%d: %s", *self.peer, exc)
                return
            answered = self._waiting.get(frames[0]) if frames else None
            if answered is not None and not answered.done():
                answered.set_result(frames[1:])

    async def close(self) -> None:
        self._reader.cancel()
        await asyncio.wait([self._reader])
        self._socket.close(linger=0)


def _transfer(kv_transfer_params: dict[str, Any] | None) -> tuple[str, list[Peer]] | None:
    """The transfer a prefill's answer names and the workers holding it; None if none."""
    address = prefill_address(kv_transfer_params)
    transfer_id = (kv_transfer_params or {}).get("remote_request_id")
    if address is None or not isinstance(transfer_id, str):
        return None
    workers = [
        (address["remote_host"], address["remote_port"] + rank)
        for rank in range(address["remote_tp_size"])
    ]
    return transfer_id, workers


class HoldKeeper:
    """Renews prefill holds for the transfers handed to decode and not read yet."""

    def __init__(
        self,
        timeout_s: float = RENEW_TIMEOUT_S,
        on_renewal: Callable[[], None] | None = None,
    ) -> None:
        """``timeout_s``: how long a try waits while the lease is unknown."""
        self._timeout_s = timeout_s
        self._on_renewal = on_renewal
        secret = os.environ.get(SECRET_ENV, "")
        #: signs requests and checks replies; its own blocking exchanges are never used
        self._signer = SideChannelClient(timeout_s, secret=secret.encode() if secret else None)
        self._context = zmq.asyncio.Context(zmq.Context.instance())
        self._channels: dict[Peer, _PeerChannel] = {}
        self._tasks: set[asyncio.Task] = set()
        #: each renewal task's transfer and workers, to free the hold if its request is abandoned
        self._kept: dict[asyncio.Task, tuple[str, list[Peer]]] = {}
        #: renewals prefill answered "held" (for the metrics and the tests)
        self.renewals = 0
        #: holds prefill was asked to free because their request was abandoned, and answered
        self.drops = 0

    def keep(self, kv_transfer_params: dict[str, Any] | None) -> asyncio.Task | None:
        """Start renewing the transfer ``kv_transfer_params`` (a prefill's answer) names, on
        every worker of its prefill; the task, which the caller cancels once the request has
        ended (None: the params name no transfer)."""
        named = _transfer(kv_transfer_params)
        if named is None:
            return None
        transfer_id, workers = named
        task = asyncio.create_task(self._keep_all(transfer_id, workers))
        self._track(task)
        self._kept[task] = (transfer_id, workers)
        task.add_done_callback(lambda done: self._kept.pop(done, None))
        return task

    def drop(self, kv_transfer_params: dict[str, Any] | None) -> None:
        """Ask every worker holding the transfer ``kv_transfer_params`` name to free it now if
        no decode rank leased it (nobody will read it); nothing when they name none."""
        named = _transfer(kv_transfer_params)
        if named is not None:
            self._track(asyncio.create_task(self._drop_all(*named)))

    def abandon(self, task: asyncio.Task) -> None:
        """The request of a :meth:`keep` task ended before decode read its transfer (the
        client left, or decode failed): stop renewing and ask every worker to free the hold
        now if no decode rank leased it, instead of holding it out ``release_timeout_s``."""
        kept = self._kept.pop(task, None)
        ended_by_itself = task.done() and not task.cancelled()  # read or released already
        task.cancel()
        if kept is None or ended_by_itself:
            return
        self._track(asyncio.create_task(self._drop_all(*kept)))

    def _track(self, task: asyncio.Task) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drop_all(self, transfer_id: str, workers: list[Peer]) -> None:
        await asyncio.gather(*(self._drop_one(transfer_id, worker) for worker in workers))

    async def _drop_one(self, transfer_id: str, peer: Peer) -> None:
        channel = self._open(peer)
        try:
            reply = await channel.exchange(DropHold(transfer_id), self._timeout_s)
        except SideChannelError as exc:
            logger.info("transfer %s on %s:%d not freed: %s", transfer_id, *peer, exc)
            return
        finally:
            await self._done_with(channel)
        self.drops += 1
        logger.debug("transfer %s on %s:%d: the client left; %s", transfer_id, *peer, reply)

    async def _keep_all(self, transfer_id: str, workers: list[Peer]) -> None:
        await asyncio.gather(*(self._keep_one(transfer_id, worker) for worker in workers))

    def _open(self, peer: Peer) -> _PeerChannel:
        channel = self._channels.get(peer)
        if channel is None:
            channel = self._channels[peer] = _PeerChannel(self._context, self._signer, peer)
        channel.users += 1
        return channel

    async def _done_with(self, channel: _PeerChannel) -> None:
        channel.users -= 1
        if channel.users == 0 and self._channels.get(channel.peer) is channel:
            del self._channels[channel.peer]
            await channel.close()

    async def _keep_one(self, transfer_id: str, peer: Peer) -> None:
        channel = self._open(peer)
        try:
            # A decode that is not queued has read the transfer by then: one "refused" ends it.
            await asyncio.sleep(MIN_RENEW_PAUSE_S)
            await self._renew(channel, transfer_id)
        finally:
            await self._done_with(channel)

    async def _renew(self, channel: _PeerChannel, transfer_id: str) -> None:
        loop = asyncio.get_running_loop()
        pending = 0
        #: when the hold ends as far as the proxy knows (None: not known yet), and when to stop
        #: asking a worker that does not answer
        lease_ends: float | None = None
        give_up_at = loop.time() + UNKNOWN_LEASE_TRIES * self._timeout_s
        while True:
            sent = loop.time()
            timeout_s = self._try_timeout(sent, lease_ends, give_up_at)
            try:
                reply = await channel.exchange(KeepHold(transfer_id), timeout_s)
            except SideChannelError as exc:
                if isinstance(exc, PeerRefused) or loop.time() >= give_up_at:
                    logger.info(
                        "not renewing transfer %s on %s:%d: %s", transfer_id, *channel.peer, exc
                    )
                    return
                logger.debug(
                    "renewal of %s on %s:%d: %s; asking again", transfer_id, *channel.peer, exc
                )
                continue
            if not isinstance(reply, ClaimReply) or reply.status == "refused":
                return  # read, released, or held as long as any transfer is
            if reply.status == "held":
                self.renewals += 1
                if self._on_renewal is not None:
                    self._on_renewal()
                lease_ends = give_up_at = sent + reply.lease_s
                pause = max(MIN_RENEW_PAUSE_S, reply.lease_s * RENEW_AFTER)
            else:
                pending += 1
                if pending > MAX_PENDING_ANSWERS:
                    return
                pause = PENDING_PAUSE_S
                if lease_ends is None:  # a worker that answers is not a silent one
                    give_up_at = loop.time() + pause + UNKNOWN_LEASE_TRIES * self._timeout_s
            await asyncio.sleep(pause)

    def _try_timeout(self, now: float, lease_ends: float | None, give_up_at: float) -> float:
        """How long one try waits: ``timeout_s`` while the lease is unknown; then a share of
        what is left of it, the last try all of it (a slow worker still answers in time)."""
        if lease_ends is None:
            return self._timeout_s
        left = give_up_at - now
        share = max(MIN_TRY_S, left / TRIES_PER_LEASE)
        return share if left - share >= MIN_TRY_S else max(MIN_TRY_S, left)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks))
        for channel in list(self._channels.values()):
            await channel.close()
        self._channels.clear()
        self._signer.close()
