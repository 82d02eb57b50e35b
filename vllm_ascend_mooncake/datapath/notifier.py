"""Read-done notices, delivered off the read path.

Decode tells every prefill rank it read (successfully or not) that it is done, so the prefill can
free the request's blocks. Waiting for that exchange on the read path would add a round trip to
every request and, when the peer is slow to answer, hold up the next reads queued for it; losing
the notice would strand the prefill's blocks until their release deadline. So notices go out on
their own threads, in order per peer, and are sent again while the peer does not answer. A peer
that answers with an error (it restarted, or no longer knows the request) is not asked again.

Each peer has its own lane and thread, so a dead or frozen prefill delays only its own notices,
never a healthy prefill's (which would then free its blocks only at their deadline). A peer that
left every attempt of a notice unanswered gets one attempt per notice until it answers again: its
backlog drains at one timeout a notice.

A lane's thread starts with the peer's first notice and waits up to ``idle_s`` for the next one
before it ends (closing its socket): under a steady request rate one thread and one connection
serve every notice to a peer. A thread ending whenever its lane ran dry cost a thread start and a
TCP connection per notice (814 of each for 1,000 notices 4 ms apart), every closed connection
left in TIME_WAIT for 60 s, enough at ~470 notices/s to use up a host's ephemeral ports.

Nothing outlives a lane: its thread, its socket, its entry and the peer's "silent" mark all go
when it ends, so threads, sockets and entries count the peers notified within the last
:data:`LANE_IDLE_S`, never every peer ever notified (a pod replaced under a new address leaves
nothing behind). A silent peer notified again after its lane ended gets every attempt again.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from ..log import get_logger
from .side_channel import PeerRefused, SideChannelClient
from .wire import ReadDone

logger = get_logger(__name__)

_Peer = tuple[str, int]

#: How long a peer's lane thread waits for another notice before it ends and closes its socket.
LANE_IDLE_S = 30.0


@dataclass
class _Lane:
    """One peer's notices not sent yet, and the condition its thread waits on for more."""

    ready: threading.Condition
    notices: deque[tuple[int, ReadDone]] = field(default_factory=deque)
    #: the peer left a notice's every attempt unanswered (and has not answered since)
    silent: bool = False


class ReadDoneNotifier:
    """Sends :class:`ReadDone` messages to prefill side channels, retrying silent peers."""

    def __init__(
        self,
        client: SideChannelClient,
        attempts: int = 4,
        backoff_s: float = 1.0,
        idle_s: float | None = None,
    ) -> None:
        """``idle_s``: how long a lane waits for another notice (None: :data:`LANE_IDLE_S`)."""
        self._client = client
        self._attempts = max(1, attempts)
        self._backoff_s = backoff_s
        self._idle_s = LANE_IDLE_S if idle_s is None else idle_s
        self._lock = threading.Lock()
        self._lanes: dict[_Peer, _Lane] = {}  # peers whose lane thread runs
        self._stopped = threading.Event()  # set by shutdown: no new notice, attempt or back-off

    def send(self, host: str, port: int, prefill_rank: int, message: ReadDone) -> None:
        """Queue ``message`` for the side channel at ``host:port``; returns at once."""
        peer = (host, port)
        with self._lock:
            if self._stopped.is_set():
                return
            lane = self._lanes.get(peer)
            if lane is not None:  # its thread drains it, or waits for it
                lane.notices.append((prefill_rank, message))
                lane.ready.notify()
                return
            lane = self._lanes[peer] = _Lane(threading.Condition(self._lock))
            lane.notices.append((prefill_rank, message))
        threading.Thread(
            target=self._drain, args=(peer,), name=f"vam-notify-{port}", daemon=True
        ).start()

    def _drain(self, peer: _Peer) -> None:
        try:
            self._drain_lane(peer)
        finally:  # the thread ends: its socket must not outlive it
            self._client.close_thread_sockets()

    def _drain_lane(self, peer: _Peer) -> None:
        with self._lock:
            lane = self._lanes[peer]

        def work_or_stop() -> bool:
            return bool(lane.notices) or self._stopped.is_set()

        while True:
            with self._lock:
                lane.ready.wait_for(work_or_stop, timeout=self._idle_s)
                if not lane.notices or self._stopped.is_set():  # idle that long, or shut down
                    del self._lanes[peer]
                    return
                prefill_rank, message = lane.notices.popleft()
                attempts = 1 if lane.silent else self._attempts
            answered = self._deliver(*peer, prefill_rank, message, attempts)
            with self._lock:
                lane.silent = not answered

    def _deliver(
        self, host: str, port: int, prefill_rank: int, message: ReadDone, attempts: int
    ) -> bool:
        """Send one notice; whether the peer answered at all (an error is an answer)."""
        error: Exception | None = None
        answered = False
        for attempt in range(1, attempts + 1):
            try:
                self._client.request(host, port, message)
            except PeerRefused as exc:
                error, answered = exc, True
                break
            except Exception as exc:
                error = exc
                if attempt < attempts and self._stopped.wait(self._backoff_s * attempt):
                    return False  # shut down during the back-off
                continue
            if attempt > 1:
                logger.info(
                    "told prefill rank %d (%s:%d) that request %s was read, at attempt %d",
                    prefill_rank,
                    host,
                    port,
                    message.request_id,
                    attempt,
                )
            return True
        logger.warning(
            "could not tell prefill rank %d (%s:%d) that request %s was read (%s); it will "
            "release the blocks at its deadline",
            prefill_rank,
            host,
            port,
            message.request_id,
            error,
        )
        return answered

    def shutdown(self) -> None:
        """Stop; notices not yet delivered are dropped (the prefill frees at its deadline). A
        lane waiting for a reply ends when the exchange does, at most one timeout later."""
        with self._lock:
            self._stopped.set()
            for lane in self._lanes.values():  # an idle lane's thread ends now
                lane.ready.notify()
