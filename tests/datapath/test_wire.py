"""Side-channel messages: round trips, version checks, and fuzzed input never crashes anything."""

from __future__ import annotations

import contextlib
import threading
import time

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from vam_testing.waiting import wait_until
from vllm_ascend_mooncake.datapath.side_channel import (
    Park,
    PeerRefused,
    SideChannelClient,
    SideChannelServer,
)
from vllm_ascend_mooncake.datapath.wire import (
    MAX_ID_CHARS,
    MAX_MESSAGE_BYTES,
    MAX_TEXT_CHARS,
    PROTOCOL_VERSION,
    Ack,
    ClaimRead,
    ClaimReply,
    GetMetadata,
    ReadDone,
    WireError,
    bounded_text,
    decode,
    encode,
)
from vllm_ascend_mooncake.launch.ports import free_port_range


@pytest.mark.parametrize(
    "message",
    [
        GetMetadata(),
        ReadDone("r", 1, "inc", False, "why"),
        ClaimRead("r", 0, "i"),
        ClaimReply("granted", 3.0),
        Ack(),
    ],
)
def test_round_trip(message) -> None:
    assert decode(encode(message)) == message


def test_other_protocol_versions_are_named() -> None:
    data = msgspec.msgpack.encode({"version": 99, "body": {"type": "ack"}})
    with pytest.raises(WireError, match="protocol v99"):
        decode(data)


@settings(max_examples=500)
@given(st.binary(max_size=512))
def test_random_bytes_decode_or_raise_wire_error(data: bytes) -> None:
    with contextlib.suppress(WireError):
        decode(data)


@settings(max_examples=300)
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.floats()
        | st.text(max_size=20),
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=20,
    )
)
def test_structured_garbage_decodes_or_raises_wire_error(value) -> None:
    for wrapped in (value, {"version": 1, "body": value}):
        with contextlib.suppress(WireError):
            decode(msgspec.msgpack.encode(wrapped))


def _nested(depth: int) -> bytes:
    """``{"version": 3, "x": [[[...nil...]]]}``: about ``depth`` bytes of msgpack (#27 row 1)."""
    prefix = b"\x82" + msgspec.msgpack.encode("version") + b"\x03" + msgspec.msgpack.encode("x")
    return prefix + b"\x91" * depth + b"\xc0"


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_deeply_nested_messages_raise_wire_error(depth: int) -> None:
    with pytest.raises(WireError, match="nested too deeply"):
        decode(_nested(depth))


def test_a_deeply_nested_message_leaves_the_server_serving() -> None:
    port = free_port_range(1)
    server = SideChannelServer("127.0.0.1", port, lambda message: Ack())
    client = SideChannelClient(timeout_s=5)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        raw.connect(f"tcp://127.0.0.1:{port}")
        raw.send_multipart([b"", _nested(1_000)])
        assert raw.poll(5000)
        assert b"nested too deeply" in raw.recv_multipart()[1]
        assert server._thread.is_alive()
        assert client.request("127.0.0.1", port, GetMetadata()) == Ack()
    finally:
        raw.close()
        client.close()
        server.close()


def test_server_survives_malformed_frames_and_handler_errors() -> None:
    def handler(message):
        if isinstance(message, ClaimRead):
            raise RuntimeError("boom")
        return Ack()

    port = free_port_range(1)
    server = SideChannelServer("127.0.0.1", port, handler)
    client = SideChannelClient(timeout_s=5)
    try:
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(f"tcp://127.0.0.1:{port}")
        raw.send_multipart([b"only-one-frame"])
        raw.send_multipart([b"", b"\xff\x00garbage"])
        assert raw.poll(5000)
        assert b"malformed" in raw.recv_multipart()[1]
        raw.close()
        with pytest.raises(PeerRefused, match="refused ClaimRead: internal error: boom"):
            client.request("127.0.0.1", port, ClaimRead("r", 0, "i"))
        assert client.request("127.0.0.1", port, GetMetadata()) == Ack()
    finally:
        client.close()
        server.close()


def test_a_parked_request_is_answered_on_wake_or_at_its_deadline_and_blocks_nobody() -> None:
    """Long poll: a claim the handler cannot answer yet waits on the server, is answered as soon
    as a wake finds an answer, gets the fallback at its deadline, and meanwhile another thread's
    exchange with the same server goes through."""
    ready = threading.Event()

    def handler(message):
        if isinstance(message, ClaimRead):
            if ready.is_set() and message.request_id == "soon":
                return ClaimReply("granted", 1.0)
            return Park(time.monotonic() + message.wait_s, ClaimReply("pending"))
        return Ack()

    port = free_port_range(1)
    server = SideChannelServer("127.0.0.1", port, handler)
    client = SideChannelClient(timeout_s=10)
    replies: dict[str, tuple[str, float]] = {}

    def claim(request_id: str, wait_s: float) -> None:
        sent = time.monotonic()
        reply = client.request("127.0.0.1", port, ClaimRead(request_id, 0, "i", wait_s=wait_s))
        replies[request_id] = (reply.status, time.monotonic() - sent)

    try:
        threads = [
            threading.Thread(target=claim, args=("soon", 8.0)),
            threading.Thread(target=claim, args=("never", 0.5)),
        ]
        for thread in threads:
            thread.start()
        time.sleep(0.2)
        assert client.request("127.0.0.1", port, GetMetadata()) == Ack()  # not queued behind
        assert not replies, "parked claims were answered before there was an answer"
        ready.set()
        server.wake()
        for thread in threads:
            thread.join(timeout=10)
        assert replies["soon"][0] == "granted" and replies["soon"][1] < 4.0  # well before 8 s
        assert replies["never"][0] == "pending" and replies["never"][1] >= 0.5
    finally:
        client.close()
        server.close()


