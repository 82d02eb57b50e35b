"""Read the connectors' "KV Transfer metrics" log lines, to prove a P/D run really moved KV.

A P/D deployment whose decode silently recomputed every prompt would still answer correctly (and
with a very different TTFT), so the benchmark checks the logs. vLLM logs one line per stats
interval, with the counts of that interval only, as ``KV Transfer metrics: Key=value, ...``:
``MooncakeHeteroConnector`` on decode ("Num successful pulls", "Num failed pulls"), vLLM's
``MooncakeConnector`` on prefill, which pushes ("Num successful transfers", "Num failed
transfers", "Num failed recvs", "Num KV expired reqs"). Totals are the sums over all lines.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

_METRICS_LINE = re.compile(r"KV Transfer metrics: (?P<fields>.*)$")
_COUNT_PREFIX = "Num "
_ERROR_LINE = re.compile(r"\bERROR\b|^E\d{4} ")  # vLLM's logger, Mooncake's glog
#: Mooncake logs this at error level when an engine starts; it means nothing (see the recipe).
_HARMLESS_ERRORS = ("Local segment descriptor not found",)
#: Mooncake's TCP transport gives up on a synchronous batch after 30 s without progress.
_MOONCAKE_TIMEOUT = "Sync batch data transfer timeout"


def transfer_count_totals(log_text: str) -> dict[str, int]:
    """Sum every ``Num ...=N`` field over all metrics lines of one log."""
    totals: Counter[str] = Counter()
    for line in log_text.splitlines():
        match = _METRICS_LINE.search(line)
        if not match:
            continue
        for field in match.group("fields").split(", "):
            name, separator, value = field.partition("=")
            if not separator or not name.startswith(_COUNT_PREFIX):
                continue
            try:
                totals[name.strip()] += int(float(value))
            except ValueError:
                continue
    return dict(totals)


def weighted_mean_field(log_text: str, count_key: str, mean_key: str) -> float | None:
    """Mean of a per-line average (e.g. "Avg pull time (ms)") weighted by that line's count.

    Lines report averages over their interval only, so the run's mean is the count-weighted mean
    of the lines; None when no line has both fields and a non-zero count.
    """
    weighted_sum = 0.0
    total = 0
    for line in log_text.splitlines():
        match = _METRICS_LINE.search(line)
        if not match:
            continue
        fields = dict(field.partition("=")[::2] for field in match.group("fields").split(", "))
        try:
            count = int(float(fields[count_key]))
            mean = float(fields[mean_key])
        except (KeyError, ValueError):
            continue
        weighted_sum += count * mean
        total += count
    return weighted_sum / total if total else None


def error_lines(log_text: str, limit: int = 5) -> list[str]:
    """The first ``limit`` lines logged at error level (evidence for a failed check)."""
    lines = [
        line.strip()
        for line in log_text.splitlines()
        if _ERROR_LINE.search(line) and not any(noise in line for noise in _HARMLESS_ERRORS)
    ]
    return lines[:limit]


def mooncake_timeouts(log_text: str) -> int:
    """How many Mooncake batch transfers timed out (each one stalled its request ~30 s)."""
    return sum(_MOONCAKE_TIMEOUT in line for line in log_text.splitlines())


def read_log(path: Path) -> str:
    """A log file's text, or an empty string if it is missing."""
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
