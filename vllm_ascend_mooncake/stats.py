"""Transfer statistics, aggregated across workers and logged the vLLM way ("KV Transfer metrics").

Workers record each completed pull (duration, bytes, descriptors), failed pulls and prefill-side
releases by timeout; vLLM ships the plain ``data`` dict to the logging process, where
:meth:`TransferStats.reduce` turns an interval's observations into a few numbers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

_FIELDS = ("pull_seconds", "pull_bytes", "pull_descriptors", "failed_pulls", "expired_releases")


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

    def record_pull(self, seconds: float, num_bytes: int, num_descriptors: int) -> None:
        with self._lock:
            self.data["pull_seconds"].append(seconds)
            self.data["pull_bytes"].append(num_bytes)
            self.data["pull_descriptors"].append(num_descriptors)

    def record_failure(self) -> None:
        with self._lock:
            self.data["failed_pulls"].append(1)

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
        }
