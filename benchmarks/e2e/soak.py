"""Soak: does memory plateau or leak? The same mixed load through P/D and through a colocated
instance, the RSS of every process sampled against requests served.

Each system in turn (never two at once): the tiny model (float32, TP 1 by default) served
colocated, and by our P/D deployment behind ``vam-proxy``; the same ``--requests`` requests of
:mod:`.soak_load`'s mix (unique prompts of 20-200 tokens, half behind one of four shared 64-token
prefixes, 4-24 tokens generated, a third streamed), ``--concurrency`` at a time, after an
unmeasured warm-up. Every ``--sample-every`` requests the VmRSS of every process of the system
(API server, engine core, workers, proxy: :mod:`.process_memory`) is read. The report gives each
process's and each instance's MiB per 1,000 requests over the first and the last half of the run
(least squares, :mod:`.rss_growth`): warm-up shows in the first half, a leak in both. With
``--tcmalloc`` every process preloads tcmalloc, as vLLM's CPU installation guide advises (an
allocator's fragmentation then shows as the difference). After the load: every request answered
in full, both engines alive and holding no KV block, no pull failed and none released by
timeout, or the run is marked invalid (exit code 1).

    python -m benchmarks.e2e.soak --requests 10000 --prefix-caching on --json /tmp/soak.json

writes the JSON, a PNG of the curves beside it, and prints the table. ``tests/e2e/test_soak.py``
runs a bounded one in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import add_json_arg, environment, make_parser, write_json
from vllm_ascend_mooncake.launch.engine_env import find_tcmalloc, preload_env
from vllm_ascend_mooncake.launch.prometheus import metric_sum, metrics_text
from vllm_ascend_mooncake.launch.servers import http_ok
from vllm_ascend_mooncake.launch.tiny_model import TinyModelSpec, build_tiny_model

from . import soak_plot
from .process_memory import maps_library, pids_by_process, rss_by_process
from .prompts import regular_token_ids
from .rss_growth import Growth, RssSample, growth, growth_table, instance_growth
from .soak_load import draw_requests, prompt_ids, request_body, run_load
from .systems import BenchSystem, ColocatedSystem, EngineSettings, OursSystem

SYSTEMS = ("colocated", "pd")
#: warm-up requests' indices (never a measured request's)
_WARMUP_INDEX = 10_000_000
#: how long an instance may take to free its last KV block once the load ended
SETTLE_S = 60.0


@dataclass(frozen=True)
class SoakSettings:
    requests: int = 600
    concurrency: int = 8
    systems: tuple[str, ...] = SYSTEMS
    prefix_caching: bool = True
    tcmalloc: bool = False
    #: share of the requests whose prompt begins with a shared prefix
    shared_prefix_share: float = 0.5
    warmup_requests: int = 32
    #: requests between two RSS samples (None: about 100 samples per run)
    sample_every: int | None = None
    seed: int = 0
    prefill_tp: int = 1
    decode_tp: int = 1
    colocated_tp: int = 1
    #: a TP 1 instance runs its model in a worker process of its own (vLLM's CPU default)
    worker_process: bool = False
    #: more environment for every process, e.g. ``{"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}``
    engine_env: tuple[tuple[str, str], ...] = ()
    request_timeout_s: float = 120.0
    ready_timeout_s: float = 600.0
    log_dir: str | None = None

    @property
    def sampling_interval(self) -> int:
        return self.sample_every or max(1, self.requests // 100)


@dataclass
class SystemSoak:
    """What one system did under the soak."""

    name: str
    description: str = ""
    status: str = "not run"
    error: str | None = None
    samples: list[RssSample] = field(default_factory=list)
    #: the PIDs behind each process label (where to look further)
    pids: dict[str, list[int]] = field(default_factory=dict)
    completed: int = 0
    failed_requests: int = 0
    first_errors: list[str] = field(default_factory=list)
    load_s: float = 0.0
    #: P/D: pulls by outcome during the load (successful, failed; prefill's expired releases)
    transfers: dict[str, int] = field(default_factory=dict)
    dead: list[str] = field(default_factory=list)
    #: instance -> KV cache usage still held once settled
    held_kv: dict[str, float] = field(default_factory=dict)
    #: with ``--tcmalloc``: the process labels that do not have it mapped
    without_tcmalloc: list[str] = field(default_factory=list)

    @property
    def growth(self) -> list[Growth]:
        return growth(self.name, self.samples)

    def problems(self, requests: int, pulls: int) -> list[str]:
        """What makes this system's numbers untrustworthy or shows a defect; ``pulls``: how
        many successful pulls the requests make on P/D (one per decode rank each)."""
        if self.status != "ok":
            return [f"{self.name}: {self.status}: {self.error}"]
        found = []
        if self.completed != requests:
            found.append(f"{self.name}: {self.completed} of {requests} requests ended")
        if self.failed_requests:
            found.append(
                f"{self.name}: {self.failed_requests} requests failed, first: {self.first_errors}"
            )
        found += [f"{self.name}: {instance} is not alive" for instance in self.dead]
        found += [
            f"{self.name}: {instance} still holds KV ({usage:.3%})"
            for instance, usage in self.held_kv.items()
        ]
        if self.transfers:
            if self.transfers.get("failed") or self.transfers.get("expired"):
                found.append(f"{self.name}: failed pulls or expired releases: {self.transfers}")
            if self.transfers.get("successful") != pulls:
                found.append(f"{self.name}: {self.transfers} pulls, {pulls} expected")
        if self.without_tcmalloc:
            found.append(f"{self.name}: tcmalloc is not loaded in {self.without_tcmalloc}")
        return found

    def to_dict(self) -> dict[str, Any]:
        return {
            **{k: v for k, v in asdict(self).items() if k != "samples"},
            "samples": [asdict(sample) for sample in self.samples],
            "growth": [asdict(row) for row in self.growth],
        }


@dataclass
class SoakReport:
    settings: SoakSettings
    tcmalloc_library: str | None
    systems: list[SystemSoak]
    log_dir: str

    def problems(self) -> list[str]:
        found = []
        if self.settings.tcmalloc and self.tcmalloc_library is None:
            found.append("--tcmalloc: no tcmalloc library found (ldconfig -p)")
        requests = self.settings.requests
        for system in self.systems:
            found += system.problems(requests, requests * self.settings.decode_tp)
        return found

    def growth_rows(self) -> list[Growth]:
        return [row for system in self.systems for row in system.growth]

    def excess_over_colocated(self) -> dict[str, float]:
        """Per P/D instance (prefill, decode, proxy), its last-half MiB per 1,000 requests less
        colocated's (all processes of each instance summed); empty without both systems.

        Colocated's counts only as growth: where it shrank over the window (glibc trimming its
        heap, a step of 10-20 MiB that lands in one system's window and not the other's), P/D
        is measured against zero, not against the trim. A CI run measured colocated -42.5 and
        prefill +70.4 (two opposite steps): against the trim that was +112.6, over the bound,
        where two reruns of the same code measured prefill's excess at -4.2 and under."""
        by_system = {s.name: instance_growth(s.growth) for s in self.systems}
        reference = by_system.get("colocated", {}).get("colocated")
        if reference is None or "pd" not in by_system:
            return {}
        reference = max(reference, 0.0)
        return {instance: value - reference for instance, value in by_system["pd"].items()}

    def summary(self) -> str:
        s = self.settings
        lines = [
            f"soak: {s.requests} requests per system after {s.warmup_requests} of warm-up, "
            f"concurrency {s.concurrency}, prefix caching {'on' if s.prefix_caching else 'off'}, "
            f"tcmalloc {self.tcmalloc_library or 'no'}; RSS every {s.sampling_interval} requests"
            + "".join(f"; {name}={value}" for name, value in s.engine_env),
            growth_table(self.growth_rows()),
        ]
        excess = self.excess_over_colocated()
        if excess:
            lines.append(
                "P/D growth over colocated's (MiB per 1,000 requests, last half): "
                + ", ".join(f"{k} {v:+.1f}" for k, v in excess.items())
            )
        for system in self.systems:
            lines.append(
                f"{system.name}: {system.completed} requests in {system.load_s:.0f} s, "
                f"{system.failed_requests} failed; transfers {system.transfers or '-'}"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "settings": asdict(self.settings),
            "tcmalloc_library": self.tcmalloc_library,
            "log_dir": self.log_dir,
            "systems": [system.to_dict() for system in self.systems],
            "excess_over_colocated": self.excess_over_colocated(),
            "problems": self.problems(),
            "summary": self.summary(),
        }


