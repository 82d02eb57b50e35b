"""The decode side's directory of prefill peers, against a real prefill side channel (loopback).

Metadata is fetched once per peer, checked, decoded once into a ``PrefillPeer`` and shared; it is
fetched again only once invalidated or when a request names another incarnation, and an
incompatible peer is refused (and never cached).
"""

from __future__ import annotations

import dataclasses
import socket
import time
import uuid

import pytest
import torch

from vllm_ascend_mooncake.core.topology import TransferTopology
from vllm_ascend_mooncake.datapath import peers as peers_module
from vllm_ascend_mooncake.datapath import side_channel
from vllm_ascend_mooncake.datapath.compat import IncompatiblePeerError
from vllm_ascend_mooncake.datapath.peers import PeerDirectory, PrefillPeer
from vllm_ascend_mooncake.datapath.registration import regions_from_vllm_views
from vllm_ascend_mooncake.datapath.sender import PrefillSender, SendTracker
from vllm_ascend_mooncake.datapath.side_channel import (
    PeerSilent,
    SideChannelClient,
    SideChannelError,
)
from vllm_ascend_mooncake.datapath.wire import (
    GetMetadata,
    ModelIdentity,
    RegionInfo,
    WorkerMetadata,
)
from vllm_ascend_mooncake.launch.ports import free_port_range

HOST = "127.0.0.1"
HEADS, BLOCK_SIZE, HEAD_SIZE, LAYERS, BLOCKS = 4, 16, 8, 2, 8
TOPOLOGY = TransferTopology(HEADS, 1, 2)  # prefill TP 1, decode TP 2


def metadata(role: str, tp_size: int, heads: int, block_size: int = BLOCK_SIZE) -> WorkerMetadata:
    """A worker's metadata over a real (unregistered) CPU cache of ``heads`` heads per rank."""
    content = 2 * HEAD_SIZE
    raw = torch.empty(LAYERS * BLOCKS * heads * BLOCK_SIZE * content, dtype=torch.float16)
    views = {
        f"layer.{i}": raw[i * raw.numel() // LAYERS : (i + 1) * raw.numel() // LAYERS].view(
            BLOCKS, heads, BLOCK_SIZE, content
        )
        for i in range(LAYERS)
    }
    regions = regions_from_vllm_views(
        views, num_kv_heads=heads, block_size=BLOCK_SIZE, is_mla=False
    )
    return WorkerMetadata(
        engine_id=role,
        incarnation=uuid.uuid4().hex,
        tp_rank=0,
        tp_size=tp_size,
        dp_rank=0,
        dp_size=1,
        pp_size=1,
        transport_session=f"{role}-session",
        identity=ModelIdentity(
            "reference", "float16", "auto", block_size, HEAD_SIZE, HEADS, LAYERS, False
        ),
        regions=[RegionInfo.of(r) for r in regions],
    )


class CountingClient(SideChannelClient):
    """A real client that counts metadata fetches."""

    def __init__(self, timeout_s: float = 5.0) -> None:
        super().__init__(timeout_s=timeout_s)
        self.fetches = 0

    def fetch_metadata(self, host: str, port: int):
        self.fetches += 1
        return super().fetch_metadata(host, port)


@pytest.fixture
def prefill():
    port = free_port_range(1)
    tracker = SendTracker(TOPOLOGY, 0, 30.0)
    sender = PrefillSender(metadata("prefill", 1, HEADS), tracker, HOST, port)
    yield sender, port
    sender.close()


@pytest.fixture
def client():
    made = CountingClient()
    yield made
    made.close()


