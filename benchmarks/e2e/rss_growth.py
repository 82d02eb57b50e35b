"""Telling a memory plateau from a leak: resident memory against requests served, fitted.

A soak samples the resident memory (VmRSS) of every process of a system every few requests.
A process whose memory only warms up (allocator arenas, caches filling once) grows early and
then stays flat; a leak grows with every request for as long as requests come. So the growth
that counts is the least-squares slope of RSS against requests completed over the *last half*
of the run, in MiB per 1,000 requests; the first half's slope is kept beside it to show the
warm-up. Pure: no ``/proc``, no engine (:mod:`.process_memory` reads the processes).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

#: vLLM's process titles (``setproctitle``, prefix ``VLLM_PROCESS_NAME_PREFIX``, "VLLM"):
#: ``VLLM::EngineCore``, ``VLLM::EngineCore_DP0``, ``VLLM::Worker_TP1``, ``VLLM::APIServer_0``.
_TITLE = re.compile(r"^\w+::(EngineCore|Worker|APIServer|DPCoordinator)(?:_(\w+))?")
_TITLE_ROLES = {
    "EngineCore": "engine-core",
    "Worker": "worker",
    "APIServer": "api-server",
    "DPCoordinator": "dp-coordinator",
}
#: Front processes by a module or program on their command line.
_PROXIES = ("vllm_ascend_mooncake.proxy", "benchmarks.e2e.mooncake_proxy", "vllm-router")


def process_role(cmdline: Sequence[str]) -> str:
    """What a process of a system is, from its ``/proc/<pid>/cmdline`` arguments: ``api-server``
    (``vllm serve``'s own process), ``engine-core``, ``worker``, ``dp-coordinator`` (a rank
    suffix kept: ``worker-tp1``, ``engine-core-dp0``), ``proxy``, ``resource-tracker``
    (multiprocessing's) or ``other``."""
    text = " ".join(cmdline).strip()
    title = _TITLE.match(text)
    if title:
        role = _TITLE_ROLES[title.group(1)]
        return f"{role}-{title.group(2).lower()}" if title.group(2) else role
    if any(proxy in text for proxy in _PROXIES):
        return "proxy"
    if "multiprocessing.resource_tracker" in text:
        return "resource-tracker"
    if "serve" in cmdline and "vllm" in text:
        return "api-server"
    return "other"


def process_label(instance: str, role: str) -> str:
    """A process's name in a report: its instance and its role (the role alone where the
    instance is named after it, as the proxy is)."""
    return role if instance == role else f"{instance} {role}"


def parse_vm_rss_kib(status_text: str) -> int | None:
    """VmRSS in KiB from a ``/proc/<pid>/status`` text; None when absent (a kernel thread, a
    zombie)."""
    for line in status_text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return None


@dataclass(frozen=True)
class RssSample:
    """One reading of a system: requests completed so far, seconds since the load began, and
    MiB resident per process label."""

    requests: int
    seconds: float
    rss_mib: Mapping[str, float]


def slope(points: Sequence[tuple[float, float]]) -> float | None:
    """The least-squares slope of y on x; None with fewer than two distinct x."""
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in points)
    return sxy / sxx


def halves(
    points: Sequence[tuple[float, float]],
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """The points of the first and of the last half of the run, split at half the last point's
    x (requests completed); the sample at the split belongs to both."""
    if not points:
        return [], []
    middle = max(x for x, _ in points) / 2
    return [p for p in points if p[0] <= middle], [p for p in points if p[0] >= middle]


def per_1000(points: Sequence[tuple[float, float]]) -> float | None:
    """MiB per 1,000 requests: the slope of (requests, MiB) points times 1,000."""
    fitted = slope(points)
    return None if fitted is None else fitted * 1000


@dataclass(frozen=True)
class Growth:
    """One process (or one instance's processes summed) of one system over a soak."""

    system: str
    process: str
    first_mib: float
    last_mib: float
    #: MiB per 1,000 requests over the first half (warm-up shows here)
    first_half_per_1000: float | None
    #: MiB per 1,000 requests over the last half: what a leak cannot hide from
    last_half_per_1000: float | None


def series(samples: Iterable[RssSample]) -> dict[str, list[tuple[float, float]]]:
    """Per process label, its (requests, MiB) points, in sample order; a label missing from a
    sample (the process was not there) just has no point there."""
    out: dict[str, list[tuple[float, float]]] = {}
    for sample in samples:
        for label, mib in sample.rss_mib.items():
            out.setdefault(label, []).append((float(sample.requests), mib))
    return out


def instance_of(label: str) -> str:
    """The instance part of a process label (``"prefill engine-core"`` -> ``"prefill"``)."""
    return label.split(" ", 1)[0]


def instance_totals(samples: Iterable[RssSample]) -> list[RssSample]:
    """The samples with each instance's processes summed (label ``"<instance> (all)"``)."""
    out = []
    for sample in samples:
        totals: dict[str, float] = {}
        for label, mib in sample.rss_mib.items():
            key = f"{instance_of(label)} (all)"
            totals[key] = totals.get(key, 0.0) + mib
        out.append(RssSample(sample.requests, sample.seconds, totals))
    return out


def growth(system: str, samples: Sequence[RssSample]) -> list[Growth]:
    """Every process's growth, then every instance's total, in label order."""
    rows = []
    for group in (samples, instance_totals(samples)):
        for label, points in sorted(series(group).items()):
            first, last = halves(points)
            rows.append(
                Growth(
                    system=system,
                    process=label,
                    first_mib=points[0][1],
                    last_mib=points[-1][1],
                    first_half_per_1000=per_1000(first),
                    last_half_per_1000=per_1000(last),
                )
            )
    return rows


def instance_growth(rows: Iterable[Growth]) -> dict[str, float]:
    """Last-half MiB per 1,000 requests of each instance's processes together, by instance."""
    return {
        instance_of(row.process): row.last_half_per_1000
        for row in rows
        if row.process.endswith(" (all)") and row.last_half_per_1000 is not None
    }


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}"


def growth_table(rows: Sequence[Growth]) -> str:
    """A Markdown table: system, process, RSS at the first and last sample, MiB per 1,000
    requests over each half."""
    lines = [
        "| system | process | RSS first (MiB) | RSS last (MiB) | MiB/1k req, first half "
        "| MiB/1k req, last half |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {row.system} | {row.process} | {row.first_mib:.0f} | {row.last_mib:.0f} | "
        f"{_fmt(row.first_half_per_1000)} | {_fmt(row.last_half_per_1000)} |"
        for row in rows
    ]
    return "\n".join(lines)
