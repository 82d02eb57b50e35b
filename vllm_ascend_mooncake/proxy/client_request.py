"""One client request as the proxy's legs see it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .trace import RequestTrace


@dataclass(frozen=True)
class ClientRequest:
    """What a client asked, and what every leg of it carries along."""

    path: str  # the endpoint: /v1/completions or /v1/chat/completions
    headers: dict[str, str]  # the client's headers, passed on to both legs
    body: dict[str, Any]  # the client's request body, as parsed
    request_id: str  # the id the answer and the logs carry
    trace: RequestTrace  # the proxy's side of the request's timeline
