"""Read-done notices, delivered off the read path, every peer's on one thread.

Decode tells every prefill rank it read (successfully or not) that it is done, so the prefill can
free the request's blocks. Waiting for that exchange on the read path would add a round trip to
every request and, when the peer is slow to answer, hold up the next reads queued for it; losing
the notice would strand the prefill's blocks until their release deadline. So notices go out on
their own thread, in order per peer, and are sent again while the peer does not answer. A peer
that answers with an error (it restarted, or no longer knows the request) is not asked again.

One thread multiplexes every peer's exchange (as :mod:`.claims` does for read claims): each peer
has a lane, a FIFO of its notices with at most one outstanding, and one DEALER socket; each
exchange is tagged (:mod:`.side_channel`'s routing envelope) so a late reply to an attempt given
up on is never taken for the next one's. Timeouts, back-offs and idle ends are timers in the poll
loop (a heap, so a round looks only at the lanes due), never a blocking wait: a dead or frozen
prefill delays only its own notices, never a healthy prefill's (which would then free its blocks
only at their deadline), and nothing one peer does makes another wait. A peer that left every
attempt of a notice unanswered gets one attempt per notice until it answers again: its backlog
drains at one timeout a notice. An unanswered attempt closes the lane's socket (what ZMQ still
queued for a peer that is down is dropped, not delivered as a duplicate once it is back); the next
attempt connects anew.

A thread per peer (the previous design) cost one thread and one socket per prefill notified within
:data:`LANE_IDLE_S`: at ~1,000 prefill peers a fleet simulation's decode worker ran 869 notifier
threads and ran out of the ZMQ context's 1,023 sockets (EMFILE on claims, metadata and notices;
209 of 1,500 pulls failed). Threads no longer grow with peers; sockets still count the peers
notified within the idle window, one each, from the context of :func:`.side_channel.zmq_context`
whose socket cap is derived from the process's file-descriptor limit.

A lane waits up to ``idle_s`` for the next notice before it ends (closing its socket): under a
steady request rate one connection serves every notice to a peer (a connection per notice left
each in TIME_WAIT for 60 s, enough at ~470 notices/s to use up a host's ephemeral ports). Nothing
outlives a lane: its socket, its entry and the peer's "silent" mark all go when it ends, so
sockets and entries count the peers notified within the last :data:`LANE_IDLE_S`, never every
peer ever notified (a pod replaced under a new address leaves nothing behind). A silent peer
notified again after its lane ended gets every attempt again.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import zmq

from ..log import get_logger
from .side_channel import (
    BadAddress,
    PeerRefused,
    SideChannelClient,
    SideChannelError,
    check_address,
    connect_dealer,
    refusal_checked,
)
from .wire import ReadDone

logger = get_logger(__name__)

_Peer = tuple[str, int]

#: How long a peer's lane waits for another notice before it ends and closes its socket.
LANE_IDLE_S = 30.0


@dataclass(eq=False)
class _Lane:
    """One peer's notices not sent yet, the one outstanding, and its socket."""

    peer: _Peer
    notices: deque[tuple[int, ReadDone]] = field(default_factory=deque)
    #: the peer left a notice's every attempt unanswered (and has not answered since)
    silent: bool = False
    sock: zmq.Socket | None = None
    polled: bool = False  # ``sock`` is in the poller (only while an exchange is outstanding)
    #: the notice being delivered (prefill rank, message), its attempts so far and allowed
    current: tuple[int, ReadDone] | None = None
    attempt: int = 0
    attempts: int = 0
    tag: bytes | None = None  # the outstanding exchange's tag (None: none outstanding)
    error: Exception | None = None  # the last attempt's failure
    #: the lane's one timer (an exchange's timeout, a back-off's end, its idle end): the heap
    #: entry's sequence number; an entry with another one was superseded
    timer: int = -1
    last_active: float = 0.0


