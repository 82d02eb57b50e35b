"""Per-request timeline of one decode rank's pull: when each phase ended, cheap enough to keep on.

A pull's time to KV splits into phases that different fixes address: waiting for prefill's grant
(with overlapped legs this includes prefill computing the prompt, and always the prefill engine
step that registers the hold), waiting for a read lane (other requests' reads from the same
peer), reading, the layout fix-up, and waiting for vLLM to ask for finished loads. The receiver
stamps the ends with ``time.monotonic()``; the stats turn them into Prometheus histograms and a
debug log line per pull, joined to prefill's side by the transfer id.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Phase names, in order, as exported (``vllm:mooncake_hetero_pull_phase_seconds{phase=...}``).
PHASES = ("grant_wait", "lane_wait", "read", "fixup", "report_wait")


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
