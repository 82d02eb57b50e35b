"""The ZMQ side channel: a prefill worker's server thread and the decode side's client.

The server (a ROUTER socket on ``host:port``) answers metadata requests and receives read-done
notifications; a malformed or hostile message gets an error reply and never stops the thread. A
handler may hand slow work (a checksum) to the server's small worker pool as :class:`Deferred`:
the reply goes out, from the server thread, when it is done, and nothing else waits for it. A
handler may :class:`Park` a request it cannot answer yet (a read claim for a request prefill is
still computing): the server asks the handler again whenever :meth:`SideChannelServer.wake` is
called, and sends the park's fallback reply at its deadline. The peer thus gets its answer the
moment there is one, without polling. The client uses one DEALER socket per peer and thread,
with a timeout on every exchange; after a timeout the socket is dropped so a late reply cannot be
mistaken for the next answer. A request may carry a tag frame before the empty delimiter (ZMQ's
routing envelope): the reply carries it back, so one socket can have many requests outstanding
and match each reply to its request (:mod:`.claims` multiplexes read claims that way).

The server keeps a connection per decode socket connected to it; ZMQ drops it when the peer
closes it, and a peer that vanished without closing (its host gone, a partition) is found by a
heartbeat: a connection that answers no ZMTP ping within :data:`HEARTBEAT_TIMEOUT_S` is closed,
so a decode fleet whose pods are replaced leaves no half-open connection (and its descriptor) on
prefill. The client's sockets do not grow with the peers ever asked (pods replaced under new
addresses): a thread's socket to a peer it has not asked for :data:`IDLE_PEER_SOCKET_S` is
closed at that thread's next exchange, at most ``max_peer_sockets`` are kept per thread (least
recently used go first), a metadata fetch (once per peer) keeps none, and the
sockets of threads that ended without closing theirs are closed by the next thread that opens
one (every :data:`REAP_EVERY` sockets opened). Each check looks at the oldest sockets only, so an
exchange costs O(1) whatever the number of peers.

Socket bounds. Every side-channel socket of the process comes from :func:`zmq_context`, whose
``MAX_SOCKETS`` is half the process's soft ``RLIMIT_NOFILE`` (a connected socket holds two
descriptors), never below ZMQ's default 1,023 nor above 65,535: with ZMQ's default a decode worker
pulling from ~1,000 prefill workers ran out (a claims socket and a notice socket per recently
used peer). Each per-peer cache (a client thread's, the claims exchange's) keeps at most a
:data:`PEER_CACHE_SHARE`-th of that (:func:`peer_socket_cap`; 2,500 under a 20,000 descriptor
limit), so a cache is bounded by the descriptor budget while its idle window, not its size, is
what closes sockets under a steady stream over many peers: a 16-entry LRU made every pull over
more than 16 peers reconnect (0.83 new connections per pull at 128 peers, each left in TIME_WAIT
for 60 s). vLLM raises the soft descriptor limit at start-up; under a low one (1,024) the cap
stays at 1,023 and the descriptor limit is the bound.

With a shared secret (``side_channel_secret``, or ``VAM_SIDE_CHANNEL_SECRET`` in the environment of
both instances) every message carries an HMAC-SHA256 of its bytes as an extra frame, requests and
replies keyed apart: a server refuses a request without a valid one (and logs it), a client
refuses such a reply. It authenticates; it does not encrypt, and a captured message replayed on
the network only repeats what its sender asked.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import zmq

from ..log import get_logger
from .wire import (
    MAX_MESSAGE_BYTES,
    ErrorReply,
    GetMetadata,
    Message,
    WireError,
    bounded_text,
    decode,
    encode,
)

logger = get_logger(__name__)


class SideChannelError(RuntimeError):
    """A side-channel exchange with a peer failed or timed out."""


class PeerRefused(SideChannelError):
    """The peer answered, with an error: asking again will not help."""


class PeerSilent(SideChannelError):
    """No reply within the timeout: the peer is frozen, overloaded, gone or unreachable."""


class BadAddress(SideChannelError):
    """The peer's address is not one to connect to at all: asking again will not help."""


