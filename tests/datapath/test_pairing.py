"""Decode's start-up pairing with the prefills it is told of (``prefill_side_channels``), against
real prefill side channels on loopback: an incompatible prefill stops start-up with the reason and
the fix (not a request's HTTP 500 later), a compatible one is paired before any request, a late
one is waited for, an absent one is left for its first request."""

from __future__ import annotations

import socket
import threading
import time

import msgspec
import pytest
from test_peers import BLOCK_SIZE, HEADS, HOST, TOPOLOGY, CountingClient, directory, metadata

from vllm_ascend_mooncake.datapath.compat import IncompatiblePeerError
from vllm_ascend_mooncake.datapath.orders import PairingOrder
from vllm_ascend_mooncake.datapath.pairing import (
    Endpoint,
    PairingOutcome,
    PairingProbes,
    PairingVerdict,
    pair_with_prefills,
    parse_endpoints,
)
from vllm_ascend_mooncake.datapath.sender import PrefillSender, SendTracker
from vllm_ascend_mooncake.launch.ports import free_port_range


@pytest.fixture
def client():
    made = CountingClient(timeout_s=2.0)
    yield made
    made.close()


def start_prefill(port: int, tp_size: int = 1, *, block_size: int = BLOCK_SIZE) -> list:
    """The side channels of a TP ``tp_size`` prefill instance, on ``port`` and up."""
    senders = []
    for rank in range(tp_size):
        meta = msgspec.structs.replace(
            metadata("prefill", tp_size, HEADS // tp_size, block_size=block_size), tp_rank=rank
        )
        senders.append(PrefillSender(meta, SendTracker(TOPOLOGY, rank, 30.0), HOST, port + rank))
    return senders


def close(senders: list) -> None:
    for sender in senders:
        sender.close()


def test_endpoints_are_parsed_and_malformed_ones_named() -> None:
    assert parse_endpoints("") == ()
    assert parse_endpoints(" 10.0.0.1:36100, [fe80::1]:36200 ,") == (
        Endpoint("10.0.0.1", 36100),
        Endpoint("fe80::1", 36200),
    )
    for bad in ("10.0.0.1", ":36100", "host:0", "host:65536", "host:port"):
        with pytest.raises(ValueError, match="is not host:port"):
            parse_endpoints(f"127.0.0.1:1,{bad}")


def test_every_worker_of_a_listed_prefill_is_paired_before_any_request(client) -> None:
    port = free_port_range(2)
    senders = start_prefill(port, tp_size=2)
    try:
        peers = directory(client)
        paired = pair_with_prefills(peers, (Endpoint(HOST, port),), wait_s=10.0)
        assert [peer.metadata.tp_rank for peer in paired] == [0, 1]
        assert client.fetches == 2
        # the pulls that follow find both peers paired: no handshake on the request path
        assert peers.get(HOST, port) is paired[0] and peers.get(HOST, port + 1) is paired[1]
        assert client.fetches == 2
    finally:
        close(senders)


def test_an_incompatible_prefill_stops_start_up_naming_both_sides_and_the_fix(client) -> None:
    port = free_port_range(1)
    senders = start_prefill(port, block_size=3 * BLOCK_SIZE // 2)  # 24: neither divides 16
    try:
        with pytest.raises(IncompatiblePeerError) as refused:
            pair_with_prefills(directory(client), (Endpoint(HOST, port),), wait_s=10.0)
        message = str(refused.value)
        assert f"prefill instance at {HOST}:{port}" in message
        assert "prefill_side_channels" in message
        assert "block_size 24 on prefill vs 16 on decode: neither divides the other" in message
        assert "start both instances with --block-size values where one divides the other" in (
            message
        )
    finally:
        close(senders)


def test_a_listed_port_of_a_later_worker_is_refused(client) -> None:
    port = free_port_range(2)
    senders = start_prefill(port, tp_size=2)
    try:
        with pytest.raises(IncompatiblePeerError, match="list each prefill instance's side_"):
            pair_with_prefills(directory(client), (Endpoint(HOST, port + 1),), wait_s=10.0)
    finally:
        close(senders)


def test_a_prefill_that_starts_later_is_waited_for(client) -> None:
    port = free_port_range(1)
    started: list = []
    timer = threading.Timer(1.0, lambda: started.extend(start_prefill(port)))
    timer.start()
    try:
        paired = pair_with_prefills(directory(client), (Endpoint(HOST, port),), wait_s=30.0)
        # A PrefillSender listens inside its constructor: pairing can end before the timer's
        # extend() has published the senders, so they are looked at once the timer is done.
        timer.join()
        assert started and [peer.metadata.engine_id for peer in paired] == ["prefill"]
    finally:
        timer.join()
        close(started)


def test_a_prefill_that_never_answers_is_left_for_its_first_request(client) -> None:
    port = free_port_range(1)
    began = time.monotonic()
    assert pair_with_prefills(directory(client), (Endpoint(HOST, port),), wait_s=0.5) == []
    assert time.monotonic() - began >= 0.5  # it waited as long as it was told
    assert client.fetches == 0
    senders = start_prefill(port)  # it comes up later: its first request pairs it
    try:
        assert directory(client).get(HOST, port).engine_id == "prefill"
    finally:
        close(senders)


# --- the probe before a prefill engine's first pull (pair_before_pull) ------------------------


def probe_verdicts(client, order) -> list:
    """Run one pairing order through :class:`PairingProbes` as decode's TP rank 0 does."""
    probes = PairingProbes(directory(client))
    try:
        probes.submit(order)
        deadline = time.monotonic() + 30
        verdicts: list = []
        while not verdicts and time.monotonic() < deadline:
            probes.wait_for_verdict(1.0)
            verdicts = probes.take_verdicts()
        return verdicts
    finally:
        probes.close()


def test_the_probe_pairs_every_rank_so_the_first_pull_finds_them_paired(client) -> None:
    port = free_port_range(2)
    senders = start_prefill(port, tp_size=2)
    try:
        engine = senders[0].metadata.engine_id
        (verdict,) = probe_verdicts(client, PairingOrder(engine, HOST, port, 2))
        assert verdict == PairingVerdict(engine, PairingOutcome.PAIRED)
        assert client.fetches == 2
    finally:
        close(senders)


def test_the_probe_refuses_a_prefill_decode_cannot_read_with_the_reason(client) -> None:
    port = free_port_range(1)
    senders = start_prefill(port, block_size=3 * BLOCK_SIZE // 2)  # 24: neither divides 16
    try:
        engine = senders[0].metadata.engine_id
        (verdict,) = probe_verdicts(client, PairingOrder(engine, HOST, port, 1))
        assert verdict.outcome is PairingOutcome.REFUSED
        assert "block_size 24 on prefill vs 16 on decode" in verdict.reason
    finally:
        close(senders)


@pytest.mark.parametrize("host", [HOST, "a b"], ids=["nobody-listens", "malformed-host"])
def test_a_prefill_the_probe_cannot_reach_is_left_to_its_pulls(client, host) -> None:
    port = free_port_range(1)  # nobody listens there
    (verdict,) = probe_verdicts(client, PairingOrder("engine-gone", host, port, 1))
    assert verdict.outcome is PairingOutcome.UNREACHABLE and verdict.reason


def test_probes_of_prefills_that_never_answer_do_not_delay_a_live_ones(client) -> None:
    """The CI run of stop 49 saw a healthy prefill's probe queue behind two dead peers' probes
    (each waiting out the side channel's timeouts) on a two-thread pool: its request was held
    until prefill had released the KV. Every probe now runs on a thread of its own."""
    silent = []
    for _ in range(4):  # listening, never answering: a frozen prefill's side channel
        listener = socket.socket()
        listener.bind((HOST, 0))
        listener.listen(8)
        silent.append(listener)
    port = free_port_range(1)
    senders = start_prefill(port)
    probes = PairingProbes(directory(client))
    try:
        for listener in silent:
            probes.submit(PairingOrder("frozen", HOST, listener.getsockname()[1], 1))
        engine = senders[0].metadata.engine_id
        probes.submit(PairingOrder(engine, HOST, port, 1))
        deadline = time.monotonic() + 30
        verdicts: list = []
        while not verdicts and time.monotonic() < deadline:
            probes.wait_for_verdict(1.0)
            verdicts = probes.take_verdicts()
        assert verdicts == [PairingVerdict(engine, PairingOutcome.PAIRED)]
    finally:
        probes.close()
        close(senders)
        for listener in silent:
            listener.close()


def test_a_probe_cut_short_by_shut_down_says_nothing(client, caplog) -> None:
    """A worker shutting down closes its side channel under a probe still waiting on a silent
    prefill: the probe's failure is the shut-down's, not the peer's, so it is neither logged
    as the peer's nor answered (nobody holds a request for it any more)."""
    listener = socket.socket()  # listening, never answering
    listener.bind((HOST, 0))
    listener.listen(8)
    probes = PairingProbes(directory(client))
    try:
        probes.submit(PairingOrder("frozen", HOST, listener.getsockname()[1], 1))
        time.sleep(0.3)  # the probe is under way
        probes.close()
        client.close()
        deadline = time.monotonic() + 15
        while probes._pending and time.monotonic() < deadline:  # the probe thread ends
            time.sleep(0.1)
        assert probes.take_verdicts() == []
        assert "could not pair" not in caplog.text
        assert "failed" not in caplog.text
    finally:
        listener.close()
