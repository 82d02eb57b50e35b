"""The claims exchange (datapath/claims.py) against real loopback ZMQ servers: many claims
outstanding on one socket, each answered by its own reply, silence and late answers, callers that
give up, shutdown, and sockets that do not pile up (issue #27 item 2: no thread per waiting claim).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from vam_testing.waiting import wait_until
from vllm_ascend_mooncake.datapath import claims as claims_module
from vllm_ascend_mooncake.datapath.claims import ClaimExchange
from vllm_ascend_mooncake.datapath.side_channel import (
    Park,
    PeerRefused,
    PeerSilent,
    SideChannelClient,
    SideChannelError,
    SideChannelServer,
)
from vllm_ascend_mooncake.datapath.wire import (
    ClaimRead,
    ClaimReply,
    ErrorReply,
    Message,
    decode,
    encode,
)
from vllm_ascend_mooncake.launch.ports import free_port_range

HOST = "127.0.0.1"


def never_cancelled() -> None:
    pass


class GrantWhenReady:
    """A prefill stand-in: claims of ids not ready yet are held open until :meth:`ready`."""

    def __init__(self) -> None:
        self.port = free_port_range(1)
        self._ready: set[str] = set()
        self.asked: list[str] = []
        self.server = SideChannelServer(HOST, self.port, self._handle)

    def _handle(self, message: Message) -> Message | Park:
        if not isinstance(message, ClaimRead):
            return ErrorReply("claims only")
        self.asked.append(message.request_id)
        if message.request_id in self._ready:
            return ClaimReply("granted", lease_s=30.0, block_ids=[1])
        return Park(time.monotonic() + message.wait_s, ClaimReply("pending"), message.request_id)

    def ready(self, request_id: str) -> None:
        self._ready.add(request_id)
        self.server.wake(request_id)


@pytest.fixture
def exchange() -> Iterator[ClaimExchange]:
    client = SideChannelClient(timeout_s=5)
    made = ClaimExchange(client, attempts=2)
    yield made
    made.close()
    client.close()


def claim(exchange: ClaimExchange, port: int, request_id: str, wait_s=10.0, park_s=1.0, **kw):
    message = ClaimRead(request_id, 0, "incarnation", wait_s=park_s)
    return exchange.claim(HOST, port, message, time.monotonic() + wait_s, **kw)


def test_claims_outstanding_at_once_on_one_peer_are_each_answered_by_their_own_reply(
    exchange,
) -> None:
    """Thirty claims wait at once (a thread each would cap that); the one made ready last of
    the first two is granted first, and the others stay pending until their turn."""
    prefill = GrantWhenReady()
    try:
        futures = {
            f"r{i}": claim(exchange, prefill.port, f"r{i}", check=never_cancelled)
            for i in range(30)
        }
        wait_until(lambda: len(set(prefill.asked)) >= 30, "all 30 claims reach the peer")
        prefill.ready("r1")
        answer = futures["r1"].result(timeout=5)
        assert answer.reply.status == "granted" and answer.reply.block_ids == [1]
        assert not any(f.done() for name, f in futures.items() if name != "r1")
        for name in futures:
            prefill.ready(name)
        for name, future in futures.items():
            assert future.result(timeout=5).reply.status == "granted", name
        assert exchange.num_waiting == 0
    finally:
        prefill.server.close()


def test_a_claim_still_pending_at_its_deadline_ends_with_the_pending_answer(exchange) -> None:
    prefill = GrantWhenReady()
    try:
        started = time.monotonic()
        future = claim(
            exchange, prefill.port, "late", wait_s=0.5, park_s=0.1, check=never_cancelled
        )
        answer = future.result(timeout=10)
        assert answer.reply.status == "pending"
        assert time.monotonic() - started >= 0.5
        assert prefill.asked.count("late") >= 2  # asked again while its deadline had not passed
    finally:
        prefill.server.close()


class AnswersOnlyLate:
    """A peer that answers each claim's first exchange only after the claim asked again (too
    late: the claimant gave that exchange up) and never answers the second."""

    def __init__(self) -> None:
        self.port = free_port_range(1)
        self.exchanges = 0
        self._socket = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(f"tcp://{HOST}:{self.port}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        first = None
        while not self._stop.is_set():
            if not self._socket.poll(50):
                continue
            frames = self._socket.recv_multipart()
            self.exchanges += 1
            if first is None:
                first = frames
                continue
            identity, tag = first[0], first[1]  # [identity, tag, b"", payload]
            reply = encode(ClaimReply("granted", lease_s=30.0, block_ids=[7]))
            self._socket.send_multipart([identity, tag, b"", reply])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close()


def test_a_silent_peer_fails_the_claim_after_every_attempt_and_a_late_answer_is_ignored() -> None:
    """The answer to an exchange already given up on must not grant the claim: a lease runs
    from when its exchange was sent, and the claimant no longer knows when that was."""
    peer = AnswersOnlyLate()
    client = SideChannelClient(timeout_s=0.3)
    exchange = ClaimExchange(client, attempts=2)
    try:
        future = claim(exchange, peer.port, "silent", park_s=0.0, check=never_cancelled)
        with pytest.raises(PeerSilent, match="no answer from"):
            future.result(timeout=10)
        assert peer.exchanges == 2
    finally:
        exchange.close()
        client.close()
        peer.close()


def test_a_claim_its_caller_gave_up_on_ends_within_a_tick_with_the_callers_error(exchange) -> None:
    """A cancelled pull must not wait out prefill's long poll (here 20 s)."""
    prefill = GrantWhenReady()
    given_up = threading.Event()

    def check() -> None:
        if given_up.is_set():
            raise KeyError("cancelled by the caller")

    try:
        future = claim(exchange, prefill.port, "cancelled", park_s=20.0, check=check)
        wait_until(lambda: "cancelled" in prefill.asked, "the claim reaches prefill's long poll")
        given_up.set()
        with pytest.raises(KeyError, match="cancelled by the caller"):
            future.result(timeout=10 * claims_module.TICK_S + 1)
    finally:
        prefill.server.close()


