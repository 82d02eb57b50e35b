"""Prefill side: hold each request's blocks until every decode rank that reads them is done.

The topology tells this rank which decode ranks will read it for a request (possibly none: then the
request is finished at once). Decode ranks claim a lease before reading; a lease keeps a busy but
live decode from being cut off, and a request whose blocks were already released is refused, so a
late read never sees reused blocks. Read-done notifications may arrive before this worker learns
of the request (the decode side can be faster than this worker's next step), so early ones are
kept until the request shows up. A request nobody finishes reading is released when its deadline
(``release_timeout_s`` after it was held, or the end of the latest lease) passes. Each request is
reported finished exactly once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .log import get_logger
from .side_channel import SideChannelServer
from .topology import TransferTopology, request_seed
from .wire import (
    Ack,
    ClaimRead,
    ClaimReply,
    ErrorReply,
    GetMetadata,
    Message,
    ReadDone,
    WorkerMetadata,
)

logger = get_logger(__name__)

# Early read-done notifications and released ids are remembered this many timeouts long; a
# hostile peer can therefore grow them only at its own message rate, for a bounded time.
MEMORY_TIMEOUTS = 2


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
        self._released: dict[str, float] = {}  # request id -> forget after
        self._finished: set[str] = set()
        self.num_expired = 0
        self._expired_reported = 0

    @property
    def lease_s(self) -> float:
        return self._timeout

    def hold(self, request_id: str) -> None:
        """Start holding a request's blocks until its readers are done (or time runs out)."""
        readers = set(self._topology.readers_of(self._rank, request_seed(request_id)))
        with self._lock:
            if request_id in self._held or request_id in self._released:
                return
            early, _ = self._early.pop(request_id, (set(), 0.0))
            readers -= early
            if not readers:
                self._release(request_id)
                return
            self._held[request_id] = _Held(readers, self._clock() + self._timeout)

    def claim(self, request_id: str, decode_rank: int) -> ClaimReply:
        """Grant (or renew) a read lease, or say why not."""
        now = self._clock()
        with self._lock:
            held = self._held.get(request_id)
            if held is not None:
                if decode_rank not in held.readers_left:
                    return ClaimReply(
                        "refused", reason=f"decode rank {decode_rank} is not a reader"
                    )
                held.deadline = max(held.deadline, now + self._timeout)
                return ClaimReply("granted", lease_s=self._timeout)
            if request_id in self._released:
                return ClaimReply("refused", reason="its blocks were already released")
            return ClaimReply("pending", reason="not registered on this worker yet")

    def read_done(self, request_id: str, decode_rank: int, success: bool) -> None:
        with self._lock:
            held = self._held.get(request_id)
            if held is None:
                if request_id not in self._released:
                    forget = self._clock() + MEMORY_TIMEOUTS * self._timeout
                    early, _ = self._early.setdefault(request_id, (set(), forget))
                    early.add(decode_rank)
                return
            held.readers_left.discard(decode_rank)
            if not success:
                held.failed_readers.add(decode_rank)
            if not held.readers_left:
                del self._held[request_id]
                self._release(request_id)

    def _release(self, request_id: str) -> None:
        """Report the request finished (caller holds the lock) and refuse later claims."""
        self._finished.add(request_id)
        self._released[request_id] = self._clock() + MEMORY_TIMEOUTS * self._timeout

    def take_finished(self) -> set[str]:
        """Requests whose blocks can be freed now; expires overdue ones first."""
        now = self._clock()
        with self._lock:
            for request_id, held in list(self._held.items()):
                if held.deadline <= now:
                    del self._held[request_id]
                    self._release(request_id)
                    self.num_expired += 1
                    logger.warning(
                        "released KV blocks of request %s after its deadline: decode rank(s) %s "
                        "never finished reading",
                        request_id,
                        sorted(held.readers_left),
                    )
            for memory in (self._early, self._released):
                for request_id, entry in list(memory.items()):
                    forget_at = entry[1] if isinstance(entry, tuple) else entry
                    if forget_at <= now:
                        del memory[request_id]
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
    """A prefill worker's side-channel service: metadata, read leases, read-done bookkeeping."""

    def __init__(
        self, metadata: WorkerMetadata, tracker: SendTracker, host: str, port: int
    ) -> None:
        self.metadata = metadata
        self.tracker = tracker
        self._server = SideChannelServer(host, port, self._handle, name=f"vam-sender-{port}")

    def _stale(self, incarnation: str) -> ErrorReply | None:
        if incarnation == self.metadata.incarnation:
            return None
        return ErrorReply(
            f"addressed to incarnation {incarnation} but this worker is "
            f"{self.metadata.incarnation} (it restarted; its KV is gone)"
        )

    def _handle(self, message: Message) -> Message:
        if isinstance(message, GetMetadata):
            return self.metadata
        if isinstance(message, ClaimRead):
            return self._stale(message.incarnation) or self.tracker.claim(
                message.request_id, message.decode_rank
            )
        if isinstance(message, ReadDone):
            stale = self._stale(message.incarnation)
            if stale is not None:
                return stale
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
