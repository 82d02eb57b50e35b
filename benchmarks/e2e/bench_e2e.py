"""End-to-end P/D latency on CPU: colocated vs MooncakeHeteroConnector vs the peers users pick.

Starts, one system after another in this one run, real ``vllm serve`` instances of the tiny model
(float32 by default, so greedy outputs of every TP layout agree): a colocated instance, our P/D
deployment behind ``vam-proxy``, vLLM's MooncakeConnector behind vLLM's example proxy protocol
(``benchmarks/e2e/mooncake_proxy.py``) and vLLM's NixlConnector on CPU behind ``vllm-router``, on
the same prefill/decode TP pair (``--systems`` also offers ``ours_decode_first``, our deployment
with ``--first-token decode``, and ``ours_serial``). Each (prompt length, concurrency) cell is
measured with vLLM's own client, ``vllm bench serve`` (``benchmarks/e2e/bench_serve.py``;
``--client builtin`` for the home-made streamed load generator), and the report gives TTFT,
inter-token latency and TPOT with their spread, ratios between the systems and the targets of
issue #28. It also checks, per system, that a greedy probe prompt gives the same tokens everywhere
and that the connector logs show successful KV transfers; a failed check marks the run invalid
(exit code 1).

    python -m benchmarks.e2e.bench_e2e --prompt-lens 256,1024,3000 --concurrencies 1,2,4 \\
        --requests-per-cell 16 --json /tmp/bench_e2e.json

Run from the repository root; vLLM's NixlConnector needs ``pip install nixl`` and the router
``pip install vllm-router`` (``pip install -e '.[bench]'``). The systems never run at the same time
(at most two vLLM instances are alive), and every server is stopped, by process group, even on
error or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.common import add_json_arg, environment, make_parser, write_json
from vllm_ascend_mooncake.launch.tiny_model import TinyModelSpec, build_tiny_model
from vllm_ascend_mooncake.timeline import TIMELINE_LOG_ENV

from . import bench_serve, phase_means, request_timeline
from .cpu_usage import cpu_seconds_between, group_cpu_seconds, idle_cores
from .load_generator import CellResult, probe_token_ids, run_cell
from .prompts import make_prompt, regular_token_ids
from .report import (
    DEFAULT_SYSTEMS,
    SYSTEM_ORDER,
    CellSummary,
    latency_table,
    ratio_rows,
    ratio_table,
    summarize_cell,
    targets,
    targets_table,
)
from .systems import (
    STATS_INTERVAL_S,
    BenchSystem,
    ColocatedSystem,
    EngineSettings,
    NixlSystem,
    OursSystem,
    VllmMooncakeSystem,
)

#: Prompt indices at and above these are reserved for warm-up and the probe, so they never
#: coincide with a measured prompt.
_WARMUP_INDEX = 1_000_000
_PROBE_INDEX = 2_000_000
PROBE_PROMPT_LEN = 100


class SystemFailure(RuntimeError):
    """A system could not serve the benchmark (its probe request failed)."""


@dataclass
class SystemReport:
    """Everything measured or checked about one system."""

    name: str
    description: str = ""
    status: str = "not run"
    error: str | None = None
    startup_s: float | None = None
    probe_token_ids: list[int] | None = None
    transfer_check: dict[str, Any] | None = None
    proxy_stats: dict[str, Any] | None = None
    warmup_failures: list[str] = field(default_factory=list)
    #: Cores the system's processes keep busy with no request in flight (vLLM's CPU workers
    #: spin while idle; a P/D system has two of them).
    idle_cores: float | None = None
    #: Cores the system's processes kept busy, on average, while the cells ran: close to the
    #: machine's core count means the system was CPU-bound (latencies then measure contention).
    busy_cores_under_load: float | None = None
    cells: list[CellSummary] = field(default_factory=list)
    load_average: dict[str, list[float]] = field(default_factory=dict)
    logs: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "status": self.status,
            "error": self.error,
            "startup_s": self.startup_s,
            "probe_token_ids": self.probe_token_ids,
            "transfer_check": self.transfer_check,
            "proxy_stats": self.proxy_stats,
            "warmup_failures": self.warmup_failures,
            "idle_cores": self.idle_cores,
            "busy_cores_under_load": self.busy_cores_under_load,
            "cells": [cell.to_dict() for cell in self.cells],
            "load_average": self.load_average,
            "logs": self.logs,
        }


def _int_list(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or any(value <= 0 for value in values):
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas: {text}")
    return values


def _system_list(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = sorted(set(names) - set(SYSTEM_ORDER))
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"systems must be a comma-separated subset of {','.join(SYSTEM_ORDER)}; got {text}"
        )
    return names


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = make_parser("benchmarks.e2e.bench_e2e", __doc__)
    parser.add_argument(
        "--systems",
        type=_system_list,
        default=list(DEFAULT_SYSTEMS),
        help=f"comma-separated, run in this order; subset of {','.join(SYSTEM_ORDER)} "
        f"(default {','.join(DEFAULT_SYSTEMS)}; ours_decode_first is our proxy with "
        "--first-token decode, ours_serial that with --serial-legs too)",
    )
    parser.add_argument("--prompt-lens", type=_int_list, default=[256, 1024, 3000], help="tokens")
    parser.add_argument(
        "--concurrencies", type=_int_list, default=[1, 2, 4], help="clients sending back to back"
    )
    parser.add_argument(
        "--requests-per-cell", type=int, default=16, help="measured requests per cell"
    )
    parser.add_argument(
        "--client",
        choices=("bench-serve", "builtin"),
        default="bench-serve",
        help="what measures the cells: vLLM's `vllm bench serve` (random prompts of the cell's "
        "length) or the home-made streamed load generator (token-id prompts)",
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="generated per request")
    parser.add_argument("--prefill-tp", type=int, default=1, help="P/D systems' prefill TP")
    parser.add_argument("--decode-tp", type=int, default=1, help="P/D systems' decode TP")
    parser.add_argument("--colocated-tp", type=int, default=1, help="TP of the reference")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="float32 keeps greedy outputs identical across TP layouts",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=3200, help="context length of every instance"
    )
    parser.add_argument(
        "--model", default=None, help="model directory; the tiny test model when not given"
    )
    parser.add_argument(
        "--warmup-requests", type=int, default=1, help="unmeasured requests per prompt length"
    )
    parser.add_argument(
        "--request-timeout-s", type=float, default=300.0, help="whole stream, per request"
    )
    parser.add_argument(
        "--cell-timeout-s", type=float, default=300.0, help="no new request of a cell after this"
    )
    parser.add_argument(
        "--ready-timeout-s", type=float, default=600.0, help="start-up limit per system"
    )
    parser.add_argument(
        "--kv-hold-timeout-s",
        type=int,
        default=120,
        help="how long P keeps KV for D: VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT / release_timeout_s",
    )
    parser.add_argument("--seed", type=int, default=0, help="for the prompts' token ids")
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="server and proxy logs; a new temp dir if not given",
    )
    add_json_arg(parser)
    args = parser.parse_args(argv)
    longest = max([*args.prompt_lens, PROBE_PROMPT_LEN])
    if longest + args.max_tokens > args.max_model_len:
        parser.error(
            f"prompt length {longest} + max tokens {args.max_tokens} exceeds "
            f"--max-model-len {args.max_model_len}"
        )
    return args


def _factories(
    args: argparse.Namespace, settings: EngineSettings, log_dir: Path
) -> dict[str, Callable[[], BenchSystem]]:
    """Systems are built right before they start, so their free ports are picked late."""
    tps = (args.prefill_tp, args.decode_tp)

    def ours(name: str, *proxy_args: str) -> OursSystem:
        return OursSystem(settings, *tps, log_dir, args.kv_hold_timeout_s, name, proxy_args)

    return {
        "colocated": lambda: ColocatedSystem(settings, args.colocated_tp, log_dir),
        "ours": lambda: ours("ours"),
        "ours_decode_first": lambda: ours("ours_decode_first", "--first-token", "decode"),
        "ours_serial": lambda: ours("ours_serial", "--first-token", "decode", "--serial-legs"),
        "vllm_mooncake": lambda: VllmMooncakeSystem(
            settings, *tps, log_dir, args.kv_hold_timeout_s
        ),
        "nixl": lambda: NixlSystem(settings, *tps, log_dir),
    }


def _measure_cell(
    system: BenchSystem,
    model: str,
    prompts: list[list[int]],
    prompt_len: int,
    concurrency: int,
    args: Any,
    log_dir: Path,
) -> CellResult:
    """One measured cell, with the client ``--client`` names. ``vllm bench serve`` draws its
    own prompts, the same for every system: a seed per cell, so no cell's prompts repeat
    another's (which the prefix cache would serve)."""
    if args.client == "builtin":
        return _run_cell(system, model, prompts, concurrency, args)
    return bench_serve.run_cell(
        system.url,
        model,
        prompt_len=prompt_len,
        max_tokens=args.max_tokens,
        concurrency=concurrency,
        num_prompts=args.requests_per_cell,
        seed=args.seed * 1_000_003 + prompt_len * 101 + concurrency,
        result_path=log_dir / "bench_serve" / f"{system.name}-{prompt_len}-{concurrency}.json",
        timeout_s=args.cell_timeout_s + args.request_timeout_s,
    )


