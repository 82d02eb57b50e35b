"""One decode worker pulling from many prefill workers (a fleet simulation's fan-in): threads do
not grow with the peers notified, every notice arrives, a frozen peer delays only its own, the
process's side-channel sockets are not capped at ZMQ's default 1,023, and a steady stream over
more peers than a 16-entry cache held reuses its connections instead of reconnecting per pull.

Prefill workers are real :class:`SideChannelServer` instances on loopback ZMQ. At ~1,000 prefill
peers the fleet's decode worker ran 869 notifier threads (one per peer notified within 30 s) and
ran out of ZMQ sockets (EMFILE: 209 of 1,500 pulls failed); above 16 peers nearly every pull
opened a new TCP connection (0.83 per pull at 128 peers).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest
import zmq
from test_claims import GrantWhenReady, claim, never_cancelled

from vam_testing.waiting import wait_until
from vllm_ascend_mooncake.datapath import claims, notifier, side_channel
from vllm_ascend_mooncake.datapath.claims import ClaimExchange
from vllm_ascend_mooncake.datapath.notifier import ReadDoneNotifier
from vllm_ascend_mooncake.datapath.side_channel import (
    PeerRefused,
    SideChannelClient,
    SideChannelServer,
)
from vllm_ascend_mooncake.datapath.wire import Ack, GetMetadata, ReadDone
from vllm_ascend_mooncake.launch.ports import free_port_range

HOST = "127.0.0.1"


class Prefill:
    """A prefill side channel that records the notices it gets."""

    def __init__(self) -> None:
        self.port = free_port_range(1)
        self.received: list[str] = []
        self.server = SideChannelServer(HOST, self.port, self._handle)

    def _handle(self, message):
        self.received.append(message.request_id)
        return Ack()


class Frozen:
    """A prefill whose process is frozen: its kernel takes the connection and the messages (a
    ROUTER socket nobody reads), nothing answers."""

    def __init__(self) -> None:
        self.port = free_port_range(1)
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(f"tcp://{HOST}:{self.port}")


def done(request_id: str) -> ReadDone:
    return ReadDone(request_id=request_id, decode_rank=0, incarnation="i", success=True)


def notifier_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("vam-notify")}


@pytest.fixture
def connects(monkeypatch) -> list[tuple[str, int]]:
    """Every DEALER connection the decode side makes (client, claims, notices), in order."""
    made: list[tuple[str, int]] = []
    real = side_channel.connect_dealer

    def counted(sock, host, port):
        made.append((host, port))
        real(sock, host, port)

    for module in (side_channel, claims, notifier):
        monkeypatch.setattr(module, "connect_dealer", counted, raising=False)
    return made


def test_notices_to_200_peers_use_a_bounded_number_of_threads_and_a_frozen_peer_delays_none(
    connects,
) -> None:
    """One thread per peer notified in the last 30 s: 869 threads at ~1,000 prefill peers.
    Here 200 healthy peers and 20 frozen ones, 3 notices each: every healthy notice arrives, in
    order, well within one exchange timeout of the frozen peers', on a bounded number of
    threads; one connection per peer."""
    client = SideChannelClient(timeout_s=3.0)
    healthy = [Prefill() for _ in range(200)]
    frozen = [Frozen() for _ in range(20)]
    before = notifier_threads()
    notices = ReadDoneNotifier(client, attempts=2, backoff_s=0.5, idle_s=30.0)
    try:
        started = time.monotonic()
        for round_ in range(3):
            for peer in frozen:  # queued first: they must hold up nobody
                notices.send(HOST, peer.port, 0, done(f"f{round_}"))
            for peer in healthy:
                notices.send(HOST, peer.port, 0, done(f"r{round_}"))
        wait_until(
            lambda: all(len(peer.received) == 3 for peer in healthy),
            "every healthy peer gets its 3 notices",
        )
        took = time.monotonic() - started
        assert all(peer.received == ["r0", "r1", "r2"] for peer in healthy)
        assert took < client.timeout_s, f"healthy notices took {took:.1f} s behind frozen peers"
        threads = notifier_threads() - before
        assert len(threads) <= 2, f"{len(threads)} notifier threads for 220 peers"
        healthy_ports = {peer.port for peer in healthy}
        healthy_connects = [port for _, port in connects if port in healthy_ports]
        assert len(healthy_connects) == len(healthy), "one connection per healthy peer"
    finally:
        notices.shutdown()
        for peer in healthy:
            peer.server.close()
        for peer in frozen:
            peer.socket.close()
        client.close()


def test_the_side_channel_context_holds_more_than_1023_sockets() -> None:
    """ZMQ's default context cap (1,023 sockets) ran out at ~1,000 prefill peers (a claims and a
    notice socket to each): the side channel's context has a cap derived from the process's
    file-descriptor limit."""
    client = SideChannelClient(timeout_s=1.0)
    sockets = []
    try:
        for _ in range(1100):
            sockets.append(client.context.socket(zmq.DEALER))
    finally:
        for sock in sockets:
            sock.close(linger=0)
        client.close()


def test_a_forked_child_makes_a_side_channel_context_of_its_own() -> None:
    """A ZMQ context does not survive a fork (``zmq.Context.instance()`` checks the process id
    for that reason): a child of a process that made the side channel's context gets a new one
    with the same cap, and can make sockets in it."""
    parent = side_channel.zmq_context()
    pid = os.fork()
    if pid == 0:  # the child: report by exit code only
        code = 1
        try:
            child = side_channel.zmq_context()
            sock = child.socket(zmq.DEALER)
            sock.close(linger=0)
            same_cap = child.get(zmq.MAX_SOCKETS) == parent.get(zmq.MAX_SOCKETS)
            code = 0 if child is not parent and same_cap else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert side_channel.zmq_context() is parent


def test_a_steady_stream_over_64_peers_reuses_its_connections(connects) -> None:
    """A 16-entry socket cache (per client thread, and the claims exchange's) made nearly every
    exchange over more than 16 peers in turn open a new connection (TIME_WAIT piling up: 1,831
    after 2,000 pulls over 128 peers). 64 peers asked in turn 5 times: one connection each, for
    the client's exchanges, for claims and for notices."""
    peers = [GrantWhenReady() for _ in range(64)]
    client = SideChannelClient(timeout_s=5.0)
    exchange = ClaimExchange(client, attempts=2)
    notices = ReadDoneNotifier(client, attempts=2, backoff_s=0.1, idle_s=30.0)
    try:
        for round_ in range(5):
            for index, peer in enumerate(peers):
                request_id = f"p{index}-{round_}"
                peer.ready(request_id)
                answer = claim(exchange, peer.port, request_id, check=never_cancelled).result(10)
                assert answer.reply.status == "granted"
                with contextlib.suppress(PeerRefused):  # claims only: an answer all the same
                    client.request(HOST, peer.port, GetMetadata())
                notices.send(HOST, peer.port, 0, done(request_id))
        wait_until(
            lambda: all(len(peer.asked) == 5 for peer in peers), "every claim was asked once"
        )
        time.sleep(0.3)  # the notices go out
        made = len(connects)
        assert made <= 3 * len(peers), f"{made} connections for 3 x 5 exchanges with 64 peers"
    finally:
        notices.shutdown()
        exchange.close()
        for peer in peers:
            peer.server.close()
        client.close()
