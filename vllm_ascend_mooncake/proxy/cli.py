"""``vam-proxy``: serve the P/D proxy with uvicorn."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from urllib.parse import urlsplit

import uvicorn

from .app import CONNECT_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, DEFAULT_TIMEOUT_S, create_app
from .balancer import (
    DEFAULT_BASE_BACKOFF_S,
    DEFAULT_FAILURE_THRESHOLD,
    DEFAULT_MAX_BACKOFF_S,
    EjectionPolicy,
)
from .continuable import FIRST_TOKEN_SOURCES, FROM_PREFILL
from .health import DEFAULT_HEALTH_INTERVAL_S, DEFAULT_HEALTH_TIMEOUT_S

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def _base_url(value: str) -> str:
    """Accept ``http(s)://host:port`` (no path), so a typo fails at start-up, not per request."""
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(f"expected http://HOST:PORT, got {value!r}")
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(
            f"expected a base URL without a path (the proxy appends /v1/...), got {value!r}"
        )
    return f"{parts.scheme}://{parts.netloc}"


def _positive_seconds(value: str) -> float:
    seconds = float(value)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return seconds


def _interval_seconds(value: str) -> float:
    seconds = float(value)
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"must be positive, or 0 to turn it off; got {value}")
    return seconds


def _max_backoff_seconds(value: str) -> float:
    seconds = float(value)
    if seconds < DEFAULT_BASE_BACKOFF_S:
        raise argparse.ArgumentTypeError(
            f"must be at least the first ejection's {DEFAULT_BASE_BACKOFF_S:g} s, got {value}"
        )
    return seconds


def _failure_count(value: str) -> int:
    count = int(value)
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 failure, got {value}")
    return count


def _positive_mib(value: str) -> int:
    mib = int(value)
    if mib <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of MiB, got {value}")
    return mib


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vam-proxy",
        description="OpenAI-compatible proxy for vLLM prefill/decode disaggregation: each "
        "request is prefilled on one instance and decoded on another, which pulls the KV cache "
        "over Mooncake.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument(
        "--prefill",
        action="append",
        required=True,
        type=_base_url,
        metavar="URL",
        help="base URL of a prefill vLLM instance; repeat for several",
    )
    parser.add_argument(
        "--decode",
        action="append",
        required=True,
        type=_base_url,
        metavar="URL",
        help="base URL of a decode vLLM instance; repeat for several",
    )
    parser.add_argument(
        "--timeout-s",
        type=_positive_seconds,
        default=DEFAULT_TIMEOUT_S,
        help="seconds to wait for an upstream (per read); default %(default)g",
    )
    parser.add_argument(
        "--serial-legs",
        action="store_true",
        help="send the decode leg only after prefill answered, never both at once (overlapped "
        "legs, the default once a prefill instance has answered, save a round trip)",
    )
    parser.add_argument(
        "--first-token",
        choices=FIRST_TOKEN_SOURCES,
        default=FROM_PREFILL,
        help="where an answer's first token comes from: 'prefill' streams the token prefill "
        "sampled as soon as prefill answers and decode continues from it (requests whose "
        "parameters decode could not continue exactly keep decode's token); 'decode' has decode "
        "sample it again. A client picks per request with the X-First-Token-From header; "
        "default %(default)s",
    )
    parser.add_argument(
        "--no-hold-renewal",
        action="store_true",
        help="do not renew prefill's hold on a request's KV while its decode request may be "
        "queued (by default the proxy renews it until decode read it, within prefill's bound of "
        "4 release timeouts; the side channel's secret is read from VAM_SIDE_CHANNEL_SECRET)",
    )
    parser.add_argument(
        "--max-body-mib",
        type=_positive_mib,
        default=DEFAULT_MAX_BODY_BYTES >> 20,
        help="largest request body accepted, in MiB (413 above it); default %(default)d",
    )
    failures = parser.add_argument_group(
        "failure handling",
        "instances that refuse connections or fail their health check are ejected: tried only "
        "when no healthy instance is left, for a back-off that doubles per ejection in a row",
    )
    failures.add_argument(
        "--connect-timeout-s",
        type=_positive_seconds,
        default=CONNECT_TIMEOUT_S,
        help="seconds to wait for an upstream to accept a connection before trying the next "
        "(a host that drops packets); default %(default)g",
    )
    failures.add_argument(
        "--health-interval-s",
        type=_interval_seconds,
        default=DEFAULT_HEALTH_INTERVAL_S,
        help="seconds between background GET /health probes of every instance; 0 turns them "
        "off (an ejected instance is then retried by one request after its back-off); "
        "default %(default)g",
    )
    failures.add_argument(
        "--health-timeout-s",
        type=_positive_seconds,
        default=DEFAULT_HEALTH_TIMEOUT_S,
        help="seconds a health probe may take before it counts as failed; default %(default)g",
    )
    failures.add_argument(
        "--eject-after-failures",
        type=_failure_count,
        default=DEFAULT_FAILURE_THRESHOLD,
        metavar="N",
        help="consecutive connection or health-check failures that eject an instance; "
        "default %(default)d",
    )
    failures.add_argument(
        "--max-eject-s",
        type=_max_backoff_seconds,
        default=DEFAULT_MAX_BACKOFF_S,
        help=f"longest ejection back-off in seconds (it starts at {DEFAULT_BASE_BACKOFF_S:g} s "
        "and doubles per ejection in a row); default %(default)g",
    )
    parser.add_argument("--log-level", choices=_LOG_LEVELS, default="info")
    parser.add_argument(
        "--no-access-log",
        action="store_true",
        help="no uvicorn access line per request (vLLM's --disable-uvicorn-access-log): it is "
        "written when an answer starts, before its first byte",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.log_level != "debug":
        # httpx logs every upstream request at INFO ("HTTP Request: POST ..."), two of them on
        # the way to a continued request's first token (the prefill leg, /detokenize), each
        # written before the proxy goes on (issue #46, benchmarks/README.md). Its warnings stay.
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        app = create_app(
            args.prefill,
            args.decode,
            timeout_s=args.timeout_s,
            overlap_legs=not args.serial_legs,
            max_body_bytes=args.max_body_mib << 20,
            renew_holds=not args.no_hold_renewal,
            first_token=args.first_token,
            connect_timeout_s=args.connect_timeout_s,
            health_interval_s=args.health_interval_s,
            health_timeout_s=args.health_timeout_s,
            ejection=EjectionPolicy(
                failure_threshold=args.eject_after_failures, max_backoff_s=args.max_eject_s
            ),
        )
    except ValueError as error:
        logging.getLogger(__name__).error("%s", error)
        return 2

    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=not args.no_access_log,
    )
    return 0