class ClientClosed(SideChannelError):
    """This side's client was closed (the worker shuts down): asking again will not help."""


class FrameSigner:
    """HMAC-SHA256 of each side-channel message under a secret both sides share."""

    _REQUEST, _REPLY = b"vam-request\0", b"vam-reply\0"

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def sign_request(self, payload: bytes) -> bytes:
        return self._mac(self._REQUEST, payload)

    def sign_reply(self, payload: bytes) -> bytes:
        return self._mac(self._REPLY, payload)

    def request_is_genuine(self, payload: bytes, mac: bytes | None) -> bool:
        return mac is not None and hmac.compare_digest(mac, self.sign_request(payload))

    def reply_is_genuine(self, payload: bytes, mac: bytes | None) -> bool:
        return mac is not None and hmac.compare_digest(mac, self.sign_reply(payload))

    def _mac(self, direction: bytes, payload: bytes) -> bytes:
        return hmac.new(self._secret, direction + payload, hashlib.sha256).digest()


#: The ZMQ context's socket cap is never set below ZMQ's default (1,023) ...
MIN_MAX_SOCKETS = 1023
#: ... nor above this (libzmq's own limit may be lower still).
MAX_MAX_SOCKETS = 65535
#: Per-peer socket caches (each thread's in the client, the claims exchange's) keep at most this
#: fraction of the context's sockets: the caches, the notifier's lanes and the servers share it.
PEER_CACHE_SHARE = 4

_context: zmq.Context | None = None
_context_lock = threading.Lock()


def _forget_context_in_child() -> None:
    """A forked child makes a context of its own: a ZMQ context (and a lock another thread may
    have held at the fork) does not survive a fork, which is why ``zmq.Context.instance()``
    checks the process id too."""
    global _context, _context_lock
    _context = None
    _context_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_context_in_child)


def socket_budget() -> int:
    """How many sockets the side-channel context may hold: half the process's file-descriptor
    limit (``RLIMIT_NOFILE``, soft), since a connected socket holds two descriptors (its mailbox
    and its TCP connection), at least ZMQ's default 1,023 and at most :data:`MAX_MAX_SOCKETS`."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return MIN_MAX_SOCKETS
    if soft == resource.RLIM_INFINITY:
        soft = 2 * MAX_MAX_SOCKETS
    return max(MIN_MAX_SOCKETS, min(MAX_MAX_SOCKETS, soft // 2))


def zmq_context() -> zmq.Context:
    """The ZMQ context of every side-channel socket of this process (servers, client, claims,
    notices): its own, not ``zmq.Context.instance()``, because ZMQ fixes a context's socket cap
    (``MAX_SOCKETS``, 1,023 by default) when its first socket is made, and another library may
    have made one on the shared instance already. Its cap is :func:`socket_budget`: a decode
    worker pulling from ~1,000 prefill workers keeps a claims socket and a notice socket to each
    of those it used recently, which the default cap ran out of (EMFILE on new sockets)."""
    global _context
    with _context_lock:
        if _context is None or _context.closed:
            context = zmq.Context()
            budget = socket_budget()
            with contextlib.suppress(zmq.ZMQError, AttributeError):
                budget = min(budget, context.get(zmq.SOCKET_LIMIT))
            context.set(zmq.MAX_SOCKETS, budget)
            _context = context
        return _context


def peer_socket_cap() -> int:
    """The most sockets one per-peer cache keeps (see :data:`PEER_CACHE_SHARE`)."""
    return max(16, zmq_context().get(zmq.MAX_SOCKETS) // PEER_CACHE_SHARE)


def zmq_address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


#: A DNS host name: dot-separated labels of letters, digits, ``-`` and ``_`` (container host
#: names have them), each starting with a letter or digit (ZMQ refuses others) and not ending
#: with ``-``, with an optional final dot.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOST_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")


def address_problem(host: str, port: int) -> str | None:
    """What makes ``host:port`` no side-channel address (None: nothing): the host must be an
    IP address or a DNS host name, the port a TCP port. A peer's address arrives in a request's
    ``kv_transfer_params``: checked here, a malformed one (``"10.0.0.1 "``, ``"a b"``) fails
    before any socket exists, instead of in ZMQ's ``connect`` after one was made."""
    if not 0 < port < 65536:
        return f"port {port} is not a TCP port"
    if 0 < len(host) <= 253:
        with contextlib.suppress(ValueError):
            ipaddress.ip_address(host)
            return None
        if _HOST_NAME.fullmatch(host):
            return None
    return f"host {host[:64]!r} is neither an IP address nor a host name"


