"""Per-cell latency summaries, the ratios between systems, and their text tables.

Pure functions over :class:`~benchmarks.e2e.load_generator.CellResult`, so they can be tested
without servers. A request counts as successful only if its stream finished cleanly *and* produced
exactly ``max_tokens`` tokens (``ignore_eos`` guarantees that on a healthy system); percentiles
are taken over successful requests only, and the failures are counted next to them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .latency_stats import LatencySummary, ratio, summarize_seconds
from .load_generator import CellResult
from .sse_timing import StreamTiming

#: Systems in report order. ``ours`` is our proxy's default (the first token from prefill,
#: decode continuing from it); ``ours_decode_first`` the same deployment with
#: ``--first-token decode`` (decode samples the first token, legs overlapped once prefill is
#: known); ``ours_serial`` that with ``--serial-legs`` too; ``vllm_mooncake`` vLLM's
#: MooncakeConnector behind its example proxy; ``nixl`` vLLM's NixlConnector behind vllm-router.
SYSTEM_ORDER = ("colocated", "ours", "ours_decode_first", "ours_serial", "vllm_mooncake", "nixl")
DEFAULT_SYSTEMS = ("colocated", "ours", "vllm_mooncake", "nixl")
#: The peers a user could pick instead of ours.
PEERS = ("vllm_mooncake", "nixl")
RATIO_METRICS = (
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
)
#: A ratio to a latency below this measures how events were bunched in transit, not speed
#: (inter-chunk gaps of ~0 ms are chunks that arrived in one read); such ratios are omitted.
MIN_RATIO_DENOMINATOR_MS = 1.0
RATIO_PAIRS = (
    ("ours", "colocated"),
    ("ours", "vllm_mooncake"),
    ("ours", "nixl"),
    ("ours", "ours_decode_first"),
    ("ours_decode_first", "ours_serial"),
    ("vllm_mooncake", "colocated"),
    ("nixl", "colocated"),
)
#: The targets the benchmark judges (issue #28), each a bound on one ratio in the cells it
#: applies to: (name, numerator, denominators, metric, bound, concurrencies or None for all).
TARGETS = (
    (
        "TTFT p50 ours/colocated <= 1.3 at concurrency 1 and 2",
        "ours",
        ("colocated",),
        "ttft_p50_ms",
        1.3,
        (1, 2),
    ),
    ("TTFT p50 ours/each peer <= 0.5", "ours", PEERS, "ttft_p50_ms", 0.5, None),
    ("ITL p99 ours/colocated <= 1.5", "ours", ("colocated",), "itl_p99_ms", 1.5, None),
)


@dataclass(frozen=True)
class CellSummary:
    """TTFT, inter-token latency and end-to-end latency of one (system, length, concurrency)."""

    system: str
    prompt_len: int
    concurrency: int
    requests: int
    succeeded: int
    failed: int
    not_started: int
    ttft: LatencySummary
    itl: LatencySummary
    tpot: LatencySummary
    e2e: LatencySummary
    wall_s: float
    first_error: str | None
    #: Content chunks per successful request: below ``max_tokens`` when the server or the
    #: network coalesced several decode steps into one read, which shrinks the ITL sample.
    mean_content_chunks: float | None
    #: Per request (successful or not): TTFT and end-to-end ms, chunk and token counts, error.
    per_request: tuple[dict[str, Any], ...] = ()
    #: Mean ms per phase of the cell's requests, from the instances' histograms (phase_means.py).
    phase_means_ms: dict[str, float] = field(default_factory=dict)
    #: Wall-clock start and end of the cell's load, which picks its requests' timeline lines.
    window: tuple[float, float] = (0.0, 0.0)
    #: Critical-path breakdown joined from the instances' timeline lines (request_timeline.py).
    request_timeline: dict[str, Any] | None = None

    def metric(self, name: str) -> float | None:
        """``ttft_p50_ms``-style lookup used by the ratio table."""
        kind, _, stat = name.partition("_")
        summary: LatencySummary = getattr(self, kind)
        return getattr(summary, stat)

    def to_dict(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "prompt_len": self.prompt_len,
            "concurrency": self.concurrency,
            "requests": self.requests,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "not_started": self.not_started,
            "ttft": self.ttft.to_dict(),
            "itl": self.itl.to_dict(),
            "tpot": self.tpot.to_dict(),
            "e2e": self.e2e.to_dict(),
            "wall_s": self.wall_s,
            "first_error": self.first_error,
            "mean_content_chunks": self.mean_content_chunks,
            "per_request": list(self.per_request),
            "phase_means_ms": self.phase_means_ms,
            "request_timeline": self.request_timeline,
        }


def summarize_cell(
    system: str, prompt_len: int, concurrency: int, result: CellResult, max_tokens: int
) -> CellSummary:
    """Summarize one cell; a stream with the wrong number of tokens counts as failed."""
    good = []
    errors = []
    for timing in result.timings:
        if not timing.succeeded:
            errors.append(timing.error or "stream ended without [DONE] or without tokens")
        elif len(timing.token_ids) != max_tokens:
            errors.append(f"produced {len(timing.token_ids)} tokens, expected {max_tokens}")
        else:
            good.append(timing)
    return CellSummary(
        system=system,
        prompt_len=prompt_len,
        concurrency=concurrency,
        requests=len(result.timings) + result.not_started,
        succeeded=len(good),
        failed=len(errors),
        not_started=result.not_started,
        ttft=summarize_seconds([t.ttft_s for t in good if t.ttft_s is not None]),
        itl=summarize_seconds([gap for t in good for gap in t.inter_token_gaps_s]),
        tpot=summarize_seconds([t.tpot_s for t in good if t.tpot_s is not None]),
        e2e=summarize_seconds([t.e2e_s for t in good if t.e2e_s is not None]),
        wall_s=result.wall_s,
        first_error=errors[0] if errors else None,
        mean_content_chunks=(
            sum(len(t.content_chunk_times_s) for t in good) / len(good) if good else None
        ),
        per_request=tuple(_request_record(timing) for timing in result.timings),
    )


def _request_record(timing: StreamTiming) -> dict[str, Any]:
    return {
        "ttft_ms": None if timing.ttft_s is None else timing.ttft_s * 1000.0,
        "e2e_ms": None if timing.e2e_s is None else timing.e2e_s * 1000.0,
        "content_chunks": len(timing.content_chunk_times_s),
        "tokens": len(timing.token_ids),
        "error": timing.error,
    }


def ratio_rows(summaries: Sequence[CellSummary]) -> list[dict[str, Any]]:
    """For each (length, concurrency): every metric's ratio for each pair of systems present."""
    by_key = {(s.system, s.prompt_len, s.concurrency): s for s in summaries}
    cells = sorted({(s.prompt_len, s.concurrency) for s in summaries})
    rows = []
    for prompt_len, concurrency in cells:
        row: dict[str, Any] = {"prompt_len": prompt_len, "concurrency": concurrency}
        for numerator, denominator in RATIO_PAIRS:
            top = by_key.get((numerator, prompt_len, concurrency))
            bottom = by_key.get((denominator, prompt_len, concurrency))
            if top is None or bottom is None:
                continue
            for metric in RATIO_METRICS:
                bottom_value = bottom.metric(metric)
                if bottom_value is not None and bottom_value < MIN_RATIO_DENOMINATOR_MS:
                    bottom_value = None
                row[f"{numerator}/{denominator}:{metric}"] = ratio(top.metric(metric), bottom_value)
        rows.append(row)
    return rows


