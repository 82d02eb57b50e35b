"""Prefill bookkeeping: holds, read leases, early notifications, expiry, exactly-once release."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from vllm_ascend_mooncake.core.topology import TransferTopology, request_seed
from vllm_ascend_mooncake.datapath import sender
from vllm_ascend_mooncake.datapath.holds import Hold, HoldTable
from vllm_ascend_mooncake.datapath.remembered import EarlyNotices, ReleasedIds
from vllm_ascend_mooncake.datapath.sender import MAX_HOLD_TIMEOUTS, SendTracker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def tracker(prefill_tp=1, decode_tp=2, heads=4, rank=0, timeout=10.0):
    clock = Clock()
    topo = TransferTopology(heads, prefill_tp, decode_tp)
    return SendTracker(topo, rank, timeout, clock=clock), clock, topo


def test_released_once_after_every_reader_is_done() -> None:
    t, _, _ = tracker()
    t.hold("r")
    assert t.claim("r", 0).status == "granted"
    t.read_done("r", 0, True)
    assert t.take_finished() == set()
    t.read_done("r", 1, True)
    t.read_done("r", 1, True)  # duplicate
    assert t.take_finished() == {"r"}
    assert t.take_finished() == set()


def test_a_rank_nobody_reads_finishes_at_once() -> None:
    _, _, topo = tracker(prefill_tp=4, decode_tp=1, heads=2)
    unread = next(p for p in range(4) if not topo.readers_of(p, request_seed("r")))
    t2 = SendTracker(topo, unread, 10.0)
    t2.hold("r")
    assert t2.take_finished() == {"r"}


def test_read_done_before_hold() -> None:
    t, _, _ = tracker()
    t.read_done("r", 0, True)
    t.read_done("r", 1, False)  # a failed read also ends that reader's interest
    t.hold("r")
    assert t.take_finished() == {"r"}


def test_claims_extend_the_deadline_and_late_claims_are_refused() -> None:
    t, clock, _ = tracker(timeout=10.0)
    assert t.claim("r", 0).status == "pending"  # not held yet: ask again
    t.hold("r")
    clock.now = 8.0
    reply = t.claim("r", 0)
    assert (reply.status, reply.lease_s) == ("granted", 10.0)
    clock.now = 12.0  # past the hold deadline, within the lease
    assert t.take_finished() == set()
    clock.now = 18.5
    assert t.take_finished() == {"r"}
    assert t.num_expired == 1 and t.take_expired_count() == 1 and t.take_expired_count() == 0
    refused = t.claim("r", 0)
    assert refused.status == "refused" and "released" in refused.reason
    t.hold("r")  # a stale hold cannot resurrect it
    assert t.take_finished() == set()


def test_only_readers_may_claim() -> None:
    t, _, topo = tracker(prefill_tp=2, decode_tp=2, heads=4)
    t.hold("r")
    (reader,) = topo.readers_of(0, request_seed("r"))
    assert t.claim("r", 1 - reader).status == "refused"


def test_memory_of_released_and_early_ids_is_bounded_in_time() -> None:
    t, clock, _ = tracker(timeout=1.0)
    for i in range(100):
        t.read_done(f"ghost-{i}", 0, True)
    t.hold("r")
    t.read_done("r", 0, True)
    t.read_done("r", 1, True)
    assert t.take_finished() == {"r"}
    clock.now = 10.0
    t.take_finished()
    assert t.num_remembered == 0


def test_remembered_ids_are_forgotten_oldest_first_without_a_scan_per_step() -> None:
    """Prefill rescanned every remembered id each engine step under the tracker lock (#27 row 8):
    at 200 requests/s, 48,000 ids. They expire in the order they were added, so only the oldest
    are looked at."""
    visits = []  # one entry per remembered id looked at

    class Visited(OrderedDict):
        def _count(self, entries):
            for entry in entries:
                visits.append(entry)
                yield entry

        def __iter__(self):
            return self._count(super().__iter__())

        def items(self):
            return self._count(super().items())

        def values(self):
            return self._count(super().values())

    # as the tracker remembers them: MEMORY_TIMEOUTS x a 1 s release timeout
    released = ReleasedIds(sender.MEMORY_TIMEOUTS * 1.0, entries=Visited())
    for i in range(1000):
        released.drop(f"old-{i}", "dropped", now=i * 0.001)
    released.drop("old-0", "dropped", now=1.0)  # already remembered: keeps its place
    visits.clear()
    released.expire(2.0005)  # old-0 (forget at 2.0) has expired; old-1 (2.001) not yet
    assert "old-0" not in released and "old-1" in released
    assert len(visits) <= 3  # looked at the oldest entries, not at all 1,000
    released.expire(2.9985)  # old-998 forgotten at 2.998, old-999 at 2.999
    assert list(released) == ["old-999"]


def test_a_tracker_forgets_remembered_ids_as_vllm_steps() -> None:
    t, clock, _ = tracker(timeout=1.0)  # remembered MEMORY_TIMEOUTS x 1 s
    for i in range(10):
        clock.now = i * 0.1
        t.drop(f"old-{i}")
    t.read_done("early", 0, True)
    assert t.num_remembered == 11
    clock.now = 2.05  # old-0 (forget at 2.0) has expired; old-1 (2.1) not yet
    t.take_finished()
    assert t.num_remembered == 10
    clock.now = 3.0
    t.take_finished()
    assert t.num_remembered == 0


def test_early_notices_keep_the_first_decode_tp_and_a_bounded_number() -> None:
    notices = EarlyNotices(remember_s=2.0, limit=2)
    assert notices.note("a", 0, -1, now=0.0) and notices.note("a", 1, -1, now=0.5)
    assert notices.note("a", 2, 1, now=0.5) is False  # another decode TP: the first is kept
    assert notices.note("b", 0, 2, now=1.0)
    assert notices.note("c", 0, -1, now=1.0)  # past the limit: ignored, counted
    assert notices.num_ignored == 1 and "c" not in notices
    assert notices.take("a") == ({0, 1}, -1) and notices.take("a") == (set(), -1)
    notices.expire(3.0)  # b (forget at 3.0) goes too
    assert len(notices) == 0


def test_the_hold_table_renews_a_hold_within_its_bound_and_takes_out_overdue_ones() -> None:
    table = HoldTable(10.0)
    held = Hold("r", {0}, 0.0)
    table.start("t", held, now=5.0)
    assert (held.deadline, held.hold_ends) == (15.0, 5.0 + MAX_HOLD_TIMEOUTS * 10.0)
    assert table.renew("t", held, 12.0) is None and held.deadline == 22.0
    assert table.renew("t", held, 44.0) is None and held.deadline == 45.0  # capped at its bound
    assert "release timeouts already" in (table.renew("t", held, 45.0) or "")
    assert table.take_overdue(44.9) == [] and "t" in table
    assert table.take_overdue(45.0) == [("t", held)] and len(table) == 0


def test_the_hold_table_takes_out_what_ends_in_the_order_held_without_looking_at_the_rest() -> None:
    """A step's expiry and an idle step's soonest deadline cost what ends, not what is held:
    with 10,000 held, a step looks at the few entries due (and stale ones), not every hold."""
    table = HoldTable(10.0)
    holds = {f"t{i}": Hold(f"r{i}", {0}, 0.0) for i in range(10_000)}
    for i, (transfer_id, held) in enumerate(holds.items()):
        table.start(transfer_id, held, now=float(i % 7))  # deadlines out of held order
    table.renew("t0", holds["t0"], now=20.0)  # t0 now ends at 30: its first entry goes stale
    table.pop("t1")  # read and released: its entry goes stale
    assert table.soonest_deadline() == 10.0  # t7, t14, ... (t0 renewed, t1 gone)
    due = table.take_overdue(10.0)
    assert [t for t, _ in due] == [f"t{i}" for i in range(7, 10_000, 7)]  # the order held
    looked_at = []
    original = table._is_live
    table._is_live = lambda entry: looked_at.append(entry) or original(entry)  # type: ignore[method-assign]
    assert table.take_overdue(10.5) == [] and table.soonest_deadline() == 11.0
    assert len(looked_at) <= 2  # the heap's top, not the 8,500 holds
    due = table.take_overdue(16.0)
    assert "t0" not in {t for t, _ in due} and "t0" in table and len(table) == 1
    assert table.take_overdue(30.0) == [("t0", holds["t0"])]
    assert table.soonest_deadline() == float("inf")


def test_the_hold_table_heap_stays_within_twice_the_holds_under_renewals() -> None:
    table = HoldTable(10.0)
    held = Hold("r", {0}, 0.0)
    table.start("t", held, now=0.0)
    for i in range(10_000):  # a reader renewing its lease far more often than anything ends
        held.hold_ends = float("inf")
        table.renew("t", held, now=0.001 * (i + 1))
    assert len(table._deadlines) <= 2 * len(table) + 64 + 1


def test_a_claim_before_prefill_is_done_waits_then_gets_the_block_ids() -> None:
    t, _, _ = tracker()
    assert t.claim("t", 0, num_prompt_tokens=70).status == "pending"
    t.hold("t", request_id="vllm-1", block_ids=(7, 8, 9), num_prompt_tokens=70)
    reply = t.claim("t", 0, num_prompt_tokens=70)
    assert (reply.status, reply.block_ids, reply.num_prompt_tokens) == ("granted", [7, 8, 9], 70)
    t.read_done("t", 0, True)
    t.read_done("t", 1, True)
    assert t.take_finished() == {"vllm-1"}  # reported under vLLM's id, not the transfer id


def test_a_claim_for_another_prompt_is_refused() -> None:
    t, _, _ = tracker()
    t.hold("t", request_id="vllm-1", block_ids=(7, 8, 9), num_prompt_tokens=70)
    refused = t.claim("t", 0, num_prompt_tokens=71)
    assert refused.status == "refused" and "prompts differ" in refused.reason


def test_a_dropped_transfer_is_refused_at_once_and_never_reported() -> None:
    t, _, _ = tracker()
    assert t.claim("t", 0).status == "pending"
    t.drop("t")
    refused = t.claim("t", 0)
    assert refused.status == "refused" and "prefill failed" in refused.reason
    t.read_done("t", 0, False)  # the refused decode's notice
    assert t.take_finished() == set()


def test_a_router_drop_before_the_hold_frees_the_hold_the_moment_it_comes() -> None:
    """The router has prefill's answer (its client then leaves) one engine step before this
    worker registers the hold: the drop used to find nothing, be forgotten, and leave the
    blocks held until the release timeout (a clean-clone CI run's blocks not freed within 30 s).
    It is remembered; the hold, when it comes, is freed at once, and a parked claim is told
    the client left."""
    t, clock, _ = tracker()
    changed: list = []
    t.on_change = changed.append
    assert t.claim("t", 0).status == "pending"  # overlapped legs: decode claimed first
    dropped = t.drop_unread("t")
    assert dropped.status == "refused" and "before it was held" in dropped.reason
    assert changed == ["t"]  # the parked claim is answered now
    assert t.claim("t", 0).status == "dropped"
    assert t.dropped("t")
    t.hold("t", request_id="vllm-1", block_ids=(1,), num_prompt_tokens=10)
    assert t.take_finished() == {"vllm-1"}  # freed at once, not at its deadline
    assert t.claim("t", 1).status == "dropped"
    clock.now += 100.0
    assert t.take_finished() == set() and t.num_expired == 0


def test_a_router_drop_of_a_held_unleased_transfer_frees_it_and_a_leased_one_waits() -> None:
    t, _, _ = tracker()
    t.hold("free", request_id="vllm-1")
    assert t.drop_unread("free").reason.startswith("freed:")
    assert t.take_finished() == {"vllm-1"}
    assert t.drop_unread("free").reason == "it is not held"  # said twice: nothing more
    t.hold("leased", request_id="vllm-2")
    assert t.claim("leased", 0, reader="decode-worker").status == "granted"
    assert t.drop_unread("leased").status == "held"
    assert t.take_finished() == set()


def test_a_reused_transfer_id_frees_the_second_request_at_once() -> None:
    t, _, _ = tracker()
    t.hold("t", request_id="vllm-1", block_ids=(1,), num_prompt_tokens=10)
    t.hold("t", request_id="vllm-1", block_ids=(1,), num_prompt_tokens=10)  # repeated order
    t.hold("t", request_id="vllm-2", block_ids=(2,), num_prompt_tokens=10)
    assert t.take_finished() == {"vllm-2"}
    assert t.claim("t", 0).block_ids == [1]  # the first keeps its hand-off
    t.read_done("t", 0, True)
    t.read_done("t", 1, True)
    assert t.take_finished() == {"vllm-1"}
    t.hold("t", request_id="vllm-1")  # a stale order after release
    assert t.take_finished() == set()


def test_an_idle_engine_step_sleeps_until_a_hold_can_be_freed() -> None:
    """vLLM steps in a tight loop while prefill only holds blocks; the worker waits here instead
    (woken by the release), so the spinning does not starve the readers on a shared host."""
    import threading
    import time

    t = SendTracker(TransferTopology(4, 1, 1), 0, 10.0)
    t.wait_for_news(5.0)  # nothing held: returns at once
    t.hold("r")
    started = time.monotonic()
    t.wait_for_news(0.05)  # held, nobody reads: waits out the timeout
    assert time.monotonic() - started >= 0.04
    threading.Timer(0.1, t.read_done, ("r", 0, True)).start()
    started = time.monotonic()
    t.wait_for_news(5.0)
    assert time.monotonic() - started < 2.0, "the release did not wake the wait"
    assert t.take_finished() == {"r"}
    started = time.monotonic()
    t.wait_for_news(5.0)  # nothing held any more
    assert time.monotonic() - started < 1.0


def test_renewed_leases_never_hold_a_transfer_past_its_cap() -> None:
    """A reader that keeps claiming cannot pin the blocks: the lease shrinks to the cap, then
    claims are refused and the hold expires."""
    t, clock, _ = tracker(timeout=10.0)
    t.hold("r")
    leases = []
    for step in range(1, 50):
        clock.now = step * 2.0
        reply = t.claim("r", 0)
        if reply.status != "granted":
            break
        leases.append(reply.lease_s)
        assert clock.now + reply.lease_s <= MAX_HOLD_TIMEOUTS * 10.0
    assert reply.status == "refused" and "release timeouts" in reply.reason
    assert leases[0] == 10.0 and leases[-1] < 10.0
    assert t.take_finished() == {"r"} and t.take_expired_count() == 1


def test_notices_for_requests_never_held_are_remembered_up_to_a_bound(monkeypatch) -> None:
    monkeypatch.setattr(sender, "MAX_EARLY_NOTICES", 100)
    t, _, _ = tracker()
    for i in range(150):
        t.read_done(f"made-up-{i}", 0, True)
    t.read_done("made-up-3", 1, True)  # an id already remembered still counts
    assert t.num_ignored_notices == 50
    t.hold("made-up-3")
    assert t.take_finished() == {"made-up-3"}  # both readers' early notices were kept


def test_the_first_reader_binds_the_transfer_to_its_decode_tp() -> None:
    # Configured for decode TP 2 (readers 0 and 1); a TP 1 decode reads all 4 heads from rank 0.
    t, _, _ = tracker(prefill_tp=1, decode_tp=2, heads=4)
    t.hold("r")
    assert t.claim("r", 0, decode_tp=1).status == "granted"
    assert t.claim("r", 1, decode_tp=2).status == "refused"  # the TP 1 decode reads it now
    reply = t.claim("r", 1, decode_tp=2)
    assert "TP 1 reads this transfer already" in reply.reason and "runs TP 2" in reply.reason
    assert t.read_done("r", 1, True, decode_tp=2) is False  # ignored: another TP's notice
    assert t.take_finished() == set()  # still held for the TP 1 reader, not freed
    assert t.read_done("r", 0, True, decode_tp=1) is True
    assert t.take_finished() == {"r"}  # its only reader was done


def test_readers_of_a_larger_decode_tp_are_waited_for() -> None:
    # Configured for decode TP 1 (one reader); a TP 4 decode reads one head per rank.
    t, _, _ = tracker(prefill_tp=1, decode_tp=1, heads=4)
    t.hold("r")
    for rank in range(4):
        assert t.claim("r", rank, decode_tp=4).status == "granted"
    for rank in range(3):
        t.read_done("r", rank, True, decode_tp=4)
        assert t.take_finished() == set()
    t.read_done("r", 3, True, decode_tp=4)
    assert t.take_finished() == {"r"}


def test_early_notices_name_their_decode_tp() -> None:
    t, _, _ = tracker(prefill_tp=1, decode_tp=2, heads=4)
    assert t.read_done("r", 0, False, decode_tp=1) is True  # before prefill holds it
    assert t.read_done("r", 1, False, decode_tp=2) is False  # another TP: not kept
    t.hold("r")
    assert t.take_finished() == {"r"}  # a TP 1 decode has one reader, and it was done


@pytest.mark.parametrize(
    ("prefill_tp", "heads", "decode_tp", "why"),
    [
        (1, 4, 3, "prefill TP 1 cannot pair with it"),
        (4, 2, 1, "replicates its 2 KV heads over TP 4 and serves only decode TP 2"),
    ],
)
def test_a_reader_of_a_decode_tp_this_rank_cannot_serve_is_refused_and_the_hold_freed(
    prefill_tp: int, heads: int, decode_tp: int, why: str
) -> None:
    t, _, topo = tracker(prefill_tp=prefill_tp, decode_tp=2, heads=heads)
    # a transfer this rank is read for (a replica nobody reads is freed when held)
    r = next(f"r{i}" for i in range(100) if topo.readers_of(0, request_seed(f"r{i}")))
    t.hold(r)
    reply = t.claim(r, 0, decode_tp=decode_tp)
    assert reply.status == "refused"
    assert f"runs TP {decode_tp}" in reply.reason and why in reply.reason
    assert t.take_finished() == {r}  # its readers would never all come: freed at once
    assert t.claim(r, 0, decode_tp=2).status == "refused"


def test_a_lease_is_bound_to_its_reader_and_nobody_else_can_end_it() -> None:
    t, _, _ = tracker(decode_tp=1)
    t.hold("r")
    assert t.claim("r", 0, reader="decode-a").status == "granted"
    assert t.read_done("r", 0, True, reader="forger") is False
    assert t.read_done("r", 0, True) is False  # a notice naming no reader neither
    assert t.claim("r", 0, reader="forger").status == "refused"
    assert t.take_finished() == set()  # still held for decode-a
    assert t.claim("r", 0, reader="decode-a").status == "granted"  # renewal
    assert t.read_done("r", 0, True, reader="decode-a") is True
    assert t.take_finished() == {"r"}


def test_a_router_keeps_a_hold_nobody_claimed_yet_within_the_cap() -> None:
    """Issue #27 item 4: a decode request queued past ``release_timeout_s`` used to find its KV
    released (HTTP 500 or a recompute); the proxy's ``KeepHold`` renews the hold meanwhile, never
    past the cap, and learns when to stop."""
    t, clock, _ = tracker(timeout=10.0)
    assert t.keep("r").status == "pending"  # prefill registers the hold one step later
    t.hold("r")
    clock.now = 8.0
    kept = t.keep("r")
    assert (kept.status, kept.lease_s) == ("held", 10.0)
    clock.now = 15.0  # past the deadline the hold had without the renewal
    assert t.take_finished() == set()
    assert t.claim("r", 0).status == "granted"  # the queued decode request reads it
    for step in range(8, 50):  # renewals alone cannot pin the blocks either
        clock.now = step * 2.0
        if t.keep("r").status != "held":
            break
    refused = t.keep("r")
    assert refused.status == "refused" and "release timeouts" in refused.reason
    assert clock.now <= MAX_HOLD_TIMEOUTS * 10.0 + 2.0
    assert t.take_finished() == {"r"} and t.take_expired_count() == 1


def test_a_kept_hold_ends_when_its_readers_are_done_and_renewals_stop() -> None:
    t, _, _ = tracker(timeout=10.0)
    t.hold("r")
    assert t.keep("r").status == "held"
    t.read_done("r", 0, True)
    t.read_done("r", 1, True)
    assert t.take_finished() == {"r"}
    refused = t.keep("r")
    assert refused.status == "refused" and "read or released" in refused.reason
