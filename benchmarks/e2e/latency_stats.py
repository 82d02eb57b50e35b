"""Percentiles and ratios of latency samples, kept free of numpy so the smoke test stays fast.

A benchmark cell has a handful of requests, so the percentile method matters: this uses linear
interpolation between closest ranks (numpy's default), which makes p99 of four samples close to,
but not exactly, the maximum. Reports say how many samples each percentile rests on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


def percentile(samples: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``samples`` by linear interpolation; None if empty."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be within [0, 100], got {q}")
    if not samples:
        return None
    ordered = sorted(samples)
    position = (len(ordered) - 1) * q / 100.0
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    fraction = position - lower
    return ordered[lower] + (ordered[upper] - ordered[lower]) * fraction


@dataclass(frozen=True)
class LatencySummary:
    """p50/p99/mean of one latency metric, in milliseconds, the sample count behind them and
    the spread (interquartile range: p25 to p75), which says whether two systems' p50 differ
    by more than the noise of either."""

    count: int
    p50_ms: float | None
    p99_ms: float | None
    mean_ms: float | None
    p25_ms: float | None = None
    p75_ms: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize_seconds(samples_s: Sequence[float]) -> LatencySummary:
    """Summarize latencies given in seconds as milliseconds."""
    if not samples_s:
        return LatencySummary(count=0, p50_ms=None, p99_ms=None, mean_ms=None)
    samples_ms = [value * 1000.0 for value in samples_s]
    return LatencySummary(
        count=len(samples_ms),
        p50_ms=percentile(samples_ms, 50.0),
        p99_ms=percentile(samples_ms, 99.0),
        mean_ms=sum(samples_ms) / len(samples_ms),
        p25_ms=percentile(samples_ms, 25.0),
        p75_ms=percentile(samples_ms, 75.0),
    )


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator
