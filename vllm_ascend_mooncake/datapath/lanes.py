"""FIFO lanes on a shared thread pool: work for one key runs in order, different keys in parallel.

The receiver keeps one lane per prefill peer for reads, and one per peer for read-done notices, so a
slow or dead peer delays only its own lane.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ..log import get_logger

logger = get_logger(__name__)


class FifoLane:
    """FIFO work for one key, drained on the shared pool a few items per turn.

    An item that raises is logged and skipped: one bad item must not wedge the lane.
    """

    def __init__(self, pool: ThreadPoolExecutor, run: Callable[..., None], per_turn: int) -> None:
        self._pool, self._run, self._per_turn = pool, run, per_turn
        self._items: deque = deque()
        self._active = False
        self._lock = threading.Lock()

    def push(self, item) -> None:
        with self._lock:
            self._items.append(item)
            if self._active:
                return
            self._active = True
        self._pool.submit(self._drain)

    def _drain(self) -> None:
        for _ in range(self._per_turn):
            with self._lock:
                if not self._items:
                    self._active = False
                    return
                item = self._items.popleft()
            try:
                self._run(*item)
            except Exception:
                logger.exception("a queued transfer task failed")
        with self._lock:
            if not self._items:
                self._active = False
                return
        self._pool.submit(self._drain)  # yield to other keys' lanes