def test_close_fails_every_waiting_claim_and_later_claims_at_once() -> None:
    prefill = GrantWhenReady()
    client = SideChannelClient(timeout_s=5)
    exchange = ClaimExchange(client)
    try:
        waiting = [claim(exchange, prefill.port, f"w{i}", check=never_cancelled) for i in range(5)]
        wait_until(lambda: len(set(prefill.asked)) >= 5, "the 5 claims wait on the peer")
        exchange.close()
        for future in waiting:
            with pytest.raises(SideChannelError, match="shutting down"):
                future.result(timeout=0)
        with pytest.raises(SideChannelError, match="shutting down"):
            claim(exchange, prefill.port, "after", check=never_cancelled).result(timeout=0)
    finally:
        client.close()
        prefill.server.close()


def test_a_peer_refusing_the_message_fails_the_claim_with_its_reason(exchange) -> None:
    def refuse(message: Message) -> Message:
        return ErrorReply("addressed to another incarnation")

    port = free_port_range(1)
    server = SideChannelServer(HOST, port, refuse)
    try:
        with pytest.raises(PeerRefused, match="another incarnation"):
            claim(exchange, port, "refused", check=never_cancelled).result(timeout=10)
    finally:
        server.close()


def test_sockets_to_peers_that_no_claim_waits_on_are_closed_beyond_the_cap(
    exchange, monkeypatch
) -> None:
    """Prefill workers come and go (rollouts): the exchange keeps at most MAX_IDLE_SOCKETS
    sockets to peers nobody waits on, so the ZMQ context's sockets are never exhausted (the
    default cap is a share of the process's socket budget; a small one here)."""
    monkeypatch.setattr(claims_module, "MAX_IDLE_SOCKETS", 8)
    peers = [GrantWhenReady() for _ in range(claims_module.MAX_IDLE_SOCKETS + 6)]
    try:
        for index, peer in enumerate(peers):
            peer.ready(f"p{index}")
            answer = claim(exchange, peer.port, f"p{index}", check=never_cancelled).result(10)
            assert answer.reply.status == "granted"
        assert len(exchange._sockets) <= claims_module.MAX_IDLE_SOCKETS
    finally:
        for peer in peers:
            peer.server.close()


def test_a_tagged_request_gets_its_tag_back_and_an_untagged_one_none() -> None:
    """The side channel's routing envelope, which the exchange relies on."""
    port = free_port_range(1)
    server = SideChannelServer(HOST, port, lambda message: ClaimReply("granted"))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{HOST}:{port}")
    try:
        payload = encode(ClaimRead("t", 0, "i"))
        sock.send_multipart([b"tag-7", b"", payload])
        assert sock.poll(5000)
        tag, empty, reply = sock.recv_multipart()
        assert (tag, empty, decode(reply)) == (b"tag-7", b"", ClaimReply("granted"))
        sock.send_multipart([b"", payload])
        assert sock.poll(5000)
        empty, reply = sock.recv_multipart()
        assert (empty, decode(reply)) == (b"", ClaimReply("granted"))
        sock.send_multipart([b"x" * 1000, b"", payload])  # a tag too long is dropped
        assert not sock.poll(300)
    finally:
        sock.close()
        server.close()


