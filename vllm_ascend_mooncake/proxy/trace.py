"""The proxy's side of a request's timeline (:mod:`..timeline`).

Wall-clock stamps of each step (received, prefill sent and answered, decode sent and answered,
first chunk, done), written as one log line once the answer is over and fed to the proxy's
metrics, keyed by the transfer id prefill holds the KV under, so that the proxy's line joins
the prefill's and decode's lines of the same request.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ..timeline import TimelineLog
from .metrics import ProxyMetrics

#: The logger keeps the name it had when this lived in app.py: log filters may name it.
timeline_log = TimelineLog(logging.getLogger("vllm_ascend_mooncake.proxy.app.timeline"))


@dataclass
class RequestTrace:
    """The proxy's side of a request's timeline (:mod:`..timeline`): wall-clock stamps, written
    as one log line once the answer is over, keyed by the transfer id prefill holds the KV under."""

    stamps: dict[str, float] = field(default_factory=lambda: {"received": time.time()})
    transfer_id: str | None = None
    mode: str = "serial"
    metrics: ProxyMetrics | None = None  # fed once the answer is over

    def mark(self, name: str) -> None:
        self.stamps.setdefault(name, time.time())

    def emit(self) -> None:
        self.mark("done")
        if self.transfer_id is not None:  # the timeline is keyed by it
            timeline_log.emit("proxy", self.transfer_id, self.stamps, mode=self.mode)
        if self.metrics is not None:  # every answer counts, one without a transfer too
            self.metrics.observe(self.mode, self.stamps)