def check_address(host: str, port: int) -> None:
    """Raise :class:`BadAddress` when :func:`address_problem` finds one."""
    problem = address_problem(host, port)
    if problem is not None:
        raise BadAddress(f"no side channel at {host[:64]!r}:{port}: {problem}")


def connect_dealer(sock: zmq.Socket, host: str, port: int) -> None:
    """Set a new DEALER socket up and connect it to ``host:port``'s side channel. A
    ``zmq.ZMQError`` leaves the socket to the caller to close: it counts against the ZMQ
    context's cap until then."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
    sock.connect(zmq_address(host, port))


@dataclass(frozen=True)
class Park:
    """A handler's "not yet": handle the message again on the next wake, and answer
    ``reply_at_deadline`` if it is still parked at ``deadline`` (``time.monotonic``)."""

    deadline: float
    reply_at_deadline: Message
    #: what it waits for: a wake naming this key (or naming none) handles it again
    key: str = ""


@dataclass(frozen=True)
class Deferred:
    """A handler's "answer this off the server thread": ``work`` runs on the server's small
    worker pool (a checksum over GBs of KV would hold every claim and read-done notice behind it
    on the one server thread), and its reply is sent when it is done, by the server thread, the
    only one that ever touches the server's socket (ZMQ sockets are not thread-safe)."""

    work: Callable[[], Message]


Handler = Callable[[Message], "Message | Park | Deferred"]
#: The frames before a message's empty delimiter: the sender's identity, then an optional tag.
Route = tuple[bytes, ...]
#: The longest tag a request may carry (the reply echoes it).
MAX_TAG_BYTES = 32

#: Parked requests beyond this many are answered with their fallback at once (hostile peers).
MAX_PARKED = 4096
#: Threads that run deferred work (:class:`Deferred`), and the most deferred requests queued or
#: running at once: beyond it a request is refused at once ("busy"), never queued without bound
#: (one checksum per decode rank and pull in flight is the most a well-behaved decode asks).
DEFERRED_WORKERS = 2
MAX_DEFERRED = 64
_POLL_MS = 100
#: How often the server pings each connected peer (ZMTP heartbeats, answered by the peer's ZMQ
#: I/O thread, never by its Python code), and how long a connection that answers nothing is kept.
HEARTBEAT_IVL_S = 10.0
HEARTBEAT_TIMEOUT_S = 30.0
#: The wake a finished deferred request sends (parked requests' keys are ``=key`` or ``*``).
_DONE_WAKE = b"!"