def test_an_idle_socket_ready_in_the_round_whose_reply_closes_it_does_not_end_the_thread(
    exchange, monkeypatch
) -> None:
    """Issue #43 item 1: a reply that ended a claim closed an idle socket (more than
    MAX_IDLE_SOCKETS peers known) that was also ready in that poll round; reading it then raised
    KeyError, the thread died, and every later claim of the worker waited for ever."""
    monkeypatch.setattr(claims_module, "MAX_IDLE_SOCKETS", 2)
    x, b, p = GrantWhenReady(), GrantWhenReady(), GrantWhenReady()
    given_up, gate_entered, gate_open = threading.Event(), threading.Event(), threading.Event()
    checks = [0]

    def b_check() -> None:
        if given_up.is_set():
            raise KeyError("request b was aborted")

    def p_check() -> None:  # its second call is the round's tick: hold the thread there
        checks[0] += 1
        if checks[0] == 2:
            gate_entered.set()
            gate_open.wait(30)

    try:
        claim(exchange, x.port, "keep", park_s=30.0, check=never_cancelled)  # X stays busy
        abandoned = claim(exchange, b.port, "b", park_s=30.0, check=b_check)
        wait_until(lambda: {"keep"} <= set(x.asked) and "b" in b.asked, "X and B are asked")
        given_up.set()
        with pytest.raises(KeyError):
            abandoned.result(timeout=10)
        x1 = claim(exchange, x.port, "x1", park_s=30.0, check=never_cancelled)
        wait_until(lambda: "x1" in x.asked, "x1 reaches X")
        claim(exchange, p.port, "p", park_s=30.0, check=p_check)  # a third socket: B is idle
        assert gate_entered.wait(10)
        # While the thread is held, X answers x1 and B answers b late (given up on): both of
        # their sockets are ready in the next round, X's first.
        x.ready("x1")
        b.ready("b")
        for peer in (x, b):
            assert exchange._sockets[(HOST, peer.port)].poll(10_000, zmq.POLLIN)
        gate_open.set()
        assert x1.result(timeout=10).reply.status == "granted"
        assert exchange._thread.is_alive()
        p.ready("later")
        later = claim(exchange, p.port, "later", check=never_cancelled)
        assert later.result(timeout=10).reply.status == "granted"
    finally:
        gate_open.set()
        for peer in (x, b, p):
            peer.server.close()


def test_should_the_claims_thread_fail_every_claim_fails_at_once_instead_of_hanging(
    exchange,
) -> None:
    """Whatever ends the thread, a claim outstanding then or made later fails fast: nothing is
    left to answer it, and a pull waiting on it would hold its request for ever."""
    prefill = GrantWhenReady()
    try:
        waiting = claim(exchange, prefill.port, "waiting", park_s=30.0, check=never_cancelled)
        wait_until(lambda: "waiting" in prefill.asked, "the claim waits on the peer")

        def broken() -> int:
            raise RuntimeError("a bug in the claims thread")

        exchange._poll_timeout_ms = broken  # the thread's next round fails
        with pytest.raises(SideChannelError, match=r"claims thread failed: .*a bug"):
            waiting.result(timeout=10)
        exchange._thread.join(10)
        assert not exchange._thread.is_alive()
        prefill.ready("later")
        with pytest.raises(SideChannelError, match=r"claims thread failed: .*a bug"):
            claim(exchange, prefill.port, "later", check=never_cancelled).result(timeout=0)
    finally:
        prefill.server.close()


def test_a_claim_to_a_malformed_host_fails_at_once_and_keeps_no_socket(exchange) -> None:
    """Issue #43 item 2: ZMQ refuses such a host only in connect(), after the socket was made;
    the claim was then asked again like a silent peer's, a socket each time."""
    message = ClaimRead("bad-host", 0, "incarnation", wait_s=1.0)
    future = exchange.claim("127.0.0.1 ", 40000, message, time.monotonic() + 30, never_cancelled)
    with pytest.raises(SideChannelError, match="neither an IP address nor a host name"):
        future.result(timeout=10 * claims_module.TICK_S + 1)
    assert exchange._sockets == {}
    assert exchange._thread.is_alive()