def _run_cell(
    system: BenchSystem, model: str, prompts: list[list[int]], concurrency: int, args: Any
) -> CellResult:
    return asyncio.run(
        run_cell(
            system.url,
            model,
            prompts,
            concurrency=concurrency,
            max_tokens=args.max_tokens,
            request_timeout_s=args.request_timeout_s,
            cell_timeout_s=args.cell_timeout_s,
        )
    )


def benchmark_system(
    system: BenchSystem,
    report: SystemReport,
    model: str,
    vocabulary: list[int],
    args: Any,
    log_dir: Path,
) -> None:
    """Start, warm up, probe, load and check one system, filling ``report`` as it goes."""
    report.load_average["before"] = list(os.getloadavg())
    print(f"[{system.name}] starting: {system.description}", flush=True)
    report.startup_s = system.start(args.ready_timeout_s)
    print(f"[{system.name}] ready after {report.startup_s:.1f} s at {system.url}", flush=True)

    for prompt_len in args.prompt_lens:
        prompts = [
            make_prompt(vocabulary, prompt_len, _WARMUP_INDEX + i, args.seed)
            for i in range(args.warmup_requests)
        ]
        warmup = _run_cell(system, model, prompts, 1, args)
        for timing in warmup.failures:
            # Recorded (and the run marked invalid) but not fatal: a transient failure should
            # not cost the whole comparison; a broken system still fails the probe below.
            failure = f"{prompt_len} tokens: {timing.error or 'no tokens'}"
            report.warmup_failures.append(failure)
            print(f"[{system.name}] warm-up request failed: {failure}", file=sys.stderr)

    probe_prompt = make_prompt(vocabulary, PROBE_PROMPT_LEN, _PROBE_INDEX, args.seed)
    probe = asyncio.run(
        probe_token_ids(system.url, model, probe_prompt, args.max_tokens, args.request_timeout_s)
    )
    if not probe.succeeded:
        raise SystemFailure(f"probe request failed: {probe.error}")
    report.probe_token_ids = probe.token_ids

    report.idle_cores = idle_cores(system.process_groups())
    print(f"[{system.name}] idle CPU use: {report.idle_cores:.2f} cores", flush=True)
    cpu_before = group_cpu_seconds(system.process_groups())
    load_started = time.monotonic()

    for prompt_len in args.prompt_lens:
        for cell_index, concurrency in enumerate(args.concurrencies):
            prompts = [
                make_prompt(
                    vocabulary, prompt_len, cell_index * args.requests_per_cell + i, args.seed
                )
                for i in range(args.requests_per_cell)
            ]
            before = phase_means.snapshot(system.instances())
            window_start = time.time()
            result = _measure_cell(system, model, prompts, prompt_len, concurrency, args, log_dir)
            window = (window_start, time.time())
            summary = summarize_cell(system.name, prompt_len, concurrency, result, args.max_tokens)
            summary = replace(summary, window=window)
            time.sleep(STATS_INTERVAL_S + 0.5)  # connector histograms arrive once per interval
            after = phase_means.snapshot(system.instances())
            summary = replace(summary, phase_means_ms=phase_means.mean_ms(before, after))
            report.cells.append(summary)
            print(
                f"[{system.name}] prompt {prompt_len:>4} conc {concurrency:>2}: "
                f"{summary.succeeded}/{summary.requests} ok, TTFT p50 "
                f"{summary.ttft.p50_ms or float('nan'):.1f} ms, ITL p50 "
                f"{summary.itl.p50_ms or float('nan'):.1f} ms"
                + (f"; first error: {summary.first_error}" if summary.first_error else ""),
                flush=True,
            )
    cpu_used = cpu_seconds_between(cpu_before, group_cpu_seconds(system.process_groups()))
    report.busy_cores_under_load = cpu_used / (time.monotonic() - load_started)