def test_a_hostile_peer_is_bounded_and_the_server_keeps_serving() -> None:
    """Oversized, negative and over-long fields are refused before any handler sees them, a
    frame above MAX_MESSAGE_BYTES costs the sender its connection (ZMQ never buffers it), and
    the server answers everyone else within a second throughout."""
    seen = []

    def handler(message):
        seen.append(message)
        return Ack()

    port = free_port_range(1)
    server = SideChannelServer("127.0.0.1", port, handler)
    client = SideChannelClient(timeout_s=5)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"tcp://127.0.0.1:{port}")

    def refused(body: dict) -> bytes:
        raw.send_multipart(
            [b"", msgspec.msgpack.encode({"version": PROTOCOL_VERSION, "body": body})]
        )
        assert raw.poll(5000), "no answer to a malformed message"
        return raw.recv_multipart()[1]

    try:
        claim = {"type": "claim_read", "decode_rank": 0, "incarnation": "i"}
        assert b"length <= 256" in refused({**claim, "request_id": "r" * (MAX_ID_CHARS + 1)})
        assert b">= 0" in refused({**claim, "request_id": "r", "decode_rank": -1})
        done = {"type": "read_done", "request_id": "r", "decode_rank": 0, "incarnation": "i"}
        huge_reason = {**done, "success": False, "reason": "x" * (MAX_TEXT_CHARS + 1)}
        assert b"length <=" in refused(huge_reason)
        assert seen == []  # no handler saw any of them

        raw.send_multipart([b"", b"\x00" * (MAX_MESSAGE_BYTES + 1)])
        started = time.monotonic()
        assert client.request("127.0.0.1", port, GetMetadata()) == Ack()
        assert time.monotonic() - started < 1.0
        assert not raw.poll(500), "an oversized frame was answered"
    finally:
        raw.close()
        client.close()
        server.close()


def test_our_own_long_reasons_are_cut_to_fit_the_wire() -> None:
    reason = bounded_text("y" * (10 * MAX_TEXT_CHARS))
    assert len(reason) == MAX_TEXT_CHARS
    assert decode(encode(ReadDone("r", 0, "i", False, reason))).reason == reason


def test_with_a_shared_secret_only_peers_that_know_it_are_served() -> None:
    """Every message carries an HMAC: the server refuses (and logs) requests without a valid
    one, before any handler sees them; a client refuses a server that cannot sign."""
    seen = []

    def handler(message):
        seen.append(message)
        return Ack()

    secret = b"a shared secret of some length"
    port = free_port_range(1)
    server = SideChannelServer("127.0.0.1", port, handler, secret=secret)
    plain_port = free_port_range(1)
    plain_server = SideChannelServer("127.0.0.1", plain_port, handler)
    insider = SideChannelClient(timeout_s=5, secret=secret)
    outsider = SideChannelClient(timeout_s=5)
    impostor = SideChannelClient(timeout_s=5, secret=b"another secret of some length")
    try:
        assert insider.request("127.0.0.1", port, GetMetadata()) == Ack()
        with pytest.raises(PeerRefused, match="unauthenticated"):
            outsider.request("127.0.0.1", port, ClaimRead("r", 0, "i"))
        with pytest.raises(PeerRefused, match="without a valid side-channel MAC"):
            impostor.request("127.0.0.1", port, ClaimRead("r", 0, "i"))  # nor can it check ours
        assert len(seen) == 1  # only the insider's message reached the handler
        with pytest.raises(PeerRefused, match="without a valid side-channel MAC"):
            insider.request("127.0.0.1", plain_port, GetMetadata())
        assert insider.request("127.0.0.1", port, GetMetadata()) == Ack()  # still serving
    finally:
        for client in (insider, outsider, impostor):
            client.close()
        server.close()
        plain_server.close()