class SideChannelServer:
    """Serves one worker's side channel on a background thread."""

    def __init__(
        self,
        host: str,
        port: int,
        handler: Handler,
        name: str = "vam-side-channel",
        secret: bytes | None = None,
    ):
        self._signer = FrameSigner(secret) if secret else None
        self._unauthenticated = 0
        self._context = zmq_context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # A larger frame makes ZMQ drop that peer's connection before buffering it.
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._socket.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_IVL_S * 1000))
        self._socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEARTBEAT_TIMEOUT_S * 1000))
        if ":" in host:
            self._socket.setsockopt(zmq.IPV6, 1)
        try:
            self._socket.bind(zmq_address(host, port))
        except zmq.ZMQError as exc:
            self._socket.close()
            raise SideChannelError(
                f"cannot bind the KV side channel on {host}:{port} ({exc}); choose another "
                f"side_channel_port in kv_connector_extra_config"
            ) from exc
        self.address = (host, port)
        self._handler = handler
        #: (route: the requester's identity and tag, request, park)
        self._parked: list[tuple[Route, Message, Park]] = []
        wake_address = f"inproc://vam-wake-{id(self)}"
        self._wake_in = self._context.socket(zmq.PULL)
        self._wake_in.bind(wake_address)
        self._wake_out = self._context.socket(zmq.PUSH)
        self._wake_out.setsockopt(zmq.LINGER, 0)
        self._wake_out.connect(wake_address)
        self._wake_lock = threading.Lock()
        self._stop = threading.Event()
        self._workers = ThreadPoolExecutor(DEFERRED_WORKERS, thread_name_prefix=f"{name}-work")
        #: deferred requests queued or running; their replies, ready for the server thread
        self._deferred = 0
        self._done: list[tuple[Route, Message]] = []
        self._done_lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def wake(self, key: str | None = None) -> None:
        """Ask the handler again about the parked requests waiting for ``key`` (all of them
        when None); thread-safe and cheap, so a hold does not re-run every parked claim."""
        self._send_wake(b"*" if key is None else b"=" + key.encode())

    def _send_wake(self, wake: bytes) -> None:
        with self._wake_lock:
            if not self._stop.is_set():
                # A full queue loses this wake: its claims are answered at their park deadline,
                # a deferred reply within one poll interval (the loop sends ready ones each round).
                with contextlib.suppress(zmq.Again):
                    self._wake_out.send(wake, zmq.NOBLOCK)

    def _defer(self, route: Route, deferred: Deferred) -> None:
        """Run ``deferred`` on the worker pool; its reply goes out from the server thread."""
        if self._deferred >= MAX_DEFERRED:
            self._send(route, ErrorReply(f"busy: {MAX_DEFERRED} requests of this kind in hand"))
            return
        self._deferred += 1

        def run() -> None:
            try:
                reply = deferred.work()
            except Exception as exc:  # a bug in the work still answers the request
                logger.exception("side channel deferred work failed")
                reply = ErrorReply(bounded_text(f"internal error: {exc}"))
            with self._done_lock:
                self._done.append((route, reply))
            self._send_wake(_DONE_WAKE)

        try:
            self._workers.submit(run)
        except RuntimeError:  # shutting down
            self._deferred -= 1

    def _send_done(self) -> None:
        """Send the replies of finished deferred requests (server thread only)."""
        with self._done_lock:
            done, self._done = self._done, []
        for route, reply in done:
            self._deferred -= 1
            self._send(route, reply)

    def _answer(self, route: Route, message: Message, parked: Park | None = None) -> None:
        try:
            reply = self._handler(message)
        except Exception as exc:  # a handler bug must not kill the server thread
            logger.exception("side channel handler failed")
            reply = ErrorReply(bounded_text(f"internal error: {exc}"))
        if isinstance(reply, Deferred):
            self._defer(route, reply)
            return
        if isinstance(reply, Park):
            park = parked or reply
            if time.monotonic() < park.deadline and (parked or len(self._parked) < MAX_PARKED):
                self._parked.append((route, message, park))
                return
            reply = park.reply_at_deadline
        self._send(route, reply)

    def _send(self, route: Route, reply: Message) -> None:
        payload = encode(reply)
        frames = [*route, b"", payload]
        if self._signer is not None:
            frames.append(self._signer.sign_reply(payload))
        self._socket.send_multipart(frames)

    def _authentic(self, payload: bytes, mac: bytes | None) -> bool:
        if self._signer is None or self._signer.request_is_genuine(payload, mac):
            return True
        self._unauthenticated += 1
        if self._unauthenticated % 100 == 1:
            logger.warning(
                "side channel %s:%d refused %d unauthenticated message(s): the peer has no "
                "side-channel secret or another one (set the same side_channel_secret, or "
                "VAM_SIDE_CHANNEL_SECRET, on prefill and decode)",
                *self.address,
                self._unauthenticated,
            )
        return False

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        while not self._stop.is_set():
            timeout_ms = _POLL_MS
            if self._parked:
                soonest = min(park.deadline for _, _, park in self._parked)
                timeout_ms = max(0, min(timeout_ms, int((soonest - time.monotonic()) * 1000) + 1))
            events = dict(poller.poll(timeout_ms))
            keys: set[str] | None = set()  # None: every parked request
            if self._wake_in in events:
                while self._wake_in.poll(0):
                    wake = self._wake_in.recv()
                    if wake == _DONE_WAKE:
                        continue
                    if wake == b"*" or keys is None:
                        keys = None
                    else:
                        keys.add(wake[1:].decode())
            if self._done:
                self._send_done()
            if self._parked and (keys is None or keys or timeout_ms < _POLL_MS):
                self._answer_parked(keys)
            if self._socket not in events:
                continue
            try:
                self._receive_one()
            except Exception:  # no message, however crafted, may end the server thread
                logger.exception("side channel %s:%d dropped a message it failed on", *self.address)
        self._socket.close()
        self._wake_in.close()

    def _answer_parked(self, keys: set[str] | None) -> None:
        """Handle again the parked requests waiting for ``keys`` (all: None) and those whose
        deadline passed; the others stay parked untouched."""
        now = time.monotonic()
        parked, self._parked = self._parked, []
        for route, message, park in parked:
            if keys is None or park.key in keys or park.deadline <= now:
                self._answer(route, message, park)
            else:
                self._parked.append((route, message, park))

    def _receive_one(self) -> None:
        frames = self._socket.recv_multipart()
        request = _split_request(frames)
        if request is None:
            logger.warning("side channel dropped a message with %d frame(s)", len(frames))
            return
        route, payload, mac = request
        if not self._authentic(payload, mac):
            self._send(route, ErrorReply("unauthenticated: no or a wrong side-channel MAC"))
            return
        try:
            message = decode(payload)
        except WireError as exc:
            logger.warning("side channel rejected a message: %s", exc)
            self._send(route, ErrorReply(bounded_text(str(exc))))
            return
        self._answer(route, message)

    def close(self) -> None:
        with self._wake_lock:
            self._stop.set()
            self._wake_out.close()
        self._thread.join(timeout=5)
        # Deferred work still running finishes on its own; its reply is dropped (no socket).
        self._workers.shutdown(wait=False, cancel_futures=True)


