"""Read-done notices over a real ZMQ side channel: retried while the prefill does not answer,
bounded, not repeated once it answers with an error, delivered in order per peer, and stopped
by shutdown without closing a socket under the thread that polls it."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from vam_testing.waiting import wait_until
from vllm_ascend_mooncake.datapath.notifier import ReadDoneNotifier
from vllm_ascend_mooncake.datapath.side_channel import (
    PeerSilent,
    SideChannelClient,
    SideChannelError,
    SideChannelServer,
)
from vllm_ascend_mooncake.datapath.wire import Ack, ErrorReply, ReadDone
from vllm_ascend_mooncake.launch.ports import free_port_range

CLIENT_TIMEOUT_S = 0.3


class Prefill:
    """A prefill side channel that comes up only when :meth:`start` is called."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.received: list[str] = []
        self.port = free_port_range(1)
        self.server: SideChannelServer | None = None

    def start(self) -> None:
        self.server = SideChannelServer("127.0.0.1", self.port, self.handle)

    def handle(self, message):
        self.received.append(message.request_id)
        return ErrorReply("unknown incarnation") if self.refuse else Ack()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def done(request_id: str) -> ReadDone:
    return ReadDone(request_id=request_id, decode_rank=0, incarnation="i", success=True)


@pytest.fixture
def client():
    client = SideChannelClient(timeout_s=CLIENT_TIMEOUT_S)
    yield client
    client.close()


def test_an_unreachable_prefill_is_asked_again_once_it_is_back(client) -> None:
    prefill = Prefill()
    notifier = ReadDoneNotifier(client, attempts=4, backoff_s=0.2)  # tries at ~0, 0.5, 1.2 s
    try:
        started = time.monotonic()
        notifier.send("127.0.0.1", prefill.port, 0, done("r1"))
        assert time.monotonic() - started < CLIENT_TIMEOUT_S, "send() must not wait for the peer"
        time.sleep(0.9)  # two attempts went unanswered
        prefill.start()
        wait_until(lambda: prefill.received == ["r1"], "the notice reaches the restarted prefill")
        time.sleep(1.5)  # delivered: no further attempt
        assert prefill.received == ["r1"]
    finally:
        notifier.shutdown()
        prefill.close()


def test_attempts_are_bounded(client, caplog) -> None:
    prefill = Prefill()
    notifier = ReadDoneNotifier(client, attempts=2, backoff_s=0.05)
    try:
        notifier.send("127.0.0.1", prefill.port, 0, done("r1"))
        wait_until(
            lambda: "release the blocks at its deadline" in caplog.text,
            "the notifier gives up after its last attempt",
        )
        prefill.start()
        time.sleep(1.0)
        assert prefill.received == [], "the notifier kept trying after its last attempt"
    finally:
        notifier.shutdown()
        prefill.close()


def test_a_refusal_is_not_repeated(client, caplog) -> None:
    prefill = Prefill(refuse=True)
    prefill.start()
    notifier = ReadDoneNotifier(client, attempts=4, backoff_s=0.05)
    try:
        notifier.send("127.0.0.1", prefill.port, 0, done("r1"))
        wait_until(lambda: "unknown incarnation" in caplog.text, "the refusal is logged")
        time.sleep(0.5)
        assert prefill.received == ["r1"]
    finally:
        notifier.shutdown()
        prefill.close()


def test_notices_to_one_peer_keep_their_order(client) -> None:
    prefill = Prefill()
    notifier = ReadDoneNotifier(client, attempts=4, backoff_s=0.2)
    ids = [f"r{i}" for i in range(8)]
    try:
        for request_id in ids:
            notifier.send("127.0.0.1", prefill.port, 0, done(request_id))
        time.sleep(0.4)
        prefill.start()
        wait_until(lambda: len(prefill.received) == len(ids), "all 8 notices are delivered")
        assert prefill.received == ids
    finally:
        notifier.shutdown()
        prefill.close()


def test_dead_peers_never_delay_a_healthy_peers_notice(client) -> None:
    """A TP 4 prefill died with 8 reads in flight each (#27 row 3): its 32 notices, each worth
    4 attempts of a timeout plus back-off, occupied every notifier thread, and the healthy
    prefill heard of its read only after them (46 s each at the defaults). Each peer has its own
    lane now: the healthy notice is delivered at once (the bound below is a fraction of one dead
    notice's cost, not a measurement)."""
    healthy, dead = Prefill(), [Prefill() for _ in range(4)]  # the dead never start
    healthy.start()
    notifier = ReadDoneNotifier(client, attempts=4, backoff_s=0.1)
    try:
        for i in range(8):
            for peer in dead:
                notifier.send("127.0.0.1", peer.port, 0, done(f"dead-{i}"))
        started = time.monotonic()
        notifier.send("127.0.0.1", healthy.port, 0, done("healthy"))
        wait_until(lambda: healthy.received == ["healthy"], "the healthy prefill gets its notice")
        assert time.monotonic() - started < 4 * CLIENT_TIMEOUT_S
    finally:
        notifier.shutdown()
        healthy.close()


def test_a_silent_peers_backlog_gets_one_attempt_per_notice_until_it_answers(client) -> None:
    prefill = Prefill()
    notifier = ReadDoneNotifier(client, attempts=3, backoff_s=0.05, idle_s=0.01)
    try:
        started = time.monotonic()
        for i in range(5):
            notifier.send("127.0.0.1", prefill.port, 0, done(f"r{i}"))
        # 3 attempts for the first notice, then 1 for each of the other 4: about 7 timeouts
        # (15 with every notice tried 3 times).
        wait_until(lambda: not notifier._lanes, "the silent peer's backlog drains")
        assert time.monotonic() - started < 11 * CLIENT_TIMEOUT_S
        prefill.start()
        notifier.send("127.0.0.1", prefill.port, 0, done("r5"))
        wait_until(lambda: prefill.received == ["r5"], "the prefill, now up, gets the next notice")
    finally:
        notifier.shutdown()
        prefill.close()


