"""FIFO lanes on a shared thread pool: work for one key runs in order, different keys in parallel.

The receiver keeps one lane per prefill peer for reads, and one per prefill instance for peer
look-ups, so a slow or dead peer delays only its own lane.

A lane exists only while it has work: its entry is made by the first item pushed to an idle key
and dropped, in the same lock, once its last item has run. So :class:`FifoLanes` holds one entry
per key with work queued or running, never one per key ever seen (a fleet whose pods are replaced
under new addresses sees unboundedly many), and a push costs O(1) whatever the number of keys.
Dropping an idle lane cannot reorder a key's work: the entry goes only after its last item ran,
so a later push starts a new lane with nothing before it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor

from ..log import get_logger

logger = get_logger(__name__)


class FifoLanes:
    """FIFO work per key, drained on the shared pool a few items per turn.

    An item that raises is logged and skipped: one bad item must not wedge the lane.
    """

    def __init__(self, pool: ThreadPoolExecutor, run: Callable[..., None], per_turn: int) -> None:
        self._pool, self._run, self._per_turn = pool, run, per_turn
        #: key -> its items not started yet; present while the lane has work queued or running
        self._lanes: dict[Hashable, deque] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Lanes with work queued or running."""
        return len(self._lanes)

    def queued(self, key: Hashable) -> int:
        """Items of ``key`` waiting (not started)."""
        with self._lock:
            return len(self._lanes.get(key, ()))

    def push(self, key: Hashable, item) -> None:
        """Queue ``item`` on ``key``'s lane; raises RuntimeError when the pool is shut down."""
        with self._lock:
            items = self._lanes.get(key)
            if items is not None:  # the lane's drain runs, or is submitted: it takes this too
                items.append(item)
                return
            self._lanes[key] = deque((item,))
        self._submit(key)

    def _submit(self, key: Hashable) -> None:
        try:
            self._pool.submit(self._drain, key)
        except RuntimeError:  # shutting down: the lane's items never run
            with self._lock:
                self._lanes.pop(key, None)
            raise

    def _drain(self, key: Hashable) -> None:
        for _ in range(self._per_turn):
            with self._lock:
                items = self._lanes[key]
                if not items:
                    del self._lanes[key]
                    return
                item = items.popleft()
            try:
                self._run(*item)
            except Exception:
                logger.exception("a queued transfer task failed")
        with self._lock:
            if not self._lanes[key]:
                del self._lanes[key]
                return
        self._submit(key)  # yield to other keys' lanes