def _kv_usage(url: str) -> float:
    return metric_sum(metrics_text(url), "vllm:kv_cache_usage_perc")


def _settle(system: BenchSystem, result: SystemSoak) -> None:
    """After the load: which instances died, which still hold KV blocks after ``SETTLE_S``."""
    urls = system.instances()
    result.dead = [name for name, url in urls.items() if not http_ok(f"{url}/health", 30)]
    deadline = time.monotonic() + SETTLE_S
    for name, url in urls.items():
        if name in result.dead:
            continue
        while (usage := _kv_usage(url)) > 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        if usage > 0:
            result.held_kv[name] = usage


def _transfer_delta(system: BenchSystem, before: dict[str, int]) -> dict[str, int]:
    if not isinstance(system, OursSystem):
        return {}
    time.sleep(2)  # the last step's statistics reach the API server after its outputs
    after = system.deployment.transfer_totals()
    return {name: count - before.get(name, 0) for name, count in after.items()}


def soak_system(
    system: BenchSystem,
    result: SystemSoak,
    model: str,
    vocabulary: list[int],
    settings: SoakSettings,
    library: str | None = None,
) -> None:
    """Start, warm up, load while sampling, and check one system (the caller stops it);
    ``library``: the preloaded allocator every process must have mapped."""
    print(f"[{system.name}] starting: {system.description}", flush=True)
    started = system.start(settings.ready_timeout_s)
    print(f"[{system.name}] ready after {started:.1f} s", flush=True)

    def bodies(first_index: int, count: int) -> list[dict[str, Any]]:
        requests = draw_requests(count, settings.seed, settings.shared_prefix_share, first_index)
        return [request_body(model, prompt_ids(r, vocabulary, settings.seed), r) for r in requests]

    def load(batch: list[dict[str, Any]], on_completed: Callable[[int], None]) -> Any:
        return asyncio.run(
            run_load(
                system.url,
                batch,
                concurrency=settings.concurrency,
                request_timeout_s=settings.request_timeout_s,
                on_completed=on_completed,
            )
        )

    warmup = load(bodies(_WARMUP_INDEX, settings.warmup_requests), lambda done: None)
    if warmup.errors:
        raise RuntimeError(f"{len(warmup.errors)} warm-up requests failed: {warmup.errors[:3]}")
    groups = system.named_process_groups()
    result.pids = pids_by_process(groups)
    if library is not None:
        result.without_tcmalloc = [
            label
            for label, pids in result.pids.items()
            if not all(maps_library(pid, library) for pid in pids)
        ]
    transfers_before = system.deployment.transfer_totals() if isinstance(system, OursSystem) else {}
    measured = bodies(0, settings.requests)
    load_started = time.monotonic()

    def sample(done: int) -> None:
        seconds = time.monotonic() - load_started
        result.samples.append(RssSample(done, round(seconds, 3), rss_by_process(groups)))

    def on_completed(done: int) -> None:
        if done % settings.sampling_interval == 0 or done == len(measured):
            sample(done)
            if done % (10 * settings.sampling_interval) == 0:
                total = sum(result.samples[-1].rss_mib.values())
                print(f"[{system.name}] {done} requests, RSS {total:.0f} MiB in all", flush=True)

    sample(0)
    outcome = load(measured, on_completed)
    result.completed = outcome.completed
    result.failed_requests = len(outcome.errors)
    result.first_errors = outcome.errors[:5]
    result.load_s = outcome.wall_s
    _settle(system, result)
    result.transfers = _transfer_delta(system, transfers_before)


