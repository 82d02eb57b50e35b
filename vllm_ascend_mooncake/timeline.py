"""Per-request P/D timeline: when each phase of a request ended, cheap enough to keep on.

A P/D request's time to first token splits into phases that different fixes address, spread over
four processes: the proxy (received, legs sent, answers, first token relayed), prefill's
scheduler and workers (scheduled, finished, hold registered), decode's workers (pull submitted,
granted, first byte read, last byte landed, fix-up done, reported to vLLM) and decode's scheduler
(vLLM learned the load finished, first decode step scheduled). Each process writes one
``request timeline {json}`` log line per request with wall-clock stamps, keyed by the transfer id
both instances hold the KV under, so a reader (``benchmarks/e2e/request_timeline.py``) can join
them. The lines are logged at DEBUG, or at INFO when ``VAM_TIMELINE_LOG=1``, so they can be
switched on without vLLM's whole debug output. Wall clocks of different hosts differ: join
across hosts only as far as their clocks agree.

Within a decode worker a pull also keeps :class:`PullTimeline` (monotonic), which feeds the
``vllm:mooncake_hetero_pull_phase_seconds{phase}`` histograms whether or not lines are logged.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Phase names, in order, as exported (``vllm:mooncake_hetero_pull_phase_seconds{phase=...}``).
PHASES = ("grant_wait", "lane_wait", "read", "fixup", "report_wait")
#: The histogram the pull phases are exported as, one ``phase`` label value per name of PHASES.
PULL_PHASE_METRIC = "vllm:mooncake_hetero_pull_phase_seconds"

#: Set to 1 to log the per-request lines at INFO instead of DEBUG.
TIMELINE_LOG_ENV = "VAM_TIMELINE_LOG"
#: What starts every timeline log line's message (the JSON record follows it).
LINE_MARKER = "request timeline "


def wall_clock(monotonic_s: float) -> float:
    """A ``time.monotonic()`` reading as wall-clock seconds (comparable across processes)."""
    return time.time() - (time.monotonic() - monotonic_s)


class TimelineLog:
    """Writes one process's timeline records through ``logger``."""

    def __init__(self, logger: logging.Logger, environ: Mapping[str, str] | None = None) -> None:
        self._logger = logger
        env = os.environ if environ is None else environ
        self._level = logging.INFO if env.get(TIMELINE_LOG_ENV) == "1" else logging.DEBUG

    @property
    def enabled(self) -> bool:
        return self._logger.isEnabledFor(self._level)

    def emit(
        self,
        source: str,
        transfer_id: str,
        stamps: Mapping[str, float | None],
        **fields: Any,
    ) -> None:
        """Log ``stamps`` (name -> wall-clock seconds; None ones left out) of one request."""
        if not self.enabled:
            return
        record = {
            "source": source,
            "transfer": transfer_id,
            **fields,
            "stamps": {name: round(t, 6) for name, t in stamps.items() if t is not None},
        }
        self._logger.log(
            self._level, "%s%s", LINE_MARKER, json.dumps(record, separators=(",", ":"))
        )


def parse_timeline_line(line: str) -> dict[str, Any] | None:
    """The record a timeline log line carries, or None for any other line."""
    at = line.find(LINE_MARKER)
    if at < 0:
        return None
    try:
        record = json.loads(line[at + len(LINE_MARKER) :])
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("stamps"), dict):
        return None
    return record


@dataclass
class PullTimeline:
    """Monotonic timestamps of the ends of a pull's phases (None until reached)."""

    submitted: float  # the worker received the pull order (the step after vLLM admitted it)
    granted: float | None = None  # every prefill rank this rank reads granted its read lease
    first_read: float | None = None  # a read lane started on it
    landed: float | None = None  # the last byte landed
    fixed_up: float | None = None  # the layout fix-up finished; the pull is ready to report
    reported: float | None = None  # handed to vLLM through get_finished

    def mark_first_read(self, now: float) -> None:
        if self.first_read is None or now < self.first_read:
            self.first_read = now

    def phases(self) -> dict[str, float]:
        """Seconds spent in each phase reached so far (a missing end leaves its phase out)."""
        ends = (self.granted, self.first_read, self.landed, self.fixed_up, self.reported)
        result: dict[str, float] = {}
        start = self.submitted
        for name, end in zip(PHASES, ends, strict=True):
            if end is None:
                break
            result[name] = max(0.0, end - start)
            start = end
        return result

    def wall_stamps(self) -> dict[str, float | None]:
        """The stamps as wall-clock seconds, for a timeline record."""
        names = ("submitted", "granted", "first_read", "landed", "fixed_up", "reported")
        offset = time.time() - time.monotonic()  # once, so the gaps stay exact
        return {
            name: None if getattr(self, name) is None else offset + getattr(self, name)
            for name in names
        }