def directory(client) -> PeerDirectory:
    return PeerDirectory(client, metadata("decode", 2, HEADS // 2), TOPOLOGY)


def test_metadata_is_fetched_once_and_decoded_once(prefill, client, monkeypatch) -> None:
    sender, port = prefill
    peers = directory(client)
    first = peers.get(HOST, port, "prefill")
    assert isinstance(first, PrefillPeer) and client.fetches == 1
    assert first.metadata == sender.metadata
    assert first.regions == tuple(sender.metadata.to_regions())
    assert (first.transport_session, first.incarnation, first.engine_id) == (
        "prefill-session",
        sender.metadata.incarnation,
        "prefill",
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.regions = ()
    decoded = []
    original = WorkerMetadata.to_regions
    monkeypatch.setattr(
        WorkerMetadata, "to_regions", lambda self: decoded.append(self) or original(self)
    )
    for _ in range(3):  # later requests: same engine, any or the same incarnation
        again = peers.get(HOST, port, "prefill", sender.metadata.incarnation)
        assert again is first and peers.get(HOST, port) is first
    assert client.fetches == 1 and decoded == []


def test_invalidate_fetches_and_decodes_again(prefill, client) -> None:
    _, port = prefill
    peers = directory(client)
    first = peers.get(HOST, port)
    peers.invalidate(HOST, port)
    second = peers.get(HOST, port)
    assert client.fetches == 2
    assert second is not first and second.regions == first.regions
    assert peers.get(HOST, port) is second and client.fetches == 2
    peers.invalidate(HOST, port + 1)  # another peer: nothing happens to this one
    assert peers.get(HOST, port) is second and client.fetches == 2


def test_a_restarted_peer_is_fetched_again_when_a_request_names_it(prefill, client) -> None:
    sender, port = prefill
    peers = directory(client)
    old = peers.get(HOST, port)
    sender.metadata = metadata("prefill", 1, HEADS)  # the worker restarted: new incarnation
    assert peers.get(HOST, port) is old  # nothing says so yet
    new = peers.get(HOST, port, incarnation=sender.metadata.incarnation)
    assert new.incarnation == sender.metadata.incarnation != old.incarnation
    assert client.fetches == 2 and peers.get(HOST, port) is new


def test_a_request_naming_another_engine_is_refused(prefill, client) -> None:
    _, port = prefill
    peers = directory(client)
    cached = peers.get(HOST, port)
    with pytest.raises(SideChannelError, match="expects engine other"):
        peers.get(HOST, port, "other")
    assert client.fetches == 2  # it asked the peer before refusing
    assert peers.get(HOST, port) is cached


def test_an_incompatible_peer_is_refused_and_never_cached(client) -> None:
    port = free_port_range(1)
    # 24 vs 16 tokens per block: neither divides the other (divisible sizes may pair)
    other_block_size = metadata("prefill", 1, HEADS, block_size=3 * BLOCK_SIZE // 2)
    sender = PrefillSender(other_block_size, SendTracker(TOPOLOGY, 0, 30.0), HOST, port)
    try:
        peers = directory(client)
        for fetches in (1, 2):
            with pytest.raises(
                IncompatiblePeerError, match="block_size 24 on prefill vs 16 on decode: neither"
            ):
                peers.get(HOST, port)
            assert client.fetches == fetches
    finally:
        sender.close()


@pytest.fixture
def silent_port():
    """A port that accepts TCP connections and never answers (a frozen worker: the kernel still
    completes the handshake)."""
    listener = socket.create_server((HOST, 0))
    yield listener.getsockname()[1]
    listener.close()


def test_a_silent_peer_is_asked_again_then_given_up(monkeypatch, silent_port) -> None:
    monkeypatch.setattr(peers_module, "FETCH_BACKOFF_S", (0.0, 0.0, 0.0))
    silent = CountingClient(timeout_s=0.05)
    try:
        with pytest.raises(PeerSilent, match="no reply"):
            directory(silent).get(HOST, silent_port)
        assert silent.fetches == len(peers_module.FETCH_BACKOFF_S)
    finally:
        silent.close()


def test_a_closed_port_fails_at_once_without_waiting_for_timeouts() -> None:
    """Issue #27: a request naming a prefill nobody runs cost 31 s (three 10 s metadata
    timeouts) before its error; a TCP connect first tells a closed port in one round trip."""
    client = CountingClient(timeout_s=10.0)
    try:
        with pytest.raises(PeerSilent, match=r"nobody listens on .* \(connection refused\)"):
            directory(client).get(HOST, free_port_range(1))
        assert client.fetches == 0  # no metadata request, so no 10 s timeout waited out
    finally:
        client.close()


def test_a_peer_found_down_is_not_asked_again_until_its_cooldown_ends(
    monkeypatch, prefill, silent_port
) -> None:
    monkeypatch.setattr(peers_module, "FETCH_BACKOFF_S", (0.0, 0.0))
    client = CountingClient(timeout_s=0.05)
    peers = PeerDirectory(client, metadata("decode", 2, HEADS // 2), TOPOLOGY, cooldown_s=0.5)
    try:
        with pytest.raises(PeerSilent, match="no reply"):
            peers.get(HOST, silent_port)
        fetches = client.fetches
        with pytest.raises(PeerSilent, match=r"not asked for .* it did not answer"):
            peers.get(HOST, silent_port)
        assert client.fetches == fetches  # failed at once
        time.sleep(0.6)
        with pytest.raises(PeerSilent, match="no reply"):
            peers.get(HOST, silent_port)
        assert client.fetches == 2 * fetches  # asked again once the cooldown was over
        # one peer down costs the others nothing
        _, port = prefill
        assert peers.get(HOST, port).engine_id == "prefill"
    finally:
        client.close()


@pytest.mark.parametrize("host", ["127.0.0.1 ", "a b", "10.0.0.1\n", "-x", "_x", ""])
def test_a_malformed_host_fails_at_once_with_its_reason_and_no_socket(host) -> None:
    """Issue #43 item 2: ZMQ's connect() refused such a host only after the socket was made,
    which then leaked (three a request, one per metadata attempt): ~347 requests exhausted the
    ZMQ context's 1,023 sockets. Asking again cannot help either."""
    client = CountingClient(timeout_s=10.0)
    try:
        with pytest.raises(SideChannelError, match="neither an IP address nor a host name"):
            directory(client).get(host, 40000)
        assert client.fetches <= 1  # not asked again
        assert client._all_sockets == {}
    finally:
        client.close()


def test_a_socket_whose_connect_fails_is_closed(monkeypatch) -> None:
    """Whatever ZMQ refuses to connect to, the socket made for it is not kept."""
    monkeypatch.setattr(side_channel, "check_address", lambda host, port: None)
    client = SideChannelClient(timeout_s=1.0)
    try:
        with pytest.raises(SideChannelError, match="Invalid argument"):
            client.request("a b", 40000, GetMetadata())
        assert client._all_sockets == {}
        assert client._local.sockets == {}
    finally:
        client.close()
