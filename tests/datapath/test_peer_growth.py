"""Issue #47 item 3: a decode worker's threads, sockets and per-peer state stay flat as prefill
pods are replaced under new addresses.

One decode rank (the production wiring's receiver, its peer directory, claims and notifier) pulls
from 200 prefill workers over time, 20 alive at once, each turn's pods replaced by new ones on new
ports and transport sessions (plus one address nobody listens on per turn, a pod that is gone).
Prefill workers are real :class:`~vllm_ascend_mooncake.datapath.sender.PrefillSender` side
channels on loopback ZMQ, the bytes moved by the in-process transport. The idle windows are cut
to a fraction of a second, so the bounds a fleet meets in minutes are met here in seconds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import pytest
from receiver_cluster import FAST, HOST, PROMPT_TOKENS, Decode, Prefill

from vam_testing.kv_reference import ReferenceKV
from vam_testing.waiting import wait_until
from vllm_ascend_mooncake.core.topology import TransferTopology
from vllm_ascend_mooncake.datapath import claims, notifier, peers, side_channel
from vllm_ascend_mooncake.datapath.notifier import ReadDoneNotifier
from vllm_ascend_mooncake.datapath.orders import PullOrder
from vllm_ascend_mooncake.datapath.peer_reads import PeerReader, ReadTerms
from vllm_ascend_mooncake.datapath.side_channel import SideChannelClient
from vllm_ascend_mooncake.datapath.wire import ReadDone
from vllm_ascend_mooncake.launch.ports import free_port_range

TURNS, PEERS_PER_TURN = 10, 20  # 200 prefill workers seen, 20 at a time
IDLE_S = 0.3
HEADS, LAYERS, BLOCKS, BLOCK_SIZE, TOKEN_BYTES = 4, 2, 12, 16, 32


@pytest.fixture
def short_windows(monkeypatch):
    """Every idle window of the decode side at IDLE_S (read when each part is built)."""
    monkeypatch.setattr(peers, "PEER_IDLE_S", IDLE_S, raising=False)
    monkeypatch.setattr(claims, "IDLE_SOCKET_S", IDLE_S, raising=False)
    monkeypatch.setattr(side_channel, "IDLE_PEER_SOCKET_S", IDLE_S, raising=False)
    monkeypatch.setattr(notifier, "LANE_IDLE_S", IDLE_S)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def connections_served(port: int) -> int:
    """Established TCP connections whose local end is ``port`` (the server's side of each)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                local_port = int(fields[1].rsplit(":", 1)[1], 16)
                count += local_port == port and fields[3] == "01"  # ESTABLISHED
    return count


def held_entries(obj) -> int:
    """What ``obj`` keeps in its containers (dicts, sets, deques: any attribute with a len)."""
    return sum(
        len(value)
        for value in vars(obj).values()
        if isinstance(value, (dict, OrderedDict, set, list))
    )


def order(request_id: str, port: int) -> PullOrder:
    return PullOrder(
        request_id=request_id,
        transfer_id=f"t-{request_id}",
        local_block_ids=(1, 2),
        remote_block_ids=(3, 4),
        remote_host=HOST,
        remote_port=port,
        remote_engine_id="prefill",
        num_prompt_tokens=PROMPT_TOKENS,
    )


def per_peer_state(decode: Decode) -> dict[str, int]:
    """Every per-peer structure of the decode rank, by name: its entries."""
    receiver = decode.receiver
    return {
        "read lanes": len(receiver._lanes),
        "lookup lanes": len(receiver._lookup_lanes),
        "peer directory": held_entries(decode.side.peers),
        "circuits": len(receiver._reader._open_circuits),
        "notifier lanes": held_entries(receiver._notifier),
        "claims sockets": len(receiver._claims._sockets),
        "client sockets": len(decode.side.client._all_sockets),
    }


def test_threads_sockets_and_peer_state_stay_flat_as_200_prefill_pods_are_replaced(
    short_windows,
) -> None:
    topo = TransferTopology(HEADS, 1, 1)
    ref = ReferenceKV.random(LAYERS, BLOCKS, HEADS, BLOCK_SIZE, TOKEN_BYTES)
    decode = Decode(topo, 0, False, FAST, staging=False)
    decode.side.peers._cooldown_s = IDLE_S  # a gone pod's cool-down, too
    after_turn: list[tuple[int, int, dict[str, int]]] = []
    try:
        for turn in range(TURNS):
            pods = [Prefill(topo, 0, free_port_range(1), ref, False) for _ in range(PEERS_PER_TURN)]
            try:
                gone = free_port_range(1)  # a pod that went away: nobody listens there
                ids = [f"r{turn}-{i}" for i in range(PEERS_PER_TURN)]
                for request_id, pod in zip(ids, pods, strict=True):
                    pod.tracker.hold(
                        f"t-{request_id}",
                        request_id=request_id,
                        block_ids=(3, 4),
                        num_prompt_tokens=PROMPT_TOKENS,
                    )
                    decode.receiver.submit(order(request_id, pod.side.sender._server.address[1]))
                decode.receiver.submit(order(f"gone-{turn}", gone))
                decode.wait([*ids, f"gone-{turn}"], timeout_s=15)
                assert set(ids) <= decode.done, decode.failed
                for pod, request_id in zip(pods, ids, strict=True):  # every notice delivered
                    wait_until(
                        lambda pod=pod, r=request_id: (f"t-{r}", 0, True) in pod.notices,
                        "prefill hears the read is done",
                    )
            finally:  # replaced: the next turn's pods listen elsewhere
                with ThreadPoolExecutor(PEERS_PER_TURN) as closing:  # each waits a poll round
                    list(closing.map(Prefill.close, pods))
            time.sleep(2 * IDLE_S)  # the idle window passes ...
            decode.receiver.submit(order(f"gone-again-{turn}", free_port_range(1)))
            decode.wait([f"gone-again-{turn}"])  # ... and something happens after it
            wait_until(
                lambda: per_peer_state(decode)["notifier lanes"] == 0, "the notice lanes end"
            )
            after_turn.append((threading.active_count(), open_fds(), per_peer_state(decode)))
    finally:
        decode.close()

    threads = [t for t, _, _ in after_turn]
    fds = [f for _, f, _ in after_turn]
    # Turn 1 has made every pool thread and socket the worker keeps; later turns add none.
    assert max(threads[1:]) <= threads[1] + 2, f"threads after each turn: {threads}"
    assert max(fds[1:]) <= fds[1] + 8, (
        f"open file descriptors after each turn: {fds}; per-peer state after the last: "
        f"{after_turn[-1][2]}"
    )
    for _, _, state in after_turn:
        # what is left is the last turn's gone address (its cool-down) at most
        assert sum(state.values()) <= 2, f"per-peer state after each turn: {after_turn}"


def test_a_replaced_pods_state_is_dropped_once_idle(short_windows) -> None:
    """A prefill pod replaced under a new address: its metadata, lanes, sockets and notice lane
    go within the idle window; the new pod is read as before."""
    topo = TransferTopology(HEADS, 1, 1)
    ref = ReferenceKV.random(LAYERS, BLOCKS, HEADS, BLOCK_SIZE, TOKEN_BYTES)
    decode = Decode(topo, 0, False, FAST, staging=False)
    old = Prefill(topo, 0, free_port_range(1), ref, False)
    new = None
    try:
        old_port = old.side.sender._server.address[1]
        old.tracker.hold("t-a", request_id="a", block_ids=(3, 4), num_prompt_tokens=PROMPT_TOKENS)
        decode.receiver.submit(order("a", old_port))
        decode.wait(["a"])
        wait_until(lambda: ("t-a", 0, True) in old.notices, "the old pod hears the read is done")
        assert (HOST, old_port) in decode.side.peers._cache
        old.close()  # replaced ...
        new = Prefill(topo, 0, free_port_range(1), ref, False)  # ... by a pod elsewhere
        new_port = new.side.sender._server.address[1]
        time.sleep(2 * IDLE_S)
        new.tracker.hold("t-b", request_id="b", block_ids=(3, 4), num_prompt_tokens=PROMPT_TOKENS)
        decode.receiver.submit(order("b", new_port))
        decode.wait(["b"])
        assert decode.done == {"a", "b"}
        wait_until(lambda: per_peer_state(decode)["notifier lanes"] == 0, "the notice lanes end")
        assert (HOST, old_port) not in decode.side.peers._cache
        assert not decode.receiver._lanes and not decode.receiver._lookup_lanes
        # metadata fetches keep no socket; the notice lanes closed theirs as they ended
        wait_until(lambda: not decode.side.client._all_sockets, "no client socket is left")
        wait_until(
            lambda: (HOST, old_port) not in decode.receiver._claims._sockets,
            "the claims socket to the old pod closes",
        )
    finally:
        decode.close()
        old.close()
        if new is not None:
            new.close()


def test_a_closed_circuit_is_forgotten_after_its_longest_cool_down() -> None:
    """A frozen pod replaced under a new address is never read again: its circuit must not stay
    for ever (one per frozen peer ever seen)."""
    reader = PeerReader(
        None, None, None, None, None, None, 0, ReadTerms(0, 0.0, 0.1, 0.01, 0.02, False), None
    )

    class Peer:
        def __init__(self, session: str) -> None:
            self.transport_session, self.incarnation = session, "x"

    for i in range(200):
        reader._open_circuit(Peer(f"frozen-{i}"))
        time.sleep(0.001)
    time.sleep(0.05)
    reader._open_circuit(Peer("frozen-last"))
    assert list(reader._open_circuits) == ["frozen-last"]


def test_a_silent_peers_notifier_state_ends_with_its_lane() -> None:
    """A pod gone for good was notified (every attempt unanswered): once its lane ends, the
    notifier holds nothing of it."""
    client = SideChannelClient(timeout_s=0.05)
    notices = ReadDoneNotifier(client, attempts=1, backoff_s=0.01, idle_s=0.05)
    try:
        for _ in range(20):
            port = free_port_range(1)  # nobody listens
            notices.send(HOST, port, 0, ReadDone("t", 0, "x", True, ""))
        wait_until(lambda: not notices._lanes, "the lanes end")
        assert held_entries(notices) == 0, vars(notices)
        wait_until(lambda: not client._all_sockets, "every lane's socket closes")
    finally:
        notices.shutdown()
        client.close()


def test_a_vanished_decode_peers_connection_is_dropped_by_the_server(monkeypatch) -> None:
    """Prefill side: a decode pod whose host vanished (no FIN, no RST: here a stopped process)
    leaves a half-open connection on the prefill's side channel; heartbeats close it."""
    monkeypatch.setattr(side_channel, "HEARTBEAT_IVL_S", 0.1, raising=False)
    monkeypatch.setattr(side_channel, "HEARTBEAT_TIMEOUT_S", 0.3, raising=False)
    port = free_port_range(1)
    server = side_channel.SideChannelServer(HOST, port, lambda message: message)
    script = (
        "import sys, time, zmq\n"
        "s = zmq.Context().socket(zmq.DEALER)\n"
        f"s.connect('tcp://{HOST}:{port}')\n"
        "s.send_multipart([b'', b'hello'])\n"
        "s.poll(5000)\n"
        "print('connected', flush=True)\n"
        "time.sleep(60)\n"
    )
    peer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout.readline().strip() == "connected"
        assert connections_served(port) == 1
        peer.send_signal(signal.SIGSTOP)  # vanished: its ZMQ answers no ping any more
        deadline = time.monotonic() + 5.0
        while connections_served(port) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert connections_served(port) == 0, "the vanished peer's connection is still open"
    finally:
        peer.kill()
        peer.wait()
        server.close()
