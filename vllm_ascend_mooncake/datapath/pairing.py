"""Decode side: pair with the prefill instances named in the configuration before serving.

Whether decode can read a prefill (same model and dtype, block sizes one dividing the other, a
packing that can be cut, TP sizes that pair, ...) is decided at the handshake, which otherwise
happens on the first request naming that prefill: a combination that cannot be served then
fails a request (vLLM answers HTTP 500). A decode instance told which prefills feed it
(``prefill_side_channels``) handshakes with every worker of each at start-up instead, through the
same :class:`~.peers.PeerDirectory` its pulls use, so an incompatible deployment refuses to start
with the reason and the fix, and the first requests find their peers paired already.

A listed prefill that does not answer within ``wait_s`` (not started yet, a host down) is not a
refusal: start-up goes on with a warning and that prefill is paired on its first request.

A prefill not listed is paired before its first pull instead (:class:`PairingProbes`): the
scheduler holds that request back while rank 0 of this decode instance handshakes with every
rank of the prefill engine, and computes it here if the prefill cannot be read.
"""

from __future__ import annotations

import enum
import socket
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..log import get_logger
from .compat import IncompatiblePeerError
from .orders import PairingOrder
from .peers import PeerDirectory, PrefillPeer
from .side_channel import SideChannelError

logger = get_logger(__name__)

#: Pause between attempts to reach a listed prefill that is not listening yet.
POLL_S = 0.5


@dataclass(frozen=True)
class Endpoint:
    """A prefill instance's side channel as decode is told of it: the base port of its first
    data-parallel engine (TP rank ``r`` of DP engine ``d`` listens on ``port + d*tp + r``)."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoints(text: str) -> tuple[Endpoint, ...]:
    """``"host:port,host:port"`` (IPv6 hosts in brackets) as endpoints; ValueError names the
    entry that is not one."""
    endpoints = []
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        host, sep, port = entry.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"{entry!r} is not host:port (a port from 1 to 65535)")
        endpoints.append(Endpoint(host, int(port)))
    return tuple(endpoints)


def pair_with_prefills(
    peers: PeerDirectory, endpoints: tuple[Endpoint, ...], wait_s: float
) -> list[PrefillPeer]:
    """Handshake with every worker of every listed prefill instance; the peers paired.

    Raises :class:`IncompatiblePeerError` for the first that cannot be read (after which this
    decode instance must not serve: it would fail every request routed to that prefill)."""
    paired: list[PrefillPeer] = []
    for endpoint in endpoints:
        deadline = time.monotonic() + wait_s
        first = _handshake(peers, endpoint.host, endpoint.port, deadline, endpoint)
        if first is None:
            continue
        meta = first.metadata
        if meta.tp_rank != 0 or meta.dp_rank != 0:
            raise IncompatiblePeerError(
                f"prefill_side_channels names {endpoint}, where prefill engine "
                f"{meta.engine_id} TP rank {meta.tp_rank} of DP engine {meta.dp_rank} listens: "
                f"list each prefill instance's side_channel_port (its first worker), not a "
                f"later worker's"
            )
        paired.append(first)
        for offset in range(1, meta.tp_size * meta.dp_size):
            peer = _handshake(peers, endpoint.host, endpoint.port + offset, deadline, endpoint)
            if peer is not None:
                paired.append(peer)
    return paired


def _handshake(
    peers: PeerDirectory, host: str, port: int, deadline: float, endpoint: Endpoint
) -> PrefillPeer | None:
    """The worker at ``host:port`` paired, waiting until ``deadline`` for it to listen and
    answer; None (with a warning) if it did not in time."""
    last_error = "nobody listens there"
    while True:
        left = deadline - time.monotonic()
        if _listens(host, port, max(0.1, min(left, 1.0))):
            try:
                return peers.get(host, port)
            except IncompatiblePeerError as exc:
                raise IncompatiblePeerError(
                    f"this decode instance cannot read the prefill instance at {endpoint} it "
                    f"is told to pair with (prefill_side_channels): {exc}. Fix the instances, "
                    f"or leave that prefill out of prefill_side_channels and of the router"
                ) from exc
            except SideChannelError as exc:
                last_error = str(exc)
        if time.monotonic() >= deadline:
            logger.warning(
                "prefill worker at %s:%d (of %s in prefill_side_channels) did not answer within "
                "pair_wait_s (%s); serving without it, it is paired on its first request",
                host,
                port,
                endpoint,
                last_error,
            )
            return None
        time.sleep(POLL_S)


def _listens(host: str, port: int, timeout_s: float) -> bool:
    """Whether a TCP connection to ``host:port`` is accepted (before asking the side channel,
    whose peers directory would put a closed port in its cooldown)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class PairingOutcome(enum.Enum):
    PAIRED = "paired"
    #: this decode cannot read that prefill (model, dtype, cache geometry or TP)
    REFUSED = "refused"
    #: it did not answer (down, restarted, a bad address): its pulls find out for themselves
    UNREACHABLE = "unreachable"