def targets(summaries: Sequence[CellSummary]) -> list[dict[str, Any]]:
    """Each of :data:`TARGETS` judged in every cell where both systems ran: the ratio per cell
    and whether the bound holds in all of them (False when no cell could be judged)."""
    by_key = {(s.system, s.prompt_len, s.concurrency): s for s in summaries}
    verdicts = []
    for name, numerator, denominators, metric, bound, concurrencies in TARGETS:
        cells = []
        for (system, prompt_len, concurrency), top in sorted(by_key.items()):
            if system != numerator or (concurrencies and concurrency not in concurrencies):
                continue
            for denominator in denominators:
                bottom = by_key.get((denominator, prompt_len, concurrency))
                if bottom is None:
                    continue
                value = ratio(top.metric(metric), bottom.metric(metric))
                cells.append(
                    {
                        "prompt_len": prompt_len,
                        "concurrency": concurrency,
                        "versus": denominator,
                        "ratio": value,
                        "met": value is not None and value <= bound,
                    }
                )
        verdicts.append(
            {"target": name, "cells": cells, "met": bool(cells) and all(c["met"] for c in cells)}
        )
    return verdicts


def targets_table(verdicts: Sequence[dict[str, Any]]) -> str:
    """One line per target and cell: the ratio and whether it meets the bound."""
    lines = []
    for verdict in verdicts:
        lines.append(f"{verdict['target']}: {'met' if verdict['met'] else 'NOT met'}")
        for cell in verdict["cells"]:
            lines.append(
                f"  prompt {cell['prompt_len']:>5} conc {cell['concurrency']:>2} vs "
                f"{cell['versus']:<14} {_ratio(cell['ratio']):>6} {'ok' if cell['met'] else 'MISS'}"
            )
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _render(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = [
        "  ".join(cell.rjust(width) for cell, width in zip(header, widths, strict=True)),
        "  ".join("-" * width for width in widths),
    ]
    lines += [
        "  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True))
        for row in rows
    ]
    return "\n".join(lines)


def latency_table(summaries: Sequence[CellSummary]) -> str:
    """One row per (prompt length, concurrency, system), milliseconds."""
    order = {name: index for index, name in enumerate(SYSTEM_ORDER)}
    ordered = sorted(
        summaries,
        key=lambda s: (s.prompt_len, s.concurrency, order.get(s.system, len(order)), s.system),
    )
    header = (
        "prompt",
        "conc",
        "system",
        "ok/n",
        "TTFT p50",
        "TTFT p25-p75",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "TPOT p50",
        "TPOT p99",
        "E2E p50",
        "chunks",
    )
    rows = [
        (
            str(s.prompt_len),
            str(s.concurrency),
            s.system,
            f"{s.succeeded}/{s.requests}",
            _ms(s.ttft.p50_ms),
            f"{_ms(s.ttft.p25_ms)}-{_ms(s.ttft.p75_ms)}",
            _ms(s.ttft.p99_ms),
            _ms(s.itl.p50_ms),
            _ms(s.itl.p99_ms),
            _ms(s.tpot.p50_ms),
            _ms(s.tpot.p99_ms),
            _ms(s.e2e.p50_ms),
            "-" if s.mean_content_chunks is None else f"{s.mean_content_chunks:.1f}",
        )
        for s in ordered
    ]
    return _render(header, rows)


def ratio_table(rows: Sequence[dict[str, Any]]) -> str:
    """One row per (prompt length, concurrency, pair of systems): ratios of p50/p99."""
    header = ("prompt", "conc", "ratio", *(metric.removesuffix("_ms") for metric in RATIO_METRICS))
    table_rows = []
    for row in rows:
        for numerator, denominator in RATIO_PAIRS:
            keys = [f"{numerator}/{denominator}:{metric}" for metric in RATIO_METRICS]
            if keys[0] not in row:
                continue
            table_rows.append(
                (
                    str(row["prompt_len"]),
                    str(row["concurrency"]),
                    f"{numerator}/{denominator}",
                    *(_ratio(row[key]) for key in keys),
                )
            )
    return _render(header, table_rows)
