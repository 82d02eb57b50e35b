"""Ports for local servers come from below the kernel's ephemeral range and are handed out once.

CI once lost a prefill's side-channel port to another process's bind-to-0 between the probe and
the server's bind; these tests pin the properties that prevent that.
"""

from __future__ import annotations

import socket

import pytest

from vllm_ascend_mooncake.launch import ports
from vllm_ascend_mooncake.launch.ports import ephemeral_port_low, free_port, free_port_range


def test_free_port_is_bindable_and_outside_the_ephemeral_range() -> None:
    port = free_port()
    assert 20000 <= port < ephemeral_port_low()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))


def test_a_range_is_consecutive_free_and_never_handed_out_twice() -> None:
    bases = [free_port_range(4) for _ in range(200)]
    handed = [base + i for base in bases for i in range(4)]
    assert len(set(handed)) == len(handed)
    assert max(handed) < ephemeral_port_low()
    for port in range(bases[0], bases[0] + 4):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))


def test_a_port_someone_listens_on_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        taken_port = taken.getsockname()[1]
        other_port = free_port()
        ports._handed_out.difference_update({taken_port, other_port})
        # The first candidate is the taken port; the chooser must move on to the next one.
        candidates = iter([taken_port, other_port])
        monkeypatch.setattr(ports._rng, "randint", lambda low, high: next(candidates))
        assert free_port() == other_port


def test_a_range_that_does_not_fit_below_the_ephemeral_range_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ports, "ephemeral_port_low", lambda: 20002)
    with pytest.raises(RuntimeError, match="ip_local_port_range"):
        free_port_range(4)
    with pytest.raises(ValueError):
        free_port_range(0)