def make_system(
    name: str, engine: EngineSettings, settings: SoakSettings, log_dir: Path
) -> BenchSystem:
    if name == "colocated":
        return ColocatedSystem(engine, settings.colocated_tp, log_dir)
    # How long prefill holds a request's KV for decode: past the longest request.
    hold_s = int(settings.request_timeout_s) + 30
    return OursSystem(engine, settings.prefill_tp, settings.decode_tp, log_dir, hold_s, name="pd")


def run_soak(settings: SoakSettings) -> SoakReport:
    """Soak every system of ``settings`` in turn; see the module docstring."""
    log_dir = Path(settings.log_dir or tempfile.mkdtemp(prefix="vam-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    library = find_tcmalloc() if settings.tcmalloc else None
    model = str(build_tiny_model(TinyModelSpec(num_kv_heads=2, dtype="float32")))
    vocabulary = regular_token_ids(model)
    engine = EngineSettings(
        model=model,
        prefix_caching=settings.prefix_caching,
        env={**(preload_env(library) if library else {}), **dict(settings.engine_env)},
        worker_process=settings.worker_process,
    )
    print(f"model {model}; logs in {log_dir}; tcmalloc: {library or 'no'}", flush=True)
    report = SoakReport(settings, library, [], str(log_dir))
    for name in settings.systems:
        result = SystemSoak(name)
        report.systems.append(result)
        system = None
        try:
            system = make_system(name, engine, settings, log_dir)
            result.description = system.description
            soak_system(system, result, model, vocabulary, settings, library)
            result.status = "ok"
        except Exception as error:
            result.status = "failed"
            result.error = f"{type(error).__name__}: {error}"
            print(f"[{name}] FAILED: {result.error}", file=sys.stderr, flush=True)
            traceback.print_exc(file=sys.stderr)
        finally:
            if system is not None:
                try:
                    system.stop()
                except Exception as error:
                    result.status = "failed"
                    result.error = f"{result.error or ''}; stop failed: {error}"
            print(f"[{name}] stopped", flush=True)
    return report


def _systems(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names or set(names) - set(SYSTEMS):
        raise argparse.ArgumentTypeError(f"a comma-separated subset of {','.join(SYSTEMS)}")
    return names


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError("on or off")
    return text == "on"


def _name_value(text: str) -> tuple[str, str]:
    name, equals, value = text.partition("=")
    if not equals or not name:
        raise argparse.ArgumentTypeError("NAME=VALUE")
    return name, value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = make_parser("benchmarks.e2e.soak", __doc__)
    defaults = SoakSettings()
    parser.add_argument("--requests", type=int, default=defaults.requests, help="per system")
    parser.add_argument(
        "--concurrency", type=int, default=defaults.concurrency, help="clients, closed loop"
    )
    parser.add_argument(
        "--systems",
        type=_systems,
        default=",".join(SYSTEMS),
        help=f"comma-separated subset of {','.join(SYSTEMS)}, run one after the other",
    )
    parser.add_argument(
        "--prefix-caching", type=_on_off, default="on", help="vLLM's prefix caching: on or off"
    )
    parser.add_argument(
        "--tcmalloc",
        action="store_true",
        help="LD_PRELOAD tcmalloc in every process (found with ldconfig -p; Debian/Ubuntu: "
        "apt-get install libtcmalloc-minimal4)",
    )
    parser.add_argument(
        "--shared-prefix-share",
        type=float,
        default=defaults.shared_prefix_share,
        help="share of prompts behind a shared 64-token prefix (0: all unique from the start)",
    )
    parser.add_argument(
        "--warmup-requests",
        type=int,
        default=defaults.warmup_requests,
        help="unmeasured requests per system before the first sample",
    )
    parser.add_argument(
        "--sample-every", type=int, default=None, help="requests between RSS samples (~100 per run)"
    )
    parser.add_argument("--worker-process", action="store_true", help="TP 1 in a worker process")
    parser.add_argument(
        "--engine-env",
        type=_name_value,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for every process of every system (repeatable), e.g. "
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY=0",
    )
    parser.add_argument("--prefill-tp", type=int, default=1, help="P/D prefill's TP")
    parser.add_argument("--decode-tp", type=int, default=1, help="P/D decode's TP")
    parser.add_argument("--colocated-tp", type=int, default=1, help="colocated instance's TP")
    parser.add_argument("--seed", type=int, default=0, help="of the request mix")
    parser.add_argument("--log-dir", default=None, help="server logs; a new temp dir if not given")
    add_json_arg(parser, "the samples and the table (and the PNG beside it)")
    return parser.parse_args(argv)


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # every `finally` stops its servers


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    settings = SoakSettings(
        requests=args.requests,
        concurrency=args.concurrency,
        systems=args.systems,
        prefix_caching=args.prefix_caching,
        tcmalloc=args.tcmalloc,
        shared_prefix_share=args.shared_prefix_share,
        warmup_requests=args.warmup_requests,
        sample_every=args.sample_every,
        seed=args.seed,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        colocated_tp=args.colocated_tp,
        worker_process=args.worker_process,
        engine_env=tuple(args.engine_env),
        log_dir=args.log_dir,
    )
    started = time.time()
    report = run_soak(settings)
    print()
    print(report.summary())
    problems = report.problems()
    for problem in problems:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    png = args.json.with_suffix(".png") if args.json else Path(report.log_dir) / "soak.png"
    runs = {system.name: system.samples for system in report.systems if system.samples}
    if runs:
        title = (
            f"RSS growth per process, {settings.requests} requests, prefix caching "
            f"{'on' if settings.prefix_caching else 'off'}, tcmalloc "
            f"{'yes' if report.tcmalloc_library else 'no'}"
        )
        try:
            print(f"curves written to {soak_plot.write_png(runs, png, title)}")
        except ImportError as error:  # Pillow comes with vLLM; without it only the PNG is lost
            print(f"no PNG ({error})", file=sys.stderr)
    if args.json:
        document = {
            **report.to_dict(),
            "environment": environment(),
            "started_at_unix": started,
            "wall_s": time.time() - started,
        }
        print(f"JSON written to {write_json(args.json, document)}")
    print(f"result {'VALID' if not problems else 'INVALID'}; logs in {report.log_dir}")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
