"""A prefill worker's side channel facing a hostile peer, over real ZMQ.

Every message kind, with out-of-range, oversized, replayed and forged fields: the server answers
or drops each within a bound, holds nothing it should not, frees nothing it should not, and keeps
serving a well-behaved decode throughout.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vam_testing.datapath_cases import worker_metadata
from vllm_ascend_mooncake.core.topology import TransferTopology
from vllm_ascend_mooncake.datapath.sender import PrefillSender, SendTracker
from vllm_ascend_mooncake.datapath.side_channel import PeerRefused, SideChannelClient
from vllm_ascend_mooncake.datapath.wire import (
    PROTOCOL_VERSION,
    Ack,
    ClaimRead,
    ClaimReply,
    GetMetadata,
    ReadDone,
)
from vllm_ascend_mooncake.launch.ports import free_port_range

INCARNATION = "prefill-incarnation"
READER = "decode-worker-incarnation"
ANSWER_BOUND_S = 1.0
KINDS = ["get_metadata", "metadata", "claim_read", "claim_reply", "read_done", "ack", "error"]


class Prefill:
    """A prefill rank (decode TP 2 reads it) serving its side channel on loopback."""

    def __init__(self) -> None:
        self.tracker = SendTracker(TransferTopology(4, 1, 2), 0, 30.0)
        metadata = worker_metadata(incarnation=INCARNATION)
        self.port = free_port_range(1)
        self.sender = PrefillSender(metadata, self.tracker, "127.0.0.1", self.port)
        self.client = SideChannelClient(timeout_s=5)
        self.raw = zmq.Context.instance().socket(zmq.DEALER)
        self.raw.setsockopt(zmq.LINGER, 0)
        self.raw.connect(f"tcp://127.0.0.1:{self.port}")

    def send_raw(self, body: object) -> bytes | None:
        """Send any body in a well-formed envelope; the reply's bytes, or None if dropped."""
        self.raw.send_multipart(
            [b"", msgspec.msgpack.encode({"version": PROTOCOL_VERSION, "body": body})]
        )
        if not self.raw.poll(int(ANSWER_BOUND_S * 1000)):
            return None
        return self.raw.recv_multipart()[1]

    def still_serves(self) -> None:
        started = time.monotonic()
        assert self.client.request("127.0.0.1", self.port, GetMetadata()).engine_id == "e"
        assert time.monotonic() - started < ANSWER_BOUND_S

    def close(self) -> None:
        self.raw.close()
        self.client.close()
        self.sender.close()


@pytest.fixture(scope="module")
def prefill():
    server = Prefill()
    yield server
    server.close()


fields = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=40),
    st.text(min_size=257, max_size=300),  # past every id bound
    st.lists(st.integers(-5, 2**40), max_size=8),
)


# Every field name any message has, except a claim's wait_s: a claim that asks to wait is held
# open on purpose (up to MAX_CLAIM_PARK_S; tested in test_wire.py).
FIELD_NAMES = [
    "request_id", "decode_rank", "incarnation", "success", "reason", "reader", "status",
    "lease_s", "block_ids", "num_prompt_tokens", "decode_tp", "message", "engine_id", "regions",
]  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(KINDS),
    values=st.dictionaries(st.sampled_from(FIELD_NAMES), fields, max_size=8),
)
def test_every_message_kind_with_garbage_fields_is_answered_at_once(prefill, kind, values):
    prefill.tracker.hold("victim", block_ids=(1, 2), num_prompt_tokens=40)
    before = prefill.tracker.num_held
    reply = prefill.send_raw({"type": kind, **values})
    assert reply is not None, f"{kind} went unanswered"
    # A garbage read-done or claim may concern a transfer id it names, never "victim" unless
    # it names it with this worker's incarnation and a reader the lease was not granted to.
    assert prefill.tracker.num_held >= before - (1 if values.get("request_id") == "victim" else 0)


def test_forged_replayed_and_out_of_range_messages_free_nothing(prefill) -> None:
    tracker = prefill.tracker
    tracker.hold("t", block_ids=(7, 8), num_prompt_tokens=64)
    genuine_claim = ClaimRead("t", 0, INCARNATION, 64, reader=READER, decode_tp=2)
    granted = prefill.client.request("127.0.0.1", prefill.port, genuine_claim)
    assert isinstance(granted, ClaimReply) and granted.status == "granted"

    # Forged: another reader, no reader, another incarnation, a rank that does not exist.
    for forged in (
        ReadDone("t", 0, INCARNATION, True, reader="someone-else"),
        ReadDone("t", 0, INCARNATION, True),
        ReadDone("t", 0, "another-incarnation", True, reader=READER),
    ):
        with pytest.raises(PeerRefused):
            prefill.client.request("127.0.0.1", prefill.port, forged)
    negative_rank = {"request_id": "t", "decode_rank": -1, "incarnation": INCARNATION}
    assert b">= 0" in prefill.send_raw({"type": "read_done", "success": True, **negative_rank})
    # A stranger's claim of the granted rank, and a claim past the hold's total cap.
    stolen = ClaimRead("t", 0, INCARNATION, 64, reader="someone-else")
    assert prefill.client.request("127.0.0.1", prefill.port, stolen).status == "refused"
    assert tracker.num_held >= 1 and "t" not in tracker.take_finished()

    # Replayed: the genuine claim again only renews the genuine lease; the genuine notice twice
    # counts once (rank 1 still holds the transfer).
    assert prefill.client.request("127.0.0.1", prefill.port, genuine_claim).status == "granted"
    done = ReadDone("t", 0, INCARNATION, True, reader=READER)
    for _ in range(2):
        assert prefill.client.request("127.0.0.1", prefill.port, done) == Ack()
    assert "t" not in tracker.take_finished()
    prefill.still_serves()


@pytest.mark.parametrize("decode_tp", [3, 1 << 20])
def test_a_reader_of_a_decode_tp_prefill_cannot_pair_with_is_refused_over_the_wire(
    prefill, decode_tp: int
) -> None:
    transfer = f"tp-{decode_tp}"  # the prefill fixture serves the whole module
    prefill.tracker.hold(transfer, block_ids=(3,), num_prompt_tokens=20)
    claim = ClaimRead(transfer, 0, INCARNATION, 20, reader=READER, decode_tp=decode_tp)
    reply = prefill.client.request("127.0.0.1", prefill.port, claim)
    assert reply.status == "refused" and f"runs TP {decode_tp}" in reply.reason
    assert "prefill TP 1 cannot pair with it" in reply.reason
    assert transfer in prefill.tracker.take_finished()  # freed at once, not at its timeout
    prefill.still_serves()
