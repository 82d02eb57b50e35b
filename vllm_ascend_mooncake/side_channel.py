"""The ZMQ side channel: a prefill worker's server thread and the decode side's client.

The server (a ROUTER socket on ``host:port``) answers metadata requests and receives read-done
notifications; a malformed or hostile message gets an error reply and never stops the thread. The
client uses one DEALER socket per peer with a timeout on every exchange; after a timeout the socket
is dropped so a late reply cannot be mistaken for the next answer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import zmq

from .log import get_logger
from .wire import ErrorReply, GetMetadata, Message, WireError, decode, encode

logger = get_logger(__name__)


class SideChannelError(RuntimeError):
    """A side-channel exchange with a peer failed or timed out."""


class PeerRefused(SideChannelError):
    """The peer answered, with an error: asking again will not help."""


def zmq_address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


Handler = Callable[[Message], Message]


class SideChannelServer:
    """Serves one worker's side channel on a background thread."""

    def __init__(self, host: str, port: int, handler: Handler, name: str = "vam-side-channel"):
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
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
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._socket.recv_multipart()
            if len(frames) != 3 or frames[1] != b"":
                logger.warning("side channel dropped a message with %d frame(s)", len(frames))
                continue
            identity, _, payload = frames
            try:
                reply = self._handler(decode(payload))
            except WireError as exc:
                logger.warning("side channel rejected a message: %s", exc)
                reply = ErrorReply(str(exc))
            except Exception as exc:  # a handler bug must not kill the server thread
                logger.exception("side channel handler failed")
                reply = ErrorReply(f"internal error: {exc}")
            self._socket.send_multipart([identity, b"", encode(reply)])
        self._socket.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class SideChannelClient:
    """Request/response exchanges with peers' side channels, one socket per peer."""

    def __init__(self, timeout_s: float) -> None:
        self._context = zmq.Context.instance()
        self._timeout_ms = int(timeout_s * 1000)
        self._sockets: dict[tuple[str, int], zmq.Socket] = {}
        self._locks: dict[tuple[str, int], threading.Lock] = {}
        self._guard = threading.Lock()

    def _lock_for(self, peer: tuple[str, int]) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(peer, threading.Lock())

    def request(self, host: str, port: int, message: Message) -> Message:
        """Send ``message`` and return the reply; raises :class:`SideChannelError`."""
        peer = (host, port)
        with self._lock_for(peer):
            with self._guard:
                sock = self._sockets.get(peer)
            if sock is None:
                sock = self._context.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                if ":" in host:
                    sock.setsockopt(zmq.IPV6, 1)
                sock.connect(zmq_address(host, port))
                with self._guard:
                    self._sockets[peer] = sock
            try:
                sock.send_multipart([b"", encode(message)])
                if not sock.poll(self._timeout_ms, zmq.POLLIN):
                    raise SideChannelError(
                        f"no reply from {host}:{port} within {self._timeout_ms} ms"
                    )
                frames = sock.recv_multipart()
                if len(frames) != 2 or frames[0] != b"":
                    raise SideChannelError(f"malformed reply from {host}:{port}")
                reply = decode(frames[1])
            except (SideChannelError, WireError, zmq.ZMQError) as exc:
                sock.close()
                with self._guard:
                    self._sockets.pop(peer, None)
                if isinstance(exc, SideChannelError):
                    raise
                raise SideChannelError(f"side channel to {host}:{port} failed: {exc}") from exc
        if isinstance(reply, ErrorReply):
            raise PeerRefused(f"{host}:{port} refused {type(message).__name__}: {reply.message}")
        return reply

    def fetch_metadata(self, host: str, port: int) -> Message:
        return self.request(host, port, GetMetadata())

    def close(self) -> None:
        with self._guard:
            for sock in self._sockets.values():
                sock.close()
            self._sockets.clear()