def collect_transfer_evidence(system: BenchSystem, report: SystemReport) -> None:
    """Read the proxy's and the connectors' counts; also after a failure, as evidence."""
    if isinstance(system, VllmMooncakeSystem):
        report.proxy_stats = system.proxy_stats()
    # The last stats interval must be logged before the transfer counts are read.
    time.sleep(3 * STATS_INTERVAL_S + 1)
    check = system.transfer_check()
    if check is not None:
        report.transfer_check = check.to_dict()
        print(f"[{system.name}] transfer check: ok={check.ok} ({check.detail})", flush=True)
        for line in check.error_lines:
            print(f"[{system.name}]   logged: {line[:300]}", flush=True)
    report.load_average["after"] = list(os.getloadavg())


def _collect_evidence_then_stop(system: BenchSystem, report: SystemReport) -> None:
    """Read the transfer counts (best effort), then stop every process, whatever happens."""
    try:
        collect_transfer_evidence(system, report)
    except Exception as error:
        print(f"[{system.name}] could not read transfer counts: {error}", file=sys.stderr)
    finally:
        try:
            system.stop()
        except Exception as error:
            report.status = "failed"
            report.error = (report.error or "") + f"; stop failed: {error}"
            print(f"[{system.name}] STOP FAILED: {error}", file=sys.stderr, flush=True)


