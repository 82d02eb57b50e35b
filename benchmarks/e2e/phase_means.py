"""Where a cell's time to first token went: mean seconds per phase, from the instances' histograms.

Not the per-request timeline (:mod:`vllm_ascend_mooncake.timeline`, joined by
``request_timeline.py``): these are means over a cell's requests of histograms every instance
exports anyway, for every system compared, where the timeline follows each request of ours.

Before and after each cell the benchmark reads every instance's ``/metrics``; the difference of a
histogram's ``_sum`` and ``_count`` is the mean of what that cell observed. vLLM's own request
histograms exist on every system (so vLLM's connector and the colocated instance get the vLLM
phases too); our connector adds ``vllm:mooncake_hetero_hold_delay_seconds`` on prefill and
``vllm:mooncake_hetero_pull_phase_seconds{phase=...}`` on decode. The phases overlap in time
(with overlapped legs decode's grant wait spans prefill's whole leg), so they explain TTFT rather
than add up to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from vllm_ascend_mooncake.timeline import PHASES, PULL_PHASE_METRIC


@dataclass(frozen=True)
class Phase:
    label: str  # what the report prints
    role: str  # which instance: "prefill", "decode" or "colocated"
    metric: str  # a histogram's name, without _sum/_count
    phase: str | None = None  # the value of its "phase" label, when it has one


PHASES_SHOWN = (
    Phase("prefill: queued", "prefill", "vllm:request_queue_time_seconds"),
    Phase("prefill: computing", "prefill", "vllm:request_prefill_time_seconds"),
    Phase("prefill: hold registered after", "prefill", "vllm:mooncake_hetero_hold_delay_seconds"),
    *(
        Phase(f"decode: pull {name.replace('_', ' ')}", "decode", PULL_PHASE_METRIC, name)
        for name in PHASES
    ),
    Phase("decode: queued (incl. KV load)", "decode", "vllm:request_queue_time_seconds"),
    Phase("decode: arrival to first token", "decode", "vllm:time_to_first_token_seconds"),
    Phase("colocated: queued", "colocated", "vllm:request_queue_time_seconds"),
    Phase("colocated: arrival to first token", "colocated", "vllm:time_to_first_token_seconds"),
)

Snapshot = dict[Phase, tuple[float, float]]  # phase -> (sum, count)


def snapshot(instances: Mapping[str, str], timeout_s: float = 10.0) -> Snapshot:
    """Current (sum, count) of every shown phase on ``instances`` (role -> base URL)."""
    totals: Snapshot = {}
    for role, url in instances.items():
        wanted = [p for p in PHASES_SHOWN if p.role == role]
        if not wanted:
            continue
        try:
            text = httpx.get(f"{url}/metrics", timeout=timeout_s).text
        except httpx.HTTPError:
            continue  # a missing snapshot leaves the cell's phases out; the run goes on
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                for phase in wanted:
                    if sample.name not in (f"{phase.metric}_sum", f"{phase.metric}_count"):
                        continue
                    if phase.phase is not None and sample.labels.get("phase") != phase.phase:
                        continue
                    total, count = totals.get(phase, (0.0, 0.0))
                    if sample.name.endswith("_sum"):
                        total += sample.value
                    else:
                        count += sample.value
                    totals[phase] = (total, count)
    return totals


def mean_ms(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """Mean milliseconds per observation between two snapshots, by label (observed ones only)."""
    means = {}
    for phase, (total, count) in after.items():
        total0, count0 = before.get(phase, (0.0, 0.0))
        if count > count0:
            means[phase.label] = round(1e3 * (total - total0) / (count - count0), 2)
    return means


def phase_means_table(cells: list[tuple[str, int, int, dict[str, float]]]) -> str:
    """One block per (system, prompt length, concurrency): mean ms per phase."""
    lines = []
    for system, prompt_len, concurrency, means in cells:
        if not means:
            continue
        lines.append(f"{system}, prompt {prompt_len}, concurrency {concurrency}:")
        width = max(len(label) for label in means)
        lines.extend(f"  {label:<{width}}  {ms:9.2f} ms" for label, ms in means.items())
    return "\n".join(lines)
