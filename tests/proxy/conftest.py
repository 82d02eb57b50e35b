"""Fixtures shared by the proxy tests: a proxy app served on loopback in front of given URLs.

``start_proxy`` runs the legs where decode samples every first token (``first_token="decode"``)
unless a test asks otherwise: those are what the routing, overlap and failure tests are about;
``test_continuation.py`` runs the default, decode continuing from prefill's token."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from loopback_server import StartProxy, serve_on_loopback

from vllm_ascend_mooncake.proxy import create_app


@pytest.fixture
def start_proxy() -> Iterator[StartProxy]:
    """Start a proxy over the given upstream URLs; return an HTTP client pointed at it. Both
    are closed when the test ends."""
    with ExitStack() as stack:

        def start(prefill: Sequence[str], decode: Sequence[str], **options: Any) -> httpx.Client:
            options.setdefault("first_token", "decode")
            url = stack.enter_context(serve_on_loopback(create_app(prefill, decode, **options)))
            return stack.enter_context(httpx.Client(base_url=url, timeout=60, trust_env=False))

        yield start
