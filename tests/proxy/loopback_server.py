"""Serve an ASGI app with uvicorn on a free loopback port in a background thread.

The proxy tests talk real HTTP to real servers (the proxy and fake vLLM instances), so they
exercise connection handling, streaming and refusals the way a deployment does.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn

from vam_testing.waiting import wait_until

#: What the ``start_proxy`` fixture (conftest.py) gives a test: start a proxy, get a client.
StartProxy = Callable[..., httpx.Client]


@contextmanager
def serve_on_loopback(app: Any, port: int = 0) -> Iterator[str]:
    """Run ``app`` until the block ends; yield its base URL (``http://127.0.0.1:PORT``).

    ``port`` 0 picks a free one; pass a port served before to bring a stopped server back.
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    port = listener.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
    )
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [listener]}, name=f"uvicorn-{port}", daemon=True
    )
    thread.start()

    def started() -> bool:
        if server.started:
            return True
        if not thread.is_alive():
            raise RuntimeError(f"the server on port {port} exited before it started")
        return False

    wait_until(started, f"the server on port {port} starts", interval_s=0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        listener.close()


@contextmanager
def refusing_port() -> Iterator[str]:
    """Yield the URL of a port that refuses connections, like an instance that is down.

    The socket stays bound (so nothing else can take the port) but never listens, so the
    kernel answers every connection attempt with a reset.
    """
    closed = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    closed.bind(("127.0.0.1", 0))
    try:
        yield f"http://127.0.0.1:{closed.getsockname()[1]}"
    finally:
        closed.close()


@contextmanager
def black_hole() -> Iterator[str]:
    """Yield the URL of a port where connection attempts hang, like a host that drops packets.

    The socket listens with a backlog of 0 and never accepts; once one connection fills the
    accept queue, Linux drops further SYNs (``tcp_abort_on_overflow`` is 0 by default), so a
    client's connect times out instead of being refused.
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    filler = socket.create_connection(listener.getsockname(), timeout=5)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        filler.close()
        listener.close()


@contextmanager
def _raw_server(handle: Callable[[socket.socket, threading.Event], None]) -> Iterator[str]:
    """Yield the URL of a loopback port whose every connection ``handle(connection, stop)``
    serves on a thread of its own, with raw bytes, for misbehaviours no HTTP server has;
    ``stop`` is set when the block ends."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.1)
    stop = threading.Event()

    def serve(connection: socket.socket) -> None:
        with connection:
            handle(connection, stop)

    def accept() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except OSError:
                continue
            threading.Thread(target=serve, args=(connection,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()


def one_request_per_connection() -> contextlib.AbstractContextManager[str]:
    """Yield the URL of a server that answers ``GET /health`` with 200 and keep-alive, then
    closes the connection without an answer if a second request comes on it: what a server
    closing an idle keep-alive connection does to a client that reuses it at that moment."""
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok"

    def answer_the_first_request(connection: socket.socket, stop: threading.Event) -> None:
        connection.settimeout(10)
        requests = 0
        buffered = b""
        while not stop.is_set():
            try:
                data = connection.recv(4096)
            except OSError:
                return
            if not data:
                return
            buffered += data
            while b"\r\n\r\n" in buffered:
                _, buffered = buffered.split(b"\r\n\r\n", 1)
                requests += 1
                if requests > 1:
                    return  # closed without an answer
                connection.sendall(answer)

    return _raw_server(answer_the_first_request)


def drops_every_connection() -> contextlib.AbstractContextManager[str]:
    """Yield the URL of a port that accepts connections and closes each one unanswered, as a
    restarting vLLM does (it binds its port before its engine is ready) or one dying with the
    request: the client sees "Server disconnected without sending a response"."""

    def read_and_close(connection: socket.socket, stop: threading.Event) -> None:
        # The whole request is read before the close: closing with unread bytes (a body that
        # came in a second segment) would reset the connection, which the client reads as a
        # ReadError rather than a disconnect.
        connection.settimeout(1)
        received = b""
        with contextlib.suppress(OSError):
            while b"\r\n\r\n" not in received:
                data = connection.recv(65536)
                if not data:
                    return
                received += data
            head, body = received.split(b"\r\n\r\n", 1)
            length = next(
                (
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")[1:]
                    if line.lower().startswith(b"content-length:")
                ),
                0,
            )
            while len(body) < length:
                data = connection.recv(65536)
                if not data:
                    return
                body += data
        # no answer is sent

    return _raw_server(read_and_close)
