"""Decode's scheduler-side pairing table (``connector/prefill_pairings.py``), on a fake clock:
a prefill engine's first request waits for one probe, a verdict decides, a probe that never
answers is given up on, and every table stays bounded."""

from __future__ import annotations

from vllm_ascend_mooncake.connector import prefill_pairings
from vllm_ascend_mooncake.connector.prefill_pairings import Pairing, PrefillPairings
from vllm_ascend_mooncake.datapath.orders import PairingOrder
from vllm_ascend_mooncake.datapath.pairing import PairingOutcome, PairingVerdict


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def order(engine_id: str = "engine-p") -> PairingOrder:
    return PairingOrder(engine_id, "10.0.0.2", 36100, 2)


def test_one_probe_per_engine_then_its_verdict_decides() -> None:
    pairings, orders = PrefillPairings(clock=Clock()), []
    assert pairings.decide(order(), orders) is Pairing.WAIT
    assert pairings.decide(order(), orders) is Pairing.WAIT
    assert orders == [order()]
    pairings.note_verdict(PairingVerdict("engine-p", PairingOutcome.PAIRED))
    assert pairings.decide(order(), orders) is Pairing.PULL

    assert pairings.decide(order("engine-q"), orders) is Pairing.WAIT
    pairings.note_verdict(PairingVerdict("engine-q", PairingOutcome.REFUSED, "dtype differs"))
    assert pairings.decide(order("engine-q"), orders) is Pairing.COMPUTE
    assert pairings.unpairable_reason("engine-q") == "dtype differs"

    # unreachable: the pulls handshake (and fail) for themselves, no second probe
    assert pairings.decide(order("engine-r"), orders) is Pairing.WAIT
    pairings.note_verdict(PairingVerdict("engine-r", PairingOutcome.UNREACHABLE, "down"))
    assert pairings.decide(order("engine-r"), orders) is Pairing.PULL
    assert [o.engine_id for o in orders] == ["engine-p", "engine-q", "engine-r"]


def test_a_probe_without_a_verdict_is_given_up_on_and_the_request_pulls() -> None:
    clock = Clock()
    pairings, orders = PrefillPairings(wait_s=30.0, clock=clock), []
    assert pairings.decide(order(), orders) is Pairing.WAIT
    clock.now += 29.0
    assert pairings.decide(order(), orders) is Pairing.WAIT
    clock.now += 2.0
    assert pairings.decide(order(), orders) is Pairing.PULL
    assert pairings.decide(order(), orders) is Pairing.PULL and len(orders) == 1


def test_a_pull_that_finds_an_engine_unreadable_overrides_its_pairing() -> None:
    pairings, orders = PrefillPairings(clock=Clock()), []
    pairings.decide(order(), orders)
    pairings.note_verdict(PairingVerdict("engine-p", PairingOutcome.PAIRED))
    pairings.note_unpairable("engine-p", "its rank 1 runs another block size")
    assert pairings.decide(order(), orders) is Pairing.COMPUTE


def test_without_probes_every_engine_pulls_until_found_unreadable() -> None:
    pairings, orders = PrefillPairings(probe_first=False, clock=Clock()), []
    assert pairings.decide(order(), orders) is Pairing.PULL and orders == []
    pairings.note_unpairable("engine-p", "dtype differs")
    assert pairings.decide(order(), orders) is Pairing.COMPUTE


def test_the_tables_are_bounded(monkeypatch) -> None:
    monkeypatch.setattr(prefill_pairings, "MAX_ENGINES", 3)
    pairings, orders = PrefillPairings(clock=Clock()), []
    for index in range(5):
        pairings.note_unpairable(f"engine-{index}", "dtype differs")
        pairings.note_verdict(PairingVerdict(f"paired-{index}", PairingOutcome.PAIRED))
    assert [pairings.unpairable_reason(f"engine-{i}") is not None for i in range(5)] == [
        False,
        False,
        True,
        True,
        True,
    ]
    assert pairings.decide(order("paired-0"), orders) is Pairing.WAIT  # forgotten: probed again
    assert pairings.decide(order("paired-4"), orders) is Pairing.PULL
