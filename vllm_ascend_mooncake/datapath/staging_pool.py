"""Decode's staging areas: lent to one pull at a time, and kept away for good from any pull
once a read into them never settled."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Sequence

from ..core.plan import StagingArea
from .failures import FailureKind, PullError


class StagingPool:
    """The decode worker's registered staging areas, one per request in flight: pulls whose
    bytes cannot land in place (head slices, different block sizes) read into one and copy out.

    An area whose read never settled is quarantined (bytes may still land there) and never
    comes back; a pull that needs an area waits for one at most ``wait_s`` and gives up when
    vLLM no longer wants it, so a quarantine can fail pulls but never hang the worker."""

    def __init__(self, areas: Sequence[StagingArea]) -> None:
        self._free: queue.Queue[StagingArea] = queue.Queue()
        self._size = len(areas)
        self.num_quarantined = 0
        for area in areas:
            self._free.put(area)

    def acquire(self, wait_s: float, check: Callable[[], None], poll_s: float) -> StagingArea:
        """A free area; raises once ``wait_s`` passed, or whatever ``check`` raises (it is
        called every ``poll_s`` while waiting)."""
        deadline = time.monotonic() + wait_s
        while True:
            check()
            try:
                return self._free.get(timeout=max(0.0, min(poll_s, deadline - time.monotonic())))
            except queue.Empty:
                pass
            if time.monotonic() >= deadline:
                raise PullError(
                    FailureKind.NO_STAGING,
                    f"no staging area became free within {wait_s:.0f} s ({self.num_quarantined} "
                    f"of {self._size} held by reads that never settled: restart this decode "
                    f"instance to get them back, or raise staging_buffer_mib)",
                )

    def release(self, area: StagingArea) -> None:
        self._free.put(area)

    def quarantine(self, area: StagingArea) -> None:
        """``area`` never comes back (a read into it may still land)."""
        self.num_quarantined += 1
