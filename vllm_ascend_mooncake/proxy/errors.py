"""The proxy's own error answers, in vLLM's shape, and what counts as an instance being unreachable.

Kept apart from :mod:`.app` so the routing code reads without the message formatting, and so
the health checks (:mod:`.health`) and the request path agree on what a connection failure is.
"""

from __future__ import annotations

from collections.abc import Sequence

import httpx
from fastapi.responses import JSONResponse

#: Failures before an instance answered anything: a refused or timed-out connect, or a
#: connection it closed or reset before the status line. Another instance may be tried and the
#: instance counts a failure towards its ejection. The second kind is an instance starting up
#: (vLLM binds its port before its engine is ready, then drops what it accepted), dying with
#: the request, or closing an idle keep-alive connection as it is reused; resending is safe for
#: either leg: prefill's KV hold dies with it or expires, and a decode that had not answered
#: had not begun the stream (a decode that did and then died leaves prefill's hold unread).
#: Errors once an answer began (a read timeout, a dropped stream, an HTTP error status) are not
#: among them: the request is never sent twice after that.
NO_ANSWER_FAILURES: tuple[type[httpx.HTTPError], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
)


class UpstreamUnreachable(Exception):
    """No instance of a role answered: each refused the connection or dropped it unanswered."""

    def __init__(self, role: str, path: str, attempts: Sequence[str]) -> None:
        super().__init__(f"no {role} instance answered {path}; tried: {'; '.join(attempts)}")


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
