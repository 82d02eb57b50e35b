"""Prefill side: hold each request's blocks until every decode rank that reads them is done.

The topology tells this rank which decode ranks will read it for a request (possibly none: then the
request is finished at once). Read-done notifications arrive on the side channel, possibly before
the request is registered here (the decode side can be faster than this worker's step), so early
notifications are kept until the request shows up. A request nobody finishes reading is released
after ``release_timeout_s`` and counted as expired. Each request is reported finished exactly once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .log import get_logger
from .side_channel import SideChannelServer
from .topology import TransferTopology, request_seed
from .wire import Ack, ErrorReply, GetMetadata, Message, ReadDone, WorkerMetadata

logger = get_logger(__name__)


@dataclass
class _Held:
    readers_left: set[int]
    deadline: float
    failed_readers: set[int] = field(default_factory=set)


class SendTracker:
    """Thread-safe bookkeeping of requests whose blocks this prefill rank holds."""

    def __init__(
        self,
        topology: TransferTopology,
        rank: int,
        release_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._topology = topology
        self._rank = rank
        self._timeout = release_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._early: dict[str, tuple[set[int], float]] = {}
        self._finished: set[str] = set()
        self.num_expired = 0
        self._expired_reported = 0

    def hold(self, request_id: str) -> None:
        """Start holding a request's blocks until its readers are done (or time runs out)."""
        readers = set(self._topology.readers_of(self._rank, request_seed(request_id)))
        with self._lock:
            if request_id in self._held:
                return
            early, _ = self._early.pop(request_id, (set(), 0.0))
            readers -= early
            if not readers:
                self._finished.add(request_id)
                return
            self._held[request_id] = _Held(readers, self._clock() + self._timeout)

    def read_done(self, request_id: str, decode_rank: int, success: bool) -> None:
        with self._lock:
            held = self._held.get(request_id)
            if held is None:
                early, _ = self._early.setdefault(
                    request_id, (set(), self._clock() + self._timeout)
                )
                early.add(decode_rank)
                return
            held.readers_left.discard(decode_rank)
            if not success:
                held.failed_readers.add(decode_rank)
            if not held.readers_left:
                del self._held[request_id]
                self._finished.add(request_id)

    def take_finished(self) -> set[str]:
        """Requests whose blocks can be freed now; expires overdue ones first."""
        now = self._clock()
        with self._lock:
            for request_id, held in list(self._held.items()):
                if held.deadline <= now:
                    del self._held[request_id]
                    self._finished.add(request_id)
                    self.num_expired += 1
                    logger.warning(
                        "released KV blocks of request %s after %.0f s: decode rank(s) %s never "
                        "finished reading",
                        request_id,
                        self._timeout,
                        sorted(held.readers_left),
                    )
            for request_id, (_, deadline) in list(self._early.items()):
                if deadline <= now:
                    del self._early[request_id]
            finished, self._finished = self._finished, set()
        return finished

    def take_expired_count(self) -> int:
        """Releases by timeout since the last call (for stats)."""
        with self._lock:
            count = self.num_expired - self._expired_reported
            self._expired_reported = self.num_expired
        return count

    @property
    def num_held(self) -> int:
        with self._lock:
            return len(self._held)


class PrefillSender:
    """A prefill worker's side-channel service: metadata for readers, read-done bookkeeping."""

    def __init__(
        self, metadata: WorkerMetadata, tracker: SendTracker, host: str, port: int
    ) -> None:
        self.metadata = metadata
        self.tracker = tracker
        self._server = SideChannelServer(host, port, self._handle, name=f"vam-sender-{port}")

    def _handle(self, message: Message) -> Message:
        if isinstance(message, GetMetadata):
            return self.metadata
        if isinstance(message, ReadDone):
            if message.incarnation != self.metadata.incarnation:
                return ErrorReply(
                    f"read-done for incarnation {message.incarnation} but this worker is "
                    f"{self.metadata.incarnation} (it restarted)"
                )
            if not message.success:
                logger.warning(
                    "decode rank %d failed to read request %s: %s",
                    message.decode_rank,
                    message.request_id,
                    message.reason,
                )
            self.tracker.read_done(message.request_id, message.decode_rank, message.success)
            return Ack()
        return ErrorReply(f"unexpected {type(message).__name__} on a prefill side channel")

    def close(self) -> None:
        self._server.close()
