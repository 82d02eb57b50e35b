"""A fleet of P/D workers on one host: the product's real control plane at scale.

One decode worker pulling from N prefill workers (``--shape fan-in``) or one prefill worker
serving M decode workers (``--shape fan-out``), each size of ``--sizes`` in turn, with
``--requests`` requests per size; reported per size: threads, open file descriptors and RSS per
process (setup, max during the run, end), claim->grant and read-done->release latency p50/p99,
control-plane CPU per pull, and failed pulls, each attributed to the fault or abort that caused
it. Writes ``fleet-<shape>.json`` and ``fleet-<shape>.md`` (and a PNG of the curves) to ``--out``.

    python -m benchmarks.fleet --shape fan-in --sizes 1,16,128 --requests 2000 --out results/

The bytes do not move (see :mod:`.transport`); see :mod:`.run` for the stream and the faults and
:mod:`.workers` for what runs in each process.
"""

from __future__ import annotations

import json
import signal
import sys
from dataclasses import replace
from pathlib import Path

from benchmarks.common import make_parser

from .report import markdown_table, write_png
from .run import SHAPES, Settings, run_point
from .workers import Timing


def parse_args(argv=None):
    parser = make_parser("benchmarks.fleet", __doc__)
    parser.add_argument("--shape", choices=SHAPES, default="fan-in")
    parser.add_argument("--sizes", default="1,16", help="peer counts, comma-separated")
    parser.add_argument("--requests", type=int, default=300, help="requests per size")
    parser.add_argument("--rate", type=float, default=300.0, help="arrivals per second")
    parser.add_argument("--early-fraction", type=float, default=0.2, help="overlapped legs")
    parser.add_argument("--abort-fraction", type=float, default=0.02)
    parser.add_argument("--early-delay-ms", type=float, default=30.0, help="pull before hold")
    parser.add_argument("--min-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--no-faults", action="store_true", help="no kill, freeze or replace")
    parser.add_argument("--freeze-s", type=float, default=6.0, help="how long one stays frozen")
    parser.add_argument(
        "--workers-per-host", type=int, default=128, help="simulated workers per process"
    )
    parser.add_argument("--read-base-us", type=float, default=200.0, help="per read")
    parser.add_argument("--read-per-descriptor-us", type=float, default=5.0)
    parser.add_argument("--drain-s", type=float, default=60.0, help="wait for reports this long")
    parser.add_argument(
        "--idle-s",
        type=float,
        default=0.0,
        help="after each run, wait this long without traffic and sample again (0: not); past "
        "the notifier's 30 s lane idle time shows what is reclaimed",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-level", default="ERROR", help="the workers' product loggers")
    parser.add_argument("--out", type=Path, default=Path("fleet-results"))
    return parser.parse_args(argv)


def _terminate(signum, frame) -> None:
    raise SystemExit(128 + signum)  # the fleet's processes are closed on the way out


def main(argv=None) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    args = parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    timing = replace(
        Timing(),
        read_base_s=args.read_base_us / 1e6,
        read_per_descriptor_s=args.read_per_descriptor_us / 1e6,
    )
    results = []
    for size in sizes:
        print(f"{args.shape} size {size}: {args.requests} requests", flush=True)
        settings = Settings(
            shape=args.shape,
            size=size,
            requests=args.requests,
            rate=args.rate,
            early_fraction=args.early_fraction,
            abort_fraction=args.abort_fraction,
            min_tokens=args.min_tokens,
            max_tokens=args.max_tokens,
            early_delay_s=args.early_delay_ms / 1000,
            faults=not args.no_faults,
            freeze_s=args.freeze_s,
            workers_per_host=args.workers_per_host,
            seed=args.seed,
            drain_s=args.drain_s,
            log_level=args.log_level,
            idle_s=args.idle_s,
            timing=timing,
        )
        result = run_point(settings, log=lambda m: print(m, flush=True))
        results.append(result)
        print(markdown_table([result]).splitlines()[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"fleet-{args.shape}"
    payload = {"argv": sys.argv[1:], "results": results}
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    table = markdown_table(results)
    stem.with_suffix(".md").write_text(table + "\n")
    png = write_png(results, stem.with_suffix(".png"))
    print(table)
    print(f"wrote {stem}.json, {stem}.md" + (f", {png}" if png else ""))
    return 0 if all(r["failed_unattributed"] == 0 for r in results) else 1
