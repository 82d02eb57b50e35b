"""The proxy's own error answers, in vLLM's shape, and what counts as an instance being unreachable.

Kept apart from :mod:`.app` so the routing code reads without the message formatting, and so
the health checks (:mod:`.health`) and the request path agree on what a connection failure is.
"""

from __future__ import annotations

from collections.abc import Sequence

import httpx
from fastapi.responses import JSONResponse

#: Failures to reach an instance at all: the request never got there, so another instance may
#: be tried and the instance counts a failure towards its ejection. Errors after the connection
#: was made (a read timeout, a dropped stream, an HTTP error status) are not among them.
CONNECTION_FAILURES: tuple[type[httpx.HTTPError], ...] = (httpx.ConnectError, httpx.ConnectTimeout)


class UpstreamUnreachable(Exception):
    """No instance of a role accepted a connection."""

    def __init__(self, role: str, path: str, attempts: Sequence[str]) -> None:
        super().__init__(
            f"no {role} instance accepted a connection for {path}; tried: {'; '.join(attempts)}"
        )


def describe_error(error: BaseException) -> str:
    """``Type: message``, or just the type when the message is empty (httpx timeouts often are)."""
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def error_response(status_code: int, message: str, error_type: str) -> JSONResponse:
    """Return an error in the OpenAI/vLLM shape, so clients parse proxy errors like vLLM's."""
    return JSONResponse(
        {"error": {"message": message, "type": error_type, "code": status_code}},
        status_code=status_code,
    )


def _failed_url(error: httpx.HTTPError) -> str:
    """The URL an httpx error is about, for messages."""
    try:
        return str(error.request.url)
    except RuntimeError:
        return "an upstream"


def upstream_failure_response(error: Exception, timeout_s: float) -> JSONResponse:
    """Map a failure to reach or read an upstream to 502, or 504 when it was too slow."""
    if isinstance(error, httpx.TimeoutException):
        return error_response(
            504,
            f"{_failed_url(error)} did not answer within {timeout_s:g} s "
            f"({type(error).__name__}); raise --timeout-s if the instance is just slow",
            "GatewayTimeoutError",
        )
    if isinstance(error, httpx.HTTPError):
        return error_response(
            502, f"request to {_failed_url(error)} failed: {error!r}", "BadGatewayError"
        )
    return error_response(502, str(error), "BadGatewayError")