def _validate(reports: list[SystemReport]) -> list[str]:
    """Everything that makes the comparison untrustworthy, as human-readable warnings."""
    warnings = []
    for report in reports:
        if report.status != "ok":
            warnings.append(f"{report.name}: FAILED: {report.error}")
            continue
        warnings += [f"{report.name}: warm-up request failed: {f}" for f in report.warmup_failures]
        check = report.transfer_check
        if check is not None and not check["ok"]:
            warnings.append(
                f"{report.name}: no proof of KV transfer or transfer failures ({check['detail']})"
            )
        if check is not None and check["error_lines"]:
            warnings.append(
                f"{report.name}: errors in the server logs, first: {check['error_lines'][0]}"
            )
        if check is not None and check.get("mooncake_timeouts"):
            warnings.append(
                f"{report.name}: {check['mooncake_timeouts']} Mooncake transfer(s) hit the TCP "
                "transport's 30 s timeout (see the logs)"
            )
        stats = report.proxy_stats
        if stats and stats.get("prefill_failed"):
            warnings.append(
                f"{report.name}: {stats['prefill_failed']} prefill legs failed in the proxy "
                f"(last: {stats.get('last_prefill_error')})"
            )
        for cell in report.cells:
            if cell.failed or cell.not_started:
                warnings.append(
                    f"{report.name}: prompt {cell.prompt_len} conc {cell.concurrency}: "
                    f"{cell.failed} failed, {cell.not_started} not started "
                    f"(first error: {cell.first_error})"
                )
    probes = {r.name: r.probe_token_ids for r in reports if r.probe_token_ids is not None}
    if len(probes) > 1:
        reference_name = "colocated" if "colocated" in probes else next(iter(probes))
        reference = probes[reference_name]
        for name, token_ids in probes.items():
            if token_ids != reference:
                warnings.append(
                    f"{name}: greedy probe output differs from {reference_name}: "
                    f"{token_ids} != {reference}"
                )
    return warnings


