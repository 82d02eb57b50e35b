"""Transfer statistics, aggregated across workers and logged the vLLM way ("KV Transfer metrics").

Workers record each completed pull (duration, bytes, descriptors, and the seconds spent in each
phase of its :mod:`..timeline`), failed pulls by kind
(:class:`~..datapath.failures.FailureKind`), and on prefill the releases by timeout and how long
a finished request waited for its hold to be registered; vLLM ships the plain ``data`` dict to the
logging process, where :meth:`TransferStats.reduce` turns an interval's observations into a few
numbers and :class:`TransferPromMetrics` into histograms.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from ..datapath.failures import FailureKind
from ..datapath.pairing import PairingOutcome, PairingVerdict
from ..timeline import PHASES, PULL_PHASE_METRIC

_PHASE_FIELDS = tuple(f"phase_{name}_seconds" for name in PHASES)
_FIELDS = (
    "pull_seconds",
    "pull_bytes",
    "pull_descriptors",
    "failed_pulls",
    "expired_releases",
    "hold_delay_seconds",
    #: decode: ``[prefill engine id, why]`` of each prefill found unpairable at a pull, for the
    #: scheduler side (:meth:`~.prefill_pairings.PrefillPairings.note_unpairable`)
    "unpairable_engines",
    #: decode: ``[prefill engine id, outcome, why]`` of each pairing probe answered (the
    #: scheduler holds a prefill engine's first request until then, see datapath/pairing.py)
    "pairings",
    *_PHASE_FIELDS,
)
#: Fields logged as a mean per interval: (label, field).
_AVERAGED = (
    ("hold delay", "hold_delay_seconds"),
    *((phase.replace("_", " "), f"phase_{phase}_seconds") for phase in PHASES),
)
#: Prefill engines that get a label value of their own on
#: ``vllm:mooncake_hetero_unpairable_prefill_engines``; later ones share ``other``. Engine ids
#: change with every prefill restart, so the label must be bounded; 64 covers any fleet's
#: mismatched prefills across many restarts.
MAX_UNPAIRABLE_ENGINE_LABELS = 64
#: The label value of engines past :data:`MAX_UNPAIRABLE_ENGINE_LABELS` (the proxy ignores it).
OTHER_ENGINES = "other"
#: Engines remembered as counted already (so each counts once); past it, a report may count an
#: engine again, under ``other``.
_MAX_UNPAIRABLE_ENGINES_SEEN = 4096
_PHASE_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0]


@dataclass
class TransferStats(KVConnectorStats):
    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        if not self.data:
            self.reset()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def reset(self) -> None:
        self.data = {name: [] for name in _FIELDS}

    def record_pull(
        self,
        seconds: float,
        num_bytes: int,
        num_descriptors: int,
        phases: dict[str, float] | None = None,
    ) -> None:
        with self._lock:
            self.data["pull_seconds"].append(seconds)
            self.data["pull_bytes"].append(num_bytes)
            self.data["pull_descriptors"].append(num_descriptors)
            for name, phase_seconds in (phases or {}).items():
                self.data[f"phase_{name}_seconds"].append(phase_seconds)

    def record_hold_delay(self, seconds: float) -> None:
        """Prefill: from vLLM finishing a request to its worker holding the blocks for readers."""
        with self._lock:
            self.data["hold_delay_seconds"].append(seconds)

    def record_failure(self, kind: FailureKind) -> None:
        """Decode: a pull vLLM waited for failed (its blocks are recomputed or the request
        fails); cancellations are not failures."""
        with self._lock:
            self.data["failed_pulls"].append(kind.value)

    def record_unpairable(self, engine_id: str, reason: str) -> None:
        """Decode: a pull found that prefill engine ``engine_id`` cannot pair with this decode."""
        with self._lock:
            self.data["unpairable_engines"].append([engine_id, reason])

    def unpairable_engines(self) -> list[tuple[str, str]]:
        return [(engine, reason) for engine, reason in self.data.get("unpairable_engines", [])]

    def record_pairing(self, verdict: PairingVerdict) -> None:
        with self._lock:
            self.data["pairings"].append([verdict.engine_id, verdict.outcome.value, verdict.reason])

    def pairings(self) -> list[PairingVerdict]:
        return [
            PairingVerdict(engine, PairingOutcome(outcome), reason)
            for engine, outcome, reason in self.data.get("pairings", [])
        ]

    def record_expired(self, count: int) -> None:
        if count:
            with self._lock:
                self.data["expired_releases"].append(count)

    def take(self) -> TransferStats | None:
        """A snapshot of what was recorded since the last call, or None if nothing was."""
        with self._lock:
            if self.is_empty():
                return None
            snapshot = TransferStats(data={k: list(v) for k, v in self.data.items()})
            self.reset()
        return snapshot

    def aggregate(self, other: KVConnectorStats) -> TransferStats:
        for name in _FIELDS:
            self.data.setdefault(name, []).extend(other.data.get(name, []))
        return self

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in _FIELDS)

    def reduce(self) -> dict[str, int | float]:
        seconds = self.data.get("pull_seconds", [])
        total_bytes = sum(self.data.get("pull_bytes", []))
        total_seconds = sum(seconds)
        return {
            "Num successful pulls": len(seconds),
            "Num failed pulls": len(self.data.get("failed_pulls", [])),
            **{
                f"Num failed pulls ({kind})": count
                for kind, count in sorted(Counter(self.data.get("failed_pulls", [])).items())
            },
            "Num expired releases": sum(self.data.get("expired_releases", [])),
            "Avg pull time (ms)": round(1e3 * total_seconds / len(seconds), 3) if seconds else 0,
            "Total MB pulled": round(total_bytes / 1e6, 3),
            "Avg descriptors per pull": (
                round(sum(self.data.get("pull_descriptors", [])) / len(seconds), 1)
                if seconds
                else 0
            ),
            "Throughput (MB/s)": round(total_bytes / 1e6 / total_seconds, 1)
            if total_seconds
            else 0,
            **{
                f"Avg {label} (ms)": round(1e3 * sum(values) / len(values), 3)
                for label, name in _AVERAGED
                if (values := self.data.get(name))
            },
        }


class TransferPromMetrics(KVConnectorPromMetrics):
    """Prometheus metrics on the instances' ``/metrics``, named the vLLM way (``vllm:...``).

    Pulls are recorded on decode instances, expired releases on prefill instances.
    """

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def histogram(name: str, documentation: str, buckets: list[float]):
            metric = self._histogram_cls(
                name=name, documentation=documentation, buckets=buckets, labelnames=labelnames
            )
            return create_metric_per_engine(metric, per_engine_labelvalues)

        def counter(name: str, documentation: str):
            metric = self._counter_cls(
                name=name, documentation=documentation, labelnames=labelnames
            )
            return create_metric_per_engine(metric, per_engine_labelvalues)

        self._pull_seconds = histogram(
            "vllm:mooncake_hetero_pull_seconds",
            "Time from a request's first read to its KV being ready (fix-up included).",
            [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0],
        )
        self._pull_bytes = histogram(
            "vllm:mooncake_hetero_pull_bytes",
            "Bytes pulled per request and decode rank.",
            [2.0 ** (10 + i) for i in range(0, 26, 2)],
        )
        self._pull_descriptors = histogram(
            "vllm:mooncake_hetero_pull_descriptors",
            "Transfer descriptors per request and decode rank.",
            [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536],
        )
        self._bytes_total = counter(
            "vllm:mooncake_hetero_pulled_bytes", "Total bytes pulled from prefill instances."
        )
        failed_metric = self._counter_cls(
            name="vllm:mooncake_hetero_failed_pulls",
            documentation=(
                "Decode: requests whose KV could not be pulled, by kind of failure (see "
                "docs/troubleshooting.md)."
            ),
            labelnames=[*labelnames, "kind"],
        )
        self._failed = {
            kind.value: {
                idx: failed_metric.labels(*values, kind.value)
                for idx, values in per_engine_labelvalues.items()
            }
            for kind in FailureKind
            # cancellations (by vLLM or by the client) are not failures; a pull whose read never
            # settled is never reported
            if kind not in (FailureKind.CANCELLED, FailureKind.CLIENT_LEFT, FailureKind.UNSETTLED)
        }
        self._expired = counter(
            "vllm:mooncake_hetero_expired_releases",
            "Prefill requests released at their deadline because no decode finished reading.",
        )
        self._hold_delay = histogram(
            "vllm:mooncake_hetero_hold_delay_seconds",
            "Prefill: from vLLM finishing a request to its workers holding the blocks for readers.",
            _PHASE_BUCKETS,
        )
        phase_metric = self._histogram_cls(
            name=PULL_PHASE_METRIC,
            documentation=(
                "Decode: seconds per pull phase: grant_wait (order received to every prefill "
                "rank's grant; includes prefill computing with overlapped legs), lane_wait, read, "
                "fixup, report_wait (ready until handed to vLLM)."
            ),
            buckets=_PHASE_BUCKETS,
            labelnames=[*labelnames, "phase"],
        )
        self._unpairable_metric = self._counter_cls(
            name="vllm:mooncake_hetero_unpairable_prefill_engines",
            documentation=(
                "Decode: prefill engines found unable to pair with this decode instance (its "
                "requests are computed here), once each, by engine id (label prefill_engine; "
                f"past the first {MAX_UNPAIRABLE_ENGINE_LABELS}, 'other'). The decode's log says "
                "why; vam-proxy stops sending prefill legs to an instance every decode reports."
            ),
            labelnames=[*labelnames, "prefill_engine"],
        )
        self._labelvalues = per_engine_labelvalues
        #: engine ids counted, per vLLM engine index of this instance
        self._unpairable_seen: dict[int, set[str]] = {}
        #: engine ids with a label value of their own (bounded)
        self._unpairable_labelled: set[str] = set()
        self._phases = {
            phase: {
                idx: phase_metric.labels(*values, phase)
                for idx, values in per_engine_labelvalues.items()
            }
            for phase in PHASES
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        for seconds in data.get("pull_seconds", []):
            self._pull_seconds[engine_idx].observe(seconds)
        for num_bytes in data.get("pull_bytes", []):
            self._pull_bytes[engine_idx].observe(num_bytes)
            self._bytes_total[engine_idx].inc(num_bytes)
        for count in data.get("pull_descriptors", []):
            self._pull_descriptors[engine_idx].observe(count)
        for kind, count in Counter(data.get("failed_pulls", [])).items():
            per_engine = self._failed.get(kind, self._failed[FailureKind.INTERNAL.value])
            per_engine[engine_idx].inc(count)
        expired = sum(data.get("expired_releases", []))
        if expired:
            self._expired[engine_idx].inc(expired)
        for seconds in data.get("hold_delay_seconds", []):
            self._hold_delay[engine_idx].observe(seconds)
        for phase, per_engine in self._phases.items():
            for seconds in data.get(f"phase_{phase}_seconds", []):
                per_engine[engine_idx].observe(seconds)
        refused = [entry[0] for entry in data.get("unpairable_engines", [])]
        refused += [
            entry[0]
            for entry in data.get("pairings", [])
            if entry[1] == PairingOutcome.REFUSED.value
        ]
        for prefill_engine in refused:
            self._count_unpairable(str(prefill_engine), engine_idx)

    def _count_unpairable(self, prefill_engine: str, engine_idx: int) -> None:
        """Count ``prefill_engine`` once as unpairable with this instance's ``engine_idx``."""
        seen = self._unpairable_seen.setdefault(engine_idx, set())
        if prefill_engine in seen:
            return
        if len(seen) < _MAX_UNPAIRABLE_ENGINES_SEEN:
            seen.add(prefill_engine)
        label = prefill_engine
        if label not in self._unpairable_labelled:
            if len(self._unpairable_labelled) < MAX_UNPAIRABLE_ENGINE_LABELS:
                self._unpairable_labelled.add(label)
            else:
                label = OTHER_ENGINES
        values = self._labelvalues.get(engine_idx, self._labelvalues.get(0, []))
        self._unpairable_metric.labels(*values, label).inc()