def test_lanes_leave_no_socket_open_behind_them(client) -> None:
    """Each burst of notices to a peer apart by more than idle_s opens a new lane: a lane's
    socket is closed when it ends, or a long-running decode would fill the ZMQ context."""
    prefill = Prefill()
    prefill.start()
    notifier = ReadDoneNotifier(client, attempts=2, backoff_s=0.05, idle_s=0.01)
    try:
        for i in range(30):  # 30 bursts, 30 lanes
            notifier.send("127.0.0.1", prefill.port, 0, done(f"r{i}"))
            wait_until(
                lambda i=i: len(prefill.received) == i + 1 and not notifier._lanes,
                f"notice r{i} is delivered and its lane thread ends",
            )
        # the last lane closes its socket as it ends
        assert notifier.num_sockets == 0 and notifier.sockets_opened == 30
    finally:
        notifier.shutdown()
        prefill.close()


def test_closing_the_client_never_closes_a_socket_another_thread_polls() -> None:
    """A ZMQ socket is not thread-safe: a CI run's pytest process aborted in a read-done lane's
    poll after a decode side's shutdown had closed every thread's socket. A running thread's
    socket is left to it; the client takes no new exchange once closed."""
    client = SideChannelClient(timeout_s=1.0)
    silent = Prefill()  # never started: nothing answers
    outcome: list[Exception] = []

    def exchange() -> None:
        try:
            client.request("127.0.0.1", silent.port, done("r1"))
        except SideChannelError as exc:
            outcome.append(exc)
        finally:
            client.close_thread_sockets()

    thread = threading.Thread(target=exchange)
    thread.start()
    (sock,) = wait_until(lambda: list(client._all_sockets), "the thread opens its socket")
    client.close()
    assert not sock.closed, "close() closed a socket that its thread was polling"
    with pytest.raises(SideChannelError, match="client is closed"):
        client.request("127.0.0.1", silent.port, done("r2"))
    thread.join(timeout=10)
    assert [type(exc) for exc in outcome] == [PeerSilent], "the exchange ends by its own timeout"
    assert sock.closed and not client._all_sockets


def test_shutdown_ends_a_silent_peers_retries(client) -> None:
    """A decode shutting down must not go on asking a silent prefill for seconds (and using the
    client it is closing): the lane ends when the exchange under way does."""
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # receives, never answers
    port = free_port_range(1)
    silent.bind(f"tcp://127.0.0.1:{port}")
    notifier = ReadDoneNotifier(client, attempts=4, backoff_s=0.5)  # tries at ~0, 0.8, 2.1 s...
    try:
        notifier.send("127.0.0.1", port, 0, done("r1"))
        assert silent.poll(5000), "the first attempt arrives"
        silent.recv_multipart()
        notifier.shutdown()
        wait_until(lambda: not notifier._lanes, "the lane ends after shutdown")
        assert not silent.poll(1500), "the notifier tried again after shutdown"
    finally:
        notifier.shutdown()
        silent.close(linger=0)


def test_notices_to_a_peer_reuse_one_thread_and_one_connection(client) -> None:
    """Issue #43 item 4: a lane's thread ended whenever its lane ran dry, so under a steady
    request rate every notice cost a thread start and a new TCP connection (814 of each for
    1,000 notices 4 ms apart), each closed one left in TIME_WAIT for 60 s."""
    prefill = Prefill()
    prefill.start()
    threads_before = {t for t in threading.enumerate() if t.name.startswith("vam-notify")}
    notifier = ReadDoneNotifier(client, idle_s=30.0)
    try:
        for i in range(20):
            notifier.send("127.0.0.1", prefill.port, 0, done(f"r{i}"))
            wait_until(lambda i=i: len(prefill.received) == i + 1, f"notice {i} is delivered")
            time.sleep(0.02)  # the lane runs dry between notices
        assert prefill.received == [f"r{i}" for i in range(20)]
        threads = {t for t in threading.enumerate() if t.name.startswith("vam-notify")}
        assert len(threads - threads_before) == 1 and notifier.sockets_opened == 1
    finally:
        notifier.shutdown()
        prefill.close()


def test_an_idle_lane_ends_and_closes_its_socket(client) -> None:
    """A peer nobody reads from any more (rollouts) keeps no thread or socket: its lane ends
    once idle for idle_s, and at once on shutdown."""
    prefill = Prefill()
    prefill.start()
    idle = ReadDoneNotifier(client, idle_s=0.2)
    waiting = ReadDoneNotifier(client, idle_s=60.0)
    try:
        for notifier in (idle, waiting):
            notifier.send("127.0.0.1", prefill.port, 0, done("r1"))
        wait_until(lambda: not idle._lanes, "the idle lane ends")
        assert len(prefill.received) == 2
        assert len(waiting._lanes) == 1  # still waiting for a next notice
        started = time.monotonic()
        waiting.shutdown()
        wait_until(lambda: not waiting._lanes, "shutdown ends the waiting lane")
        assert time.monotonic() - started < 5.0
        assert idle.num_sockets == 0 and waiting.num_sockets == 0, "the lanes closed theirs"
    finally:
        idle.shutdown()
        waiting.shutdown()
        prefill.close()