def _attach_request_timelines(reports: list[SystemReport]) -> None:
    """Join each system's timeline log lines and give every cell its critical-path breakdown."""
    for report in reports:
        records = request_timeline.read_records(Path(path) for path in report.logs)
        if not records:
            continue
        joined = request_timeline.join(records)
        for index, cell in enumerate(report.cells):
            breakdown = request_timeline.cell_timeline(joined, *cell.window)
            if breakdown is not None:
                report.cells[index] = replace(cell, request_timeline=breakdown.to_dict())


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    # Turn SIGTERM into an exception so every `finally` stops its servers.
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    # Our proxy and instances log one timeline line per request (other systems ignore it).
    os.environ[TIMELINE_LOG_ENV] = "1"
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="vam-bench-e2e-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    spec = TinyModelSpec(
        num_kv_heads=2, dtype=args.dtype, max_position_embeddings=max(1024, args.max_model_len)
    )
    model = args.model or str(build_tiny_model(spec))
    vocabulary = regular_token_ids(model)
    settings = EngineSettings(model=model, dtype=args.dtype, max_model_len=args.max_model_len)
    factories = _factories(args, settings, log_dir)
    print(f"model {model} ({args.dtype}); logs in {log_dir}", flush=True)

    reports = []
    started = time.time()
    for name in args.systems:
        report = SystemReport(name=name)
        reports.append(report)
        system: BenchSystem | None = None
        try:
            system = factories[name]()
            report.description = system.description
            report.logs = [str(path) for path in system.log_paths()]
            benchmark_system(system, report, model, vocabulary, args, log_dir)
            report.status = "ok"
        except Exception as error:
            report.status = "failed"
            report.error = f"{type(error).__name__}: {error}"
            print(f"[{name}] FAILED: {report.error}", file=sys.stderr, flush=True)
            traceback.print_exc(file=sys.stderr)
        finally:
            if system is not None:
                _collect_evidence_then_stop(system, report)
            print(f"[{name}] stopped", flush=True)

    _attach_request_timelines(reports)
    summaries = [cell for report in reports for cell in report.cells]
    ratios = ratio_rows(summaries)
    verdicts = targets(summaries)
    warnings = _validate(reports)
    print()
    print(
        f"Latency (ms), {args.dtype}, max_tokens {args.max_tokens}, prefill TP "
        f"{args.prefill_tp} -> decode TP {args.decode_tp}, colocated TP {args.colocated_tp}:"
    )
    print(latency_table(summaries))
    if ratios and any(len(row) > 2 for row in ratios):
        print("\nRatios (lower is better for the numerator):")
        print(ratio_table(ratios))
    if any(verdict["cells"] for verdict in verdicts):
        print("\nTargets (issue #28), ratios per cell:")
        print(targets_table(verdicts))
    cells = [(s.system, s.prompt_len, s.concurrency, s.phase_means_ms) for s in summaries]
    if any(means for *_, means in cells):
        print("\nPhases: mean ms per request and phase (phases overlap; see phase_means.py):")
        print(phase_means.phase_means_table(cells))
    breakdowns = [
        (s.system, s.prompt_len, s.concurrency, request_timeline.CellTimeline(**s.request_timeline))
        for s in summaries
        if s.request_timeline
    ]
    if breakdowns:
        print("\nCritical path per request, proxy side (request_timeline.py; segments add up):")
        print(request_timeline.breakdown_table(breakdowns))
        handoffs = request_timeline.handoff_table(breakdowns)
        if handoffs:
            print("\nContinued requests, from the client's first token to its second:")
            print(handoffs)
        png = args.json.with_suffix(".png") if args.json else log_dir / "timeline.png"
        try:
            print(f"stacked breakdown written to {request_timeline.write_png(breakdowns, png)}")
        except ImportError as error:  # Pillow comes with vLLM; without it only the PNG is lost
            print(f"no PNG ({error})", file=sys.stderr)
    for report in reports:
        print(
            f"{report.name}: idle CPU {_fmt(report.idle_cores, '.2f')} cores, "
            f"{_fmt(report.busy_cores_under_load, '.2f')} cores busy under load, machine load "
            f"average (1 min) {_fmt(report.load_average.get('before', [None])[0], '.1f')} before"
            f" -> {_fmt(report.load_average.get('after', [None])[0], '.1f')} after"
        )
    for warning in warnings:
        print(f"WARNING: {warning}", file=sys.stderr)
    valid = not warnings
    print(f"\nresult {'VALID' if valid else 'INVALID'}; logs in {log_dir}")

    if args.json:
        document = {
            "config": {
                key: (str(value) if isinstance(value, Path) else value)
                for key, value in vars(args).items()
            }
            | {"model": model, "probe_prompt_len": PROBE_PROMPT_LEN},
            "environment": environment(),
            "started_at_unix": started,
            "wall_s": time.time() - started,
            "systems": [report.to_dict() for report in reports],
            "cells": [summary.to_dict() for summary in summaries],
            "ratios": ratios,
            "targets": verdicts,
            "warnings": warnings,
            "valid": valid,
        }
        print(f"JSON written to {write_json(args.json, document)}")
    return 0 if valid else 1


if __name__ == "__main__":
    sys.exit(main())