def _split_request(frames: list[bytes]) -> tuple[Route, bytes, bytes | None] | None:
    """``[identity, (tag,) b"", payload, (mac)]`` as (route, payload, mac); None if malformed."""
    for route_len in (1, 2):
        if len(frames) > route_len and frames[route_len] == b"":
            body = frames[route_len + 1 :]
            tag_too_long = route_len == 2 and len(frames[1]) > MAX_TAG_BYTES
            if len(body) not in (1, 2) or tag_too_long:
                return None
            return tuple(frames[:route_len]), body[0], body[1] if len(body) == 2 else None
    return None


#: Sockets one thread keeps open to distinct peers (see :meth:`SideChannelClient._socket`); 0:
#: :func:`peer_socket_cap`, a share of the context's sockets. A fixed 16 made a thread asking
#: more than 16 peers in turn reconnect at nearly every exchange (a fleet simulation's decode
#: worker: 0.83 new TCP connections per pull at 128 prefill peers, each left in TIME_WAIT).
MAX_PEER_SOCKETS_PER_THREAD = 0
#: A thread's socket to a peer it has not asked for this long is closed at its next exchange.
IDLE_PEER_SOCKET_S = 30.0
#: Sockets opened between two looks for sockets of threads that ended.
REAP_EVERY = 64