def test_region_packing_travels_and_peers_of_either_version_understand_each_other() -> None:
    """The chunk packing was added to RegionInfo without a protocol bump: a peer that does not
    send it decodes as unknown packing, and a peer that does not know it ignores it."""
    from vllm_ascend_mooncake.core.layout import BlockOrder, Region, RegionLayout, RowGroup
    from vllm_ascend_mooncake.datapath.wire import RegionInfo

    packing = (RowGroup(64, 2), RowGroup(1, 128))
    layout = RegionLayout(BlockOrder.HEAD_MAJOR, 4, 2 * 32 * 256, 2, 32, 256, packing=packing)
    info = RegionInfo.of(Region("layer.0", 4096, layout))
    wire_bytes = msgspec.msgpack.encode(info)
    assert msgspec.msgpack.decode(wire_bytes, type=RegionInfo).to_region().layout == layout

    class OldRegionInfo(msgspec.Struct, frozen=True):  # RegionInfo before the packing field
        name: str
        base: int
        block_order: str
        num_blocks: int
        block_stride: int
        num_heads: int
        tokens_per_block: int
        head_token_bytes: int

    old = msgspec.msgpack.decode(wire_bytes, type=OldRegionInfo)
    assert old.head_token_bytes == 256
    from_old = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=RegionInfo)
    assert from_old.to_region().layout.packing == ()
    with pytest.raises(WireError, match="not a valid layout"):
        msgspec.structs.replace(info, packing=[(0, 2, 1)]).to_region()


def test_a_regions_head_group_travels_and_an_older_peer_reads_as_the_models() -> None:
    """A draft layer's regions name their head group (``kv_heads``), added without a protocol
    bump: a peer that does not send it has every region in the model's group."""
    from vllm_ascend_mooncake.core.layout import BlockOrder, Region, RegionLayout
    from vllm_ascend_mooncake.datapath.wire import RegionInfo

    layout = RegionLayout(BlockOrder.HEAD_MAJOR, 4, 32 * 256, 1, 32, 256, kv_heads=2)
    info = RegionInfo.of(Region("model.layers.2.self_attn.attn", 4096, layout))
    wire_bytes = msgspec.msgpack.encode(info)
    assert msgspec.msgpack.decode(wire_bytes, type=RegionInfo).to_region().layout == layout
    older = msgspec.msgpack.encode(msgspec.structs.asdict(info) | {"kv_heads": 0})
    assert msgspec.msgpack.decode(older, type=RegionInfo).to_region().layout.kv_heads == 0
    trimmed = {k: v for k, v in msgspec.structs.asdict(info).items() if k != "kv_heads"}
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(trimmed), type=RegionInfo)
    assert decoded.to_region().layout.kv_heads == 0


def test_a_client_keeps_a_bounded_number_of_sockets_however_many_peers_it_met() -> None:
    """Prefill endpoints come and go (rollouts, #27 row 6): past the ZMQ context's 1,023 sockets
    every pull to a new prefill would fail; the least recently used peer's socket is closed."""
    cap = 16  # the default is a share of the process's socket budget (thousands)
    port = free_port_range(1)
    server = SideChannelServer("127.0.0.1", port, lambda message: Ack())
    client = SideChannelClient(timeout_s=5, max_peer_sockets=cap)
    try:
        unused = free_port_range(1)  # loopback addresses only; nothing listens there
        for i in range(8 * cap):  # past the cap, not the fd limit
            client._socket((f"127.0.{i // 250 + 1}.{i % 250 + 1}", unused))
            assert len(client._all_sockets) <= cap
        assert client.request("127.0.0.1", port, GetMetadata()) == Ack()
    finally:
        client.close()
        server.close()


def test_a_wake_for_one_key_handles_only_the_requests_parked_for_it() -> None:
    """Every hold woke every parked claim, which the handler then ran again (#27 row 8: 1,600
    parked claims cost ms of GIL-holding work per hold); a keyed wake re-runs only its own."""
    handled: list[str] = []
    ready: set[str] = set()

    def handler(message):
        if isinstance(message, ClaimRead):
            handled.append(message.request_id)
            if message.request_id in ready:
                return ClaimReply("granted", 1.0)
            return Park(time.monotonic() + 30, ClaimReply("pending"), key=message.request_id)
        return Ack()

    port = free_port_range(1)
    server = SideChannelServer("127.0.0.1", port, handler)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        raw.connect(f"tcp://127.0.0.1:{port}")
        for i in range(50):
            raw.send_multipart([b"", encode(ClaimRead(f"t-{i}", 0, "i", wait_s=30))])
        wait_until(lambda: len(handled) >= 50, "the server handles all 50 claims")
        assert len(handled) == 50 and not raw.poll(0)  # all parked
        ready.add("t-7")
        server.wake("t-7")
        assert raw.poll(5000)
        reply = decode(raw.recv_multipart()[1])
        assert isinstance(reply, ClaimReply) and reply.status == "granted"
        assert handled[50:] == ["t-7"]  # the other 49 were not handled again
        server.wake()  # a wake for all handles every parked one again
        wait_until(lambda: len(handled) >= 100, "the wake for all handles the 49 parked again")
        assert sorted(handled[51:]) == sorted(f"t-{i}" for i in range(50) if i != 7)
    finally:
        raw.close()
        server.close()