@dataclass(frozen=True)
class PairingVerdict:
    engine_id: str
    outcome: PairingOutcome
    reason: str = ""


def probe_prefill(peers: PeerDirectory, order: PairingOrder) -> PairingVerdict:
    """Handshake with every TP rank of the prefill engine ``order`` names (the peers directory
    keeps what it learns, so the first pull finds its peers paired)."""
    for rank in range(order.remote_tp_size):
        port = order.remote_port + rank
        try:
            peers.get(order.remote_host, port, order.engine_id)
        except IncompatiblePeerError as exc:
            return PairingVerdict(order.engine_id, PairingOutcome.REFUSED, str(exc))
        except (SideChannelError, ValueError, OSError) as exc:
            return PairingVerdict(
                order.engine_id,
                PairingOutcome.UNREACHABLE,
                f"rank {rank} at {order.remote_host}:{port}: {exc}",
            )
    return PairingVerdict(order.engine_id, PairingOutcome.PAIRED)


#: Probes that may run at once. A probe of a prefill that does not answer holds its thread
#: for the side channel's timeouts; probes are one per new prefill engine, so this many dead
#: ones at once are needed before a live one's probe waits behind them.
MAX_CONCURRENT_PROBES = 32


class PairingProbes:
    """Answers the scheduler's pairing orders (:class:`~.orders.PairingOrder`) off the step:
    each on a thread of its own (a peer that does not answer holds its probe's thread, never a
    step, a pull or another peer's probe), its verdict collected for the scheduler."""

    def __init__(self, peers: PeerDirectory, num_threads: int = MAX_CONCURRENT_PROBES) -> None:
        self._peers = peers
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="vam-pair")
        self._lock = threading.Lock()
        self._news = threading.Condition(self._lock)
        self._pending = 0
        self._verdicts: list[PairingVerdict] = []
        self._closed = False

    def submit(self, order: PairingOrder) -> None:
        with self._lock:
            self._pending += 1
        self._pool.submit(self._run, order)

    def wait_for_verdict(self, timeout_s: float) -> None:
        """In an idle step: block up to ``timeout_s`` while a probe runs and no verdict is
        waiting (the held request is all the engine has to do)."""
        with self._news:
            if self._pending and not self._verdicts:
                self._news.wait(timeout_s)

    def _run(self, order: PairingOrder) -> None:
        try:
            verdict = probe_prefill(self._peers, order)
        except Exception as exc:  # a verdict always comes back: the scheduler holds a request
            if self._closed:  # the worker shuts down under the probe: nobody waits for it
                logger.debug("pairing with prefill engine %s ended by shut-down", order.engine_id)
                return
            logger.exception("pairing with prefill engine %s failed", order.engine_id)
            verdict = PairingVerdict(order.engine_id, PairingOutcome.UNREACHABLE, repr(exc))
        if self._closed:
            return
        if verdict.outcome is PairingOutcome.UNREACHABLE:
            logger.info(
                "could not pair with prefill engine %s before its first pull (%s); the pull "
                "tries again",
                order.engine_id,
                verdict.reason,
            )
        with self._news:
            self._pending -= 1
            self._verdicts.append(verdict)
            self._news.notify_all()

    def note_paired(self, engine_ids: Iterable[str]) -> None:
        """Engines paired already (at start-up, ``prefill_side_channels``): the scheduler needs
        no probe of them."""
        with self._news:
            self._verdicts += [PairingVerdict(e, PairingOutcome.PAIRED) for e in engine_ids]
            self._news.notify_all()

    def take_verdicts(self) -> list[PairingVerdict]:
        with self._lock:
            verdicts, self._verdicts = self._verdicts, []
        return verdicts

    def close(self) -> None:
        """Before the side channel closes: probes still running end without a word (their
        peer's failure would be the shut-down's, not the peer's)."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
