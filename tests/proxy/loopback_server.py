"""Serve an ASGI app with uvicorn on a free loopback port in a background thread.

The proxy tests talk real HTTP to real servers (the proxy and fake vLLM instances), so they
exercise connection handling, streaming and refusals the way a deployment does.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn

#: What the ``start_proxy`` fixture (conftest.py) gives a test: start a proxy, get a client.
StartProxy = Callable[..., httpx.Client]

_STARTUP_TIMEOUT_S = 10.0


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
    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the server on port {port} did not start")
        time.sleep(0.01)
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
