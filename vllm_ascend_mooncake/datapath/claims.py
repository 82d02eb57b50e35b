"""Decode side: every read claim this worker has outstanding, multiplexed on one thread.

A claim of a pull admitted before prefill finished (overlapped legs) may wait for its grant up to
``prefill_wait_s``. A thread per waiting claim would cap how many claims wait at once and queue
the rest (and pulls whose KV is held already) behind them, so one thread here keeps every claim:
one DEALER socket per prefill worker, any number of claims outstanding on it, each exchange
tagged so its reply finds it (:mod:`.side_channel`'s routing envelope). Prefill holds a pending
claim open (long poll) and answers as soon as it registers the request; while the answer is
"pending" and the claim's deadline has not passed, the claim is asked again. An exchange
unanswered within the side channel's timeout (plus the time prefill may hold it) is asked again
under a new tag, a late answer to the old one being ignored, until ``attempts`` went unanswered
(:class:`~.side_channel.PeerSilent`). Whether the claim is still wanted is checked every
:data:`TICK_S`, so a cancelled or shut-down pull gives up within a tick, not at the end of a
long poll.

The caller gets a :class:`~concurrent.futures.Future` of the last answer (granted, refused, or
still pending at the deadline) and decides what it means; callbacks run on this thread, so they
must hand any slow work to a pool.

Every claim of the worker waits on this one thread, so nothing about one claim may end it: a
failure handling one reply or one claim ends that claim only, and idle sockets are closed between
poll rounds, never under a round that may still list them. Should the thread fail all the same,
the exchange closes: every claim outstanding or made later fails at once instead of hanging.

Sockets do not grow with the prefill workers ever claimed from (pods replaced under new
addresses): a socket no claim waits on is closed once unused for :data:`IDLE_SOCKET_S` (a
replaced pod's with it, instead of reconnecting to a dead address for ever), and the least
recently used beyond :data:`MAX_IDLE_SOCKETS` sooner: a share of the process's socket budget
(:func:`~.side_channel.peer_socket_cap`), so a steady stream over many prefill workers keeps one
connection to each instead of reconnecting per claim. Sockets are kept in order of last use, so
finding the idle ones looks at the oldest only.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import zmq

from ..log import get_logger
from .side_channel import (
    BadAddress,
    PeerSilent,
    SideChannelClient,
    SideChannelError,
    check_address,
    connect_dealer,
    peer_socket_cap,
    refusal_checked,
)
from .wire import ClaimRead, ClaimReply, Message

logger = get_logger(__name__)

#: How often waiting claims are checked for cancellation and deadlines.
TICK_S = 0.05
#: Sockets to prefill workers without a claim outstanding kept open (least recently used go);
#: 0: :func:`~.side_channel.peer_socket_cap`, a share of the process's socket budget. A fixed 16
#: made nearly every claim over more than 16 prefill workers open a new connection.
MAX_IDLE_SOCKETS = 0
#: A socket to a prefill worker no claim used for this long is closed (no claim waits on it).
IDLE_SOCKET_S = 30.0


@dataclass(frozen=True)
class ClaimAnswer:
    """A claim's last answer and when the exchange that got it was sent (a lease runs from
    there)."""

    reply: Message
    sent_at: float


@dataclass(eq=False)
class _Claim:
    peer: tuple[str, int]
    message: ClaimRead
    deadline: float
    check: Callable[[], None]  # raises when the claim is no longer wanted
    future: Future[ClaimAnswer]
    poll_s: float  # the wait before asking again after an answer that was not held
    tag: bytes = b""
    sent_at: float = 0.0
    expires_at: float = 0.0  # the outstanding exchange is given up then
    ask_at: float | None = None  # when to ask again (None: an exchange is outstanding)
    unanswered: int = 0
    done: bool = False


class ClaimExchange:
    """Claims to prefill workers, any number outstanding, on one thread."""

    def __init__(
        self,
        client: SideChannelClient,
        attempts: int = 2,
        poll_s: tuple[float, float] = (0.001, 0.01),
        name: str = "vam-claims",
        idle_s: float | None = None,
    ) -> None:
        """``idle_s``: how long an unused socket is kept (None: :data:`IDLE_SOCKET_S`)."""
        self._client = client
        self._idle_s = IDLE_SOCKET_S if idle_s is None else idle_s
        self._max_idle_sockets = peer_socket_cap()
        self._attempts = attempts
        self._first_poll_s, self._longest_poll_s = poll_s
        self._context = client.context
        self._new: queue.SimpleQueue[_Claim] = queue.SimpleQueue()
        self._claims: set[_Claim] = set()
        self._by_tag: dict[bytes, _Claim] = {}
        self._tags = itertools.count()
        self._sockets: OrderedDict[tuple[str, int], zmq.Socket] = OrderedDict()
        self._peer_of: dict[zmq.Socket, tuple[str, int]] = {}
        #: when each socket was last used (``_sockets`` is in that order, oldest first)
        self._used: dict[tuple[str, int], float] = {}
        self._poller = zmq.Poller()
        wake_address = f"inproc://vam-claims-{id(self)}"
        self._wake_in = self._context.socket(zmq.PULL)
        self._wake_in.bind(wake_address)
        self._poller.register(self._wake_in, zmq.POLLIN)
        self._wake_out = self._context.socket(zmq.PUSH)
        self._wake_out.setsockopt(zmq.LINGER, 0)
        self._wake_out.connect(wake_address)
        self._wake_lock = threading.Lock()
        self._closed = False
        self._why_closed = "the decode worker is shutting down"
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        """Claims not answered yet (for tests and metrics)."""
        return len(self._claims)

    def claim(
        self,
        host: str,
        port: int,
        message: ClaimRead,
        deadline: float,
        check: Callable[[], None],
    ) -> Future[ClaimAnswer]:
        """Ask ``host:port`` for ``message``'s lease until it answers other than "pending" or
        ``deadline`` (``time.monotonic``) passes; ``check`` raising ends the claim with its
        exception. The future fails with :class:`SideChannelError` when the peer stays silent
        or refuses the message itself, and at once once the exchange is closed."""
        claim = _Claim((host, port), message, deadline, check, Future(), self._first_poll_s)
        with self._wake_lock:
            if self._closed:
                claim.future.set_exception(SideChannelError(self._why_closed))
                return claim.future
            self._new.put(claim)
            with contextlib.suppress(zmq.Again):  # a full queue: the thread's next tick sees it
                self._wake_out.send(b"", zmq.NOBLOCK)
        return claim.future

    def close(self) -> None:
        """Fail every claim still waiting and stop the thread."""
        with self._wake_lock:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(zmq.Again):
                self._wake_out.send(b"", zmq.NOBLOCK)
            self._wake_out.close()
        self._thread.join(timeout=10)

    # -- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                for sock, _ in self._poller.poll(self._poll_timeout_ms()):
                    if sock is self._wake_in:
                        while self._wake_in.poll(0):
                            self._wake_in.recv()
                    else:
                        self._receive(sock)
                if self._closed:
                    break
                while not self._new.empty():
                    claim = self._new.get()
                    self._guarded(claim, self._start, claim)
                self._tick(time.monotonic())
                # Only between rounds: a socket closed within one could still be in its list.
                self._close_idle_sockets()
        except Exception as exc:  # a bug: claims must fail fast from now on, never hang
            logger.exception("the claims thread failed; every read claim of this worker fails")
            with self._wake_lock:
                if not self._closed:
                    self._why_closed = f"the decode worker's claims thread failed: {exc!r}"
        finally:
            with self._wake_lock:  # once closed, claim() fails at once instead of queueing
                if not self._closed:
                    self._closed = True
                    self._wake_out.close()
            ending = SideChannelError(self._why_closed)
            while not self._new.empty():
                self._claims.add(self._new.get())
            for claim in list(self._claims):
                try:  # a claim the caller gave up on ends as the caller says
                    claim.check()
                except Exception as exc:
                    self._end(claim, error=exc)
                else:
                    self._end(claim, error=ending)
            for sock in self._sockets.values():
                sock.close()
            self._wake_in.close()

    def _guarded(self, claim: _Claim, step: Callable[..., None], *args) -> None:
        """Run one claim's ``step``: an unexpected failure ends that claim, not the thread
        every other claim of this worker waits on."""
        try:
            step(*args)
        except Exception as exc:
            logger.exception("claim of %s to %s:%d failed", claim.message.request_id, *claim.peer)
            self._end(claim, error=SideChannelError(f"the claim failed: {exc!r}"))

    def _poll_timeout_ms(self) -> int:
        soonest = time.monotonic() + TICK_S
        for claim in self._claims:
            if claim.ask_at is not None and claim.ask_at < soonest:
                soonest = claim.ask_at
        return max(0, int((soonest - time.monotonic()) * 1000) + 1)

    def _start(self, claim: _Claim) -> None:
        self._claims.add(claim)
        self._ask(claim, time.monotonic())

    def _ask(self, claim: _Claim, now: float) -> None:
        try:
            claim.check()
        except Exception as exc:
            self._end(claim, error=exc)
            return
        self._by_tag.pop(claim.tag, None)
        claim.tag = b"%x" % next(self._tags)
        claim.sent_at, claim.ask_at = now, None
        claim.expires_at = now + self._client.timeout_s + claim.message.wait_s
        try:
            self._socket(claim.peer).send_multipart(
                self._client.request_frames(claim.message, claim.tag), zmq.NOBLOCK
            )
        except BadAddress as exc:  # asking again would not help
            self._end(claim, error=exc)
            return
        except zmq.ZMQError as exc:  # out of sockets or a full queue: retried like silence
            logger.warning("claim to %s:%d not sent: %s", *claim.peer, exc)
            claim.expires_at = now
        self._by_tag[claim.tag] = claim

    def _receive(self, sock: zmq.Socket) -> None:
        peer = self._peer_of.get(sock)
        if peer is None:  # closed since the poll (never expected: closing waits for the round)
            return
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            claim = self._by_tag.get(frames[0]) if frames else None
            if claim is None or claim.peer != peer:
                continue  # the answer to an exchange given up on: its claim asked again
            self._guarded(claim, self._answered, claim, frames[1:])

    def _answered(self, claim: _Claim, frames: list[bytes]) -> None:
        """The reply to ``claim``'s outstanding exchange: end it, or ask again while pending."""
        host, port = claim.peer
        try:
            reply = refusal_checked(
                self._client.read_reply(frames, host, port), claim.message, host, port
            )
        except SideChannelError as exc:
            self._end(claim, error=exc)
            return
        now = time.monotonic()
        pending = isinstance(reply, ClaimReply) and reply.status == "pending"
        if not pending or now > claim.deadline:
            self._end(claim, answer=ClaimAnswer(reply, claim.sent_at))
            return
        self._by_tag.pop(claim.tag, None)
        claim.unanswered = 0
        if now - claim.sent_at < claim.poll_s:  # answered at once, not held: do not hammer
            claim.ask_at = now + claim.poll_s
            claim.poll_s = min(claim.poll_s * 1.5, self._longest_poll_s)
        else:
            claim.ask_at = now

    def _tick(self, now: float) -> None:
        for claim in list(self._claims):
            self._guarded(claim, self._tick_one, claim, now)

    def _tick_one(self, claim: _Claim, now: float) -> None:
        if claim.ask_at is not None:
            if now >= claim.ask_at:
                self._ask(claim, now)
            return
        try:
            claim.check()
        except Exception as exc:
            self._end(claim, error=exc)
            return
        if now < claim.expires_at:
            return
        claim.unanswered += 1
        if claim.unanswered >= self._attempts:
            self._end(
                claim,
                error=PeerSilent(
                    f"no answer from {claim.peer[0]}:{claim.peer[1]} to {claim.unanswered} "
                    f"read claim(s) of {claim.message.request_id} within "
                    f"{self._client.timeout_s:.0f} s each"
                ),
            )
        else:
            logger.warning(
                "claim of %s: no answer from %s:%d; asking again",
                claim.message.request_id,
                *claim.peer,
            )
            self._ask(claim, now)

    def _end(
        self,
        claim: _Claim,
        answer: ClaimAnswer | None = None,
        error: BaseException | None = None,
    ) -> None:
        if claim.done:
            return
        claim.done = True
        self._claims.discard(claim)
        self._by_tag.pop(claim.tag, None)
        if answer is not None:
            claim.future.set_result(answer)
        else:
            claim.future.set_exception(error or SideChannelError("claim ended without answer"))

    def _socket(self, peer: tuple[str, int]) -> zmq.Socket:
        sock = self._sockets.get(peer)
        if sock is not None:
            self._sockets.move_to_end(peer)
            self._used[peer] = time.monotonic()
            return sock
        check_address(*peer)
        sock = self._context.socket(zmq.DEALER)
        try:
            connect_dealer(sock, *peer)
        except zmq.ZMQError:  # closed, or every such claim would leak a socket
            sock.close()
            raise
        self._sockets[peer] = sock
        self._used[peer] = time.monotonic()
        self._peer_of[sock] = peer
        self._poller.register(sock, zmq.POLLIN)
        return sock

    def _close_idle_sockets(self) -> None:
        """Close the sockets no claim waits on that were unused for ``idle_s``, and the least
        recently used beyond :data:`MAX_IDLE_SOCKETS`: prefill workers come and go (rollouts),
        the ZMQ context's sockets do not. Run between poll rounds only: a socket closed within
        one may still be in its ready list."""
        if not self._sockets:
            return
        stale_before = time.monotonic() - self._idle_s
        oldest = next(iter(self._sockets))
        cap = MAX_IDLE_SOCKETS or self._max_idle_sockets
        if len(self._sockets) <= cap and self._used[oldest] >= stale_before:
            return
        busy = {claim.peer for claim in self._claims}
        for peer in list(self._sockets):
            if len(self._sockets) <= cap and self._used[peer] >= stale_before:
                return  # every later one was used more recently
            if peer not in busy:
                sock = self._sockets.pop(peer)
                del self._used[peer]
                self._poller.unregister(sock)
                del self._peer_of[sock]
                sock.close()
