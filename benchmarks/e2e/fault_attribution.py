"""Which injected fault caused each error and each failed pull of a chaos run (pure, no I/O).

A fault is a window of the run: from its injection to its end (a killed prefill until it is back,
a frozen one until it is thawed, a slowed link until the load stops), widened by ``lag`` after
its end for what it still causes (a pull that waited out a claim's timeout). An error is caused
by every fault whose window meets its request's lifetime; a failed pull, logged by decode's
workers (``KV load failed for request R (kind): reason``, with the log's wall-clock stamp), by
every fault whose window holds its stamp. What no fault explains is "unattributed": a defect,
not chaos.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping
from dataclasses import dataclass

#: The start and end event of each fault, as the chaos run names them.
FAULT_EVENTS = {
    "prefill B killed": "prefill B back",
    "prefill A frozen": "prefill A thawed",
    "link slowed": None,  # until the load stops
}
UNATTRIBUTED = "unattributed"

#: vLLM's log line prefix: ``(EngineCore pid=1) WARNING 12-06 12:34:42 [worker.py:384] ...``
_FAILED_PULL = re.compile(
    r"(?P<month>\d\d)-(?P<day>\d\d) (?P<time>\d\d:\d\d:\d\d)\s+\[[^\]]*\]\s+"
    r"KV load failed for request (?P<request>\S+) \((?P<kind>[a-z_]+)\): (?P<reason>.*)"
)


@dataclass(frozen=True)
class FaultWindow:
    name: str
    start: float
    end: float


def fault_windows(events: Mapping[str, float], load_end: float, lag: float) -> list[FaultWindow]:
    """Windows of the faults that happened, in seconds since the load started."""
    windows = []
    for fault, ended_by in FAULT_EVENTS.items():
        if fault not in events:
            continue
        end = events.get(ended_by, load_end) if ended_by else load_end
        windows.append(FaultWindow(fault, events[fault], end + lag))
    return windows


def causes(start: float, end: float, windows: list[FaultWindow]) -> list[str]:
    """The faults whose windows meet ``[start, end]`` (``[UNATTRIBUTED]`` when none does)."""
    found = [w.name for w in windows if w.start <= end and start <= w.end]
    return found or [UNATTRIBUTED]


@dataclass(frozen=True)
class FailedPull:
    seconds: float  # since the load started
    request: str
    kind: str
    reason: str


def failed_pulls(log_text: str, load_started_wall: datetime.datetime) -> list[FailedPull]:
    """Decode's logged failed pulls, each stamped in seconds since the load started (the log's
    stamps are whole seconds of local time, in the year the load started)."""
    found = []
    for match in _FAILED_PULL.finditer(log_text):
        stamp = datetime.datetime.strptime(
            f"{load_started_wall.year}-{match['month']}-{match['day']} {match['time']}",
            "%Y-%m-%d %H:%M:%S",
        )
        seconds = (stamp - load_started_wall.replace(microsecond=0)).total_seconds()
        found.append(FailedPull(seconds, match["request"], match["kind"], match["reason"]))
    return found


def count_by_cause(items: list[tuple[float, float]], windows: list[FaultWindow]) -> dict[str, int]:
    """How many of ``items`` (each a ``(start, end)`` in seconds) each fault explains; an item
    that two faults explain counts for both."""
    counts: dict[str, int] = {}
    for start, end in items:
        for cause in causes(start, end, windows):
            counts[cause] = counts.get(cause, 0) + 1
    return counts