class SideChannelClient:
    """Request/response exchanges with peers' side channels.

    Each thread has its own socket per peer, so a claim the peer holds open (long poll) never
    delays another thread's exchange with that peer. A ZMQ socket is not thread-safe: only its
    thread closes it while that thread lives (closing it under a thread that polls it aborted a
    process), see :meth:`close`.
    """

    def __init__(
        self,
        timeout_s: float,
        secret: bytes | None = None,
        idle_s: float | None = None,
        max_peer_sockets: int | None = None,
    ) -> None:
        """``idle_s``: how long a thread keeps an unused socket (None:
        :data:`IDLE_PEER_SOCKET_S`); ``max_peer_sockets``: how many one thread keeps at most
        (None: :data:`MAX_PEER_SOCKETS_PER_THREAD`, or :func:`peer_socket_cap` where that is
        0)."""
        self._signer = FrameSigner(secret) if secret else None
        self._idle_s = IDLE_PEER_SOCKET_S if idle_s is None else idle_s
        self._opened = 0  # sockets opened since the last look for ended threads' sockets
        self._context = zmq_context()
        #: sockets one thread keeps to distinct peers at most
        self.max_peer_sockets = max_peer_sockets or MAX_PEER_SOCKETS_PER_THREAD or peer_socket_cap()
        self.timeout_s = timeout_s
        self._timeout_ms = int(timeout_s * 1000)
        self._local = threading.local()
        #: every open socket, with the thread that uses it
        self._all_sockets: dict[zmq.Socket, threading.Thread] = {}
        self._guard = threading.Lock()
        self._closed = False

    def _socket(self, peer: tuple[str, int]) -> zmq.Socket:
        """This thread's socket to ``peer``; the least recently used one is closed past
        ``max_peer_sockets``, so peers that went away (rollouts) cannot exhaust the ZMQ
        context's sockets. Raises :class:`BadAddress` for an address that is
        none (no socket is made) and ``zmq.ZMQError`` when ``connect`` fails (its socket
        closed)."""
        sockets: OrderedDict[tuple[str, int], zmq.Socket] = self._local.__dict__.setdefault(
            "sockets", OrderedDict()
        )
        used: dict[tuple[str, int], float] = self._local.__dict__.setdefault("used", {})
        now = time.monotonic()
        while sockets:  # least recently used first: stop at the first one still in use
            oldest = next(iter(sockets))
            if oldest == peer or used.get(oldest, now) >= now - self._idle_s:
                break
            self._drop(oldest, sockets[oldest])
        used[peer] = now
        sock = sockets.get(peer)
        if sock is not None:
            sockets.move_to_end(peer)
            return sock
        host, port = peer
        check_address(host, port)
        while len(sockets) >= self.max_peer_sockets:
            self._drop(*sockets.popitem(last=False))
        with self._guard:
            if self._closed:
                raise ClientClosed(f"no exchange with {host}:{port}: the client is closed")
            self._opened += 1
            if self._opened >= REAP_EVERY:
                self._opened = 0
                self._close_ended_threads_sockets()
            sock = self._context.socket(zmq.DEALER)
            self._all_sockets[sock] = threading.current_thread()
        try:
            connect_dealer(sock, host, port)
        except zmq.ZMQError:  # an address ZMQ cannot use after all (a host name unresolved)
            self._drop(peer, sock)
            raise
        sockets[peer] = sock
        return sock

    def _close_ended_threads_sockets(self) -> None:
        """Close the sockets of threads that ended (guard held): no thread polls them."""
        ended = [sock for sock, thread in self._all_sockets.items() if not thread.is_alive()]
        for sock in ended:
            del self._all_sockets[sock]
            sock.close()

    def _drop(self, peer: tuple[str, int], sock: zmq.Socket) -> None:
        """Forget a socket after a failed exchange, so a late reply cannot answer the next one."""
        self._local.sockets.pop(peer, None)
        self._local.__dict__.get("used", {}).pop(peer, None)
        with self._guard:
            self._all_sockets.pop(sock, None)
        sock.close()

    def request(self, host: str, port: int, message: Message, keep_socket: bool = True) -> Message:
        """Send ``message`` and return the reply; raises :class:`SideChannelError`
        (:class:`BadAddress` when ``host:port`` is no address). ``keep_socket=False``: close
        the socket after the exchange (a peer this thread seldom asks: a metadata fetch)."""
        peer = (host, port)
        try:
            sock = self._socket(peer)
        except zmq.ZMQError as exc:  # out of sockets or file descriptors: retried like a timeout
            raise SideChannelError(f"no socket to {host}:{port}: {exc}") from exc
        try:
            sock.send_multipart(self.request_frames(message))
            if not sock.poll(self._timeout_ms, zmq.POLLIN):
                raise PeerSilent(f"no reply from {host}:{port} within {self._timeout_ms} ms")
            reply = self.read_reply(sock.recv_multipart(), host, port)
        except (SideChannelError, zmq.ZMQError) as exc:
            self._drop(peer, sock)
            if isinstance(exc, SideChannelError):
                raise
            raise SideChannelError(f"side channel to {host}:{port} failed: {exc}") from exc
        if not keep_socket:
            self._drop(peer, sock)
        return refusal_checked(reply, message, host, port)

    def request_frames(self, message: Message, tag: bytes | None = None) -> list[bytes]:
        """``message`` as the frames a DEALER socket sends (``tag``: the reply carries it)."""
        payload = encode(message)
        frames = [b"", payload] if tag is None else [tag, b"", payload]
        if self._signer is not None:
            frames.append(self._signer.sign_request(payload))
        return frames

    def read_reply(self, frames: list[bytes], host: str, port: int) -> Message:
        """The reply in ``frames`` (the tag, if any, already removed); raises
        :class:`SideChannelError` when malformed, :class:`PeerRefused` when it is not signed
        with this side's secret."""
        if len(frames) not in (2, 3) or frames[0] != b"":
            raise SideChannelError(f"malformed reply from {host}:{port}")
        mac = frames[2] if len(frames) == 3 else None
        if self._signer is not None and not self._signer.reply_is_genuine(frames[1], mac):
            raise PeerRefused(
                f"{host}:{port} answered without a valid side-channel MAC: it has no "
                f"side-channel secret or another one"
            )
        try:
            return decode(frames[1])
        except WireError as exc:
            raise SideChannelError(f"side channel to {host}:{port} failed: {exc}") from exc

    @property
    def context(self) -> zmq.Context:
        return self._context

    def fetch_metadata(self, host: str, port: int) -> Message:
        """A peer's metadata; no socket is kept: a worker fetches it once per peer and idle
        window, on whichever planning thread, so a kept socket would cost one per thread and
        peer until that thread's next exchange."""
        return self.request(host, port, GetMetadata(), keep_socket=False)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (exchanges are refused)."""
        return self._closed

    def close_thread_sockets(self) -> None:
        """Close the calling thread's sockets: a thread that ends calls it, else its sockets
        stay open (and count against the ZMQ context's 1,023) until :meth:`close`."""
        sockets = self._local.__dict__.get("sockets", {})
        while sockets:
            self._drop(*sockets.popitem())

    def close(self) -> None:
        """Refuse new exchanges and close the sockets of the calling thread and of threads that
        ended. A thread still running keeps its socket open until it calls
        :meth:`close_thread_sockets` or ends (then reaped, see :data:`REAP_EVERY`): closing a
        socket that another thread may be polling is not allowed in ZMQ."""
        with self._guard:
            self._closed = True
            current = threading.current_thread()
            mine = [sock for sock, thread in self._all_sockets.items() if thread is current]
            for sock in mine:
                del self._all_sockets[sock]
                sock.close()
            self._close_ended_threads_sockets()
        if self._all_sockets:
            logger.debug(
                "side-channel client closed; %d socket(s) left to their running threads",
                len(self._all_sockets),
            )


def refusal_checked(reply: Message, request: Message, host: str, port: int) -> Message:
    """``reply``, unless it is the peer's error reply: then :class:`PeerRefused`."""
    if isinstance(reply, ErrorReply):
        raise PeerRefused(f"{host}:{port} refused {type(request).__name__}: {reply.message}")
    return reply
