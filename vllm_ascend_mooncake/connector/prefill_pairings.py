"""Decode's scheduler: which prefill engines this instance has paired with, is pairing with, or
cannot read.

A pull from a prefill engine that cannot be read (another model or dtype, block sizes neither
dividing the other, ...) fails its request, which vLLM's default ``kv_load_failure_policy``
answers with HTTP 500. So the first request from an engine not paired yet is held back (vLLM
asks again each step) while TP rank 0 of this instance handshakes with every rank of it
(:class:`~..datapath.pairing.PairingProbes`); the verdict comes back in the workers' stats.
Requests from an engine found unreadable, by the probe or by a pull, are computed here.

Engine ids, not addresses, are the key: a prefill restarted behind the same address gets a new
engine id and is paired again, so a fixed one serves again. Each table is bounded (oldest out).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

from ..datapath.orders import PairingOrder
from ..datapath.pairing import PairingOutcome, PairingVerdict
from ..log import get_logger

logger = get_logger(__name__)

#: Engines remembered per table; a fleet with more prefill engines pairs some twice.
MAX_ENGINES = 1024
#: How long decode's scheduler holds a prefill engine's first request for the pairing probe
#: (``pair_before_pull``) before leaving the handshake to its pull. A prefill that answers does
#: so in milliseconds; one that does not (down, frozen) is left to the pull's own timeouts, as
#: before there was a probe: a request held longer could outlive prefill's hold on its KV
#: (``release_timeout_s``) while nobody renews it.
PAIRING_WAIT_S = 5.0


class Pairing(enum.Enum):
    """What to do with a request whose KV a prefill engine holds."""

    PULL = "pull"  # paired (or the probe gave up): pull it
    WAIT = "wait"  # the probe runs: ask again next step
    COMPUTE = "compute"  # that engine cannot be read: compute the prompt here


def _remember(table: dict[str, str], engine_id: str, value: str) -> None:
    if engine_id not in table and len(table) >= MAX_ENGINES:
        del table[next(iter(table))]
    table[engine_id] = value


class PrefillPairings:
    """Decode's scheduler side of pairing (the module docstring)."""

    def __init__(
        self,
        probe_first: bool = True,
        wait_s: float = PAIRING_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        #: hold an engine's first request for a probe (``pair_before_pull``)
        self.probe_first = probe_first
        self.wait_s = wait_s
        self._clock = clock
        self._paired: dict[str, str] = {}  # engine id -> "" (or why its pulls pair instead)
        self._probing: dict[str, float] = {}  # engine id -> when its probe was ordered
        self._unpairable: dict[str, str] = {}  # engine id -> why

    def unpairable_reason(self, engine_id: str) -> str | None:
        return self._unpairable.get(engine_id)

    def decide(self, order: PairingOrder, orders: list[PairingOrder]) -> Pairing:
        """What to do now with a request of ``order.engine_id``; appends ``order`` to ``orders``
        (the next step's) when a probe must start."""
        engine_id = order.engine_id
        if engine_id in self._unpairable:
            return Pairing.COMPUTE
        if not self.probe_first or engine_id in self._paired:
            return Pairing.PULL
        started = self._probing.get(engine_id)
        if started is None:
            self._probing[engine_id] = self._clock()
            orders.append(order)
            return Pairing.WAIT
        if self._clock() - started < self.wait_s:
            return Pairing.WAIT
        del self._probing[engine_id]
        _remember(self._paired, engine_id, "no verdict in time")
        logger.warning(
            "no pairing verdict for prefill engine %s within %g s; its requests pull without one",
            engine_id,
            self.wait_s,
        )
        return Pairing.PULL

    def note_verdict(self, verdict: PairingVerdict) -> None:
        """A probe's answer, from the workers' stats."""
        self._probing.pop(verdict.engine_id, None)
        if verdict.outcome is PairingOutcome.REFUSED:
            self.note_unpairable(verdict.engine_id, verdict.reason)
        else:  # paired, or unreachable: its pulls handshake (and fail) for themselves
            _remember(self._paired, verdict.engine_id, verdict.reason)

    def note_unpairable(self, engine_id: str, reason: str) -> None:
        """A probe or a pull found prefill engine ``engine_id`` unreadable by this decode."""
        self._probing.pop(engine_id, None)
        self._paired.pop(engine_id, None)
        if engine_id in self._unpairable:
            return
        _remember(self._unpairable, engine_id, reason)
        logger.warning(
            "prefill engine %s cannot pair with this decode instance: %s. Requests it prefills "
            "are computed here from now on (its holds released); fix the instances "
            "(docs/troubleshooting.md) or take that prefill out of the router",
            engine_id,
            reason,
        )