class ReadDoneNotifier:
    """Sends :class:`ReadDone` messages to prefill side channels, retrying silent peers."""

    def __init__(
        self,
        client: SideChannelClient,
        attempts: int = 4,
        backoff_s: float = 1.0,
        idle_s: float | None = None,
        name: str = "vam-notify",
    ) -> None:
        """``idle_s``: how long a lane waits for another notice (None: :data:`LANE_IDLE_S`)."""
        self._client = client
        self._attempts = max(1, attempts)
        self._backoff_s = backoff_s
        self._idle_s = LANE_IDLE_S if idle_s is None else idle_s
        self._context = client.context
        #: peers whose lane got a notice since the thread last looked
        self._new: queue.SimpleQueue[_Peer] = queue.SimpleQueue()
        #: peers with a lane: made, and given notices, by :meth:`send`; ended by the thread
        self._lanes: dict[_Peer, _Lane] = {}
        self._by_socket: dict[zmq.Socket, _Lane] = {}
        self._timers: list[tuple[float, int, _Peer]] = []  # (when, seq, peer), a heap
        self._seq = itertools.count()
        self._tags = itertools.count()
        #: sockets opened so far (connections made; for tests and metrics)
        self.sockets_opened = 0
        self._poller = zmq.Poller()
        wake_address = f"inproc://vam-notify-{id(self)}"
        self._wake_in = self._context.socket(zmq.PULL)
        self._wake_in.bind(wake_address)
        self._poller.register(self._wake_in, zmq.POLLIN)
        self._wake_out = self._context.socket(zmq.PUSH)
        self._wake_out.setsockopt(zmq.LINGER, 0)
        self._wake_out.connect(wake_address)
        #: guards ``_lanes``, each lane's ``notices`` and the wake socket
        self._lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def num_sockets(self) -> int:
        """Sockets open to peers (for tests and metrics)."""
        return len(self._by_socket)

    def send(self, host: str, port: int, prefill_rank: int, message: ReadDone) -> None:
        """Queue ``message`` for the side channel at ``host:port``; returns at once."""
        peer = (host, port)
        with self._lock:
            if self._stopped:
                return
            lane = self._lanes.get(peer)
            if lane is None:
                lane = self._lanes[peer] = _Lane(peer)
            lane.notices.append((prefill_rank, message))
            self._new.put(peer)
            with contextlib.suppress(zmq.Again):  # a full queue: the loop is awake already
                self._wake_out.send(b"", zmq.NOBLOCK)

    def shutdown(self) -> None:
        """Stop; notices not yet delivered are dropped (the prefill frees at its deadline).
        Returns once the thread closed every socket."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            with contextlib.suppress(zmq.Again):
                self._wake_out.send(b"", zmq.NOBLOCK)
            self._wake_out.close()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    # -- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                for sock, _ in self._poller.poll(self._poll_timeout_ms()):
                    if sock is self._wake_in:
                        while self._wake_in.poll(0):
                            self._wake_in.recv()
                    else:
                        self._receive(sock)
                if self._stopped:
                    break
                now = time.monotonic()
                while not self._new.empty():
                    self._queue(self._new.get(), now)
                self._fire_timers(now)
        except Exception:  # a bug: notices stop (prefill frees at its deadlines), reads go on
            logger.exception("the read-done notifier failed; prefill frees at its deadlines")
            with self._lock:
                if not self._stopped:
                    self._stopped = True
                    self._wake_out.close()
        finally:
            with self._lock:
                lanes = list(self._lanes.values())
                self._lanes.clear()
            for lane in lanes:
                self._close_socket(lane)
            self._timers.clear()
            self._wake_in.close()

    def _poll_timeout_ms(self) -> int:
        if not self._timers:
            return -1
        return max(0, int((self._timers[0][0] - time.monotonic()) * 1000) + 1)

    def _schedule(self, lane: _Lane, when: float) -> None:
        lane.timer = next(self._seq)
        heapq.heappush(self._timers, (when, lane.timer, lane.peer))

    def _queue(self, peer: _Peer, now: float) -> None:
        """``peer``'s lane got a notice: start it unless one is under way."""
        lane = self._lanes.get(peer)
        if lane is not None and lane.current is None:
            self._next(lane, now)

    def _fire_timers(self, now: float) -> None:
        while self._timers and self._timers[0][0] <= now:
            _, seq, peer = heapq.heappop(self._timers)
            lane = self._lanes.get(peer)
            if lane is None or lane.timer != seq:
                continue  # superseded
            try:
                self._fire(lane, now)
            except Exception:  # one lane's failure ends that lane, never the thread
                logger.exception("read-done notices to %s:%d failed", *peer)
                self._end(lane, drop=True)
        if not self._lanes:
            self._timers.clear()  # only superseded timers can be left

    def _fire(self, lane: _Lane, now: float) -> None:
        if lane.current is None:  # idle: end it, unless a notice came since
            if now - lane.last_active >= self._idle_s:
                if not self._end(lane):
                    self._next(lane, now)
            else:
                self._schedule(lane, lane.last_active + self._idle_s)
        elif lane.tag is None:  # a back-off ended
            self._attempt(lane, now)
        else:  # the outstanding exchange went unanswered
            lane.error = lane.error or SideChannelError(
                f"no reply from {lane.peer[0]}:{lane.peer[1]} within "
                f"{self._client.timeout_s * 1000:.0f} ms"
            )
            self._failed(lane, now)

    def _next(self, lane: _Lane, now: float) -> None:
        """Start the lane's next notice, or wait ``idle_s`` for one."""
        lane.last_active = now
        with self._lock:
            lane.current = lane.notices.popleft() if lane.notices else None
        if lane.current is None:
            self._schedule(lane, now + self._idle_s)
            return
        lane.attempt, lane.attempts = 0, 1 if lane.silent else self._attempts
        lane.error = None
        self._attempt(lane, now)

    def _attempt(self, lane: _Lane, now: float) -> None:
        assert lane.current is not None
        lane.attempt += 1
        lane.tag = b"%x" % next(self._tags)
        lane.error = None
        self._schedule(lane, now + self._client.timeout_s)
        try:
            sock = self._socket(lane)
            sock.send_multipart(self._client.request_frames(lane.current[1], lane.tag), zmq.NOBLOCK)
            self._poll(lane, True)
        except BadAddress as exc:  # asking again would not help
            lane.error = exc
            lane.attempt = lane.attempts
            self._schedule(lane, now)  # failed at once, by the timer (no recursion per notice)
        except (SideChannelError, zmq.ZMQError) as exc:  # out of sockets: retried like silence
            lane.error = exc
            self._schedule(lane, now)

    def _failed(self, lane: _Lane, now: float) -> None:
        """The attempt under way failed: back off and try again, or give the notice up."""
        lane.tag = None
        self._close_socket(lane)  # what ZMQ still queued must not reach the peer later
        if lane.attempt < lane.attempts:
            self._schedule(lane, now + self._backoff_s * lane.attempt)
            return
        self._gave_up(lane, answered=False)
        self._next(lane, now)

    def _gave_up(self, lane: _Lane, answered: bool) -> None:
        assert lane.current is not None
        prefill_rank, message = lane.current
        logger.warning(
            "could not tell prefill rank %d (%s:%d) that request %s was read (%s); it will "
            "release the blocks at its deadline",
            prefill_rank,
            *lane.peer,
            message.request_id,
            lane.error,
        )
        lane.silent = not answered

    def _receive(self, sock: zmq.Socket) -> None:
        while True:
            lane = self._by_socket.get(sock)
            if lane is None:  # closed in this round (the notice ended): nothing more to read
                return
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if not frames or lane.tag is None or frames[0] != lane.tag:
                continue  # the answer to an attempt given up on
            try:
                self._answered(lane, frames[1:])
            except Exception:
                logger.exception("read-done notice to %s:%d failed", *lane.peer)
                self._end(lane, drop=True)
                return

    def _answered(self, lane: _Lane, frames: list[bytes]) -> None:
        assert lane.current is not None
        prefill_rank, message = lane.current
        host, port = lane.peer
        now = time.monotonic()
        try:
            refusal_checked(self._client.read_reply(frames, host, port), message, host, port)
        except PeerRefused as exc:  # an answer: not asked again
            lane.error = exc
            lane.tag = None
            self._poll(lane, False)
            self._gave_up(lane, answered=True)
            self._next(lane, now)
            return
        except SideChannelError as exc:  # a malformed reply: retried
            lane.error = exc
            self._failed(lane, now)
            return
        if lane.attempt > 1:
            logger.info(
                "told prefill rank %d (%s:%d) that request %s was read, at attempt %d",
                prefill_rank,
                host,
                port,
                message.request_id,
                lane.attempt,
            )
        lane.tag = None
        lane.silent = False
        self._poll(lane, False)
        self._next(lane, now)

    def _socket(self, lane: _Lane) -> zmq.Socket:
        if lane.sock is not None:
            return lane.sock
        check_address(*lane.peer)
        sock = self._context.socket(zmq.DEALER)
        try:
            connect_dealer(sock, *lane.peer)
        except zmq.ZMQError:
            sock.close()
            raise
        self.sockets_opened += 1
        lane.sock = sock
        self._by_socket[sock] = lane
        return sock

    def _poll(self, lane: _Lane, polled: bool) -> None:
        """Poll the lane's socket only while an exchange is outstanding on it: a poll round
        then costs the peers awaited, not every peer notified within the idle window (a reply
        to an attempt given up on waits in the socket until the next exchange, and is skipped
        by its tag)."""
        if lane.sock is None or lane.polled == polled:
            return
        if polled:
            self._poller.register(lane.sock, zmq.POLLIN)
        else:
            self._poller.unregister(lane.sock)
        lane.polled = polled

    def _close_socket(self, lane: _Lane) -> None:
        """Close the lane's socket (this thread only: it alone polls it). A socket ready in the
        current poll round is skipped by :meth:`_receive` once gone from ``_by_socket``."""
        self._poll(lane, False)
        sock, lane.sock = lane.sock, None
        if sock is not None:
            del self._by_socket[sock]
            sock.close()

    def _end(self, lane: _Lane, drop: bool = False) -> bool:
        """End an idle lane; False if a notice came meanwhile (``drop``: end it even so, its
        notices dropped)."""
        with self._lock:
            if lane.notices and not drop:
                return False
            if self._lanes.get(lane.peer) is lane:
                del self._lanes[lane.peer]
        self._close_socket(lane)
        return True
