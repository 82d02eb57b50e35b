"""The three systems the benchmark compares, each started and stopped the same way.

* ``colocated``: one ``vllm serve`` instance, no connector (the reference);
* ``ours``: prefill + decode with ``MooncakeHeteroConnector`` and ``vllm_ascend_mooncake.proxy``,
  through :class:`~vllm_ascend_mooncake.launch.deployment.LocalDeployment` (the client's first
  token from prefill); ``ours_decode_first`` the proxy with ``--first-token decode`` (decode
  samples the first token again, legs overlapped), ``ours_serial`` that with ``--serial-legs``;
* ``nixl``: prefill + decode with vLLM's ``NixlConnector`` on CPU (UCX) behind ``vllm-router``;
* ``vllm_mooncake``: prefill + decode with vLLM's in-tree ``MooncakeConnector`` (TCP) and
  :mod:`benchmarks.e2e.mooncake_proxy`, with the CPU workaround of :mod:`cpu_accelerator_shim`.

All instances get the same model, dtype, block size, context length, environment
(:func:`~vllm_ascend_mooncake.launch.engine_env.engine_env`, hence ``TORCH_COMPILE_DISABLE=1``
and ``VLLM_CPU_OMP_THREADS_BIND=nobind``, plus a 1 s stats interval) and VllmServer's defaults
(eager mode, ``max_num_seqs`` 8), so the only differences are the connector and its proxy. Every
server runs in its own process group and :meth:`BenchSystem.stop` stops all of them, whatever
state ``start`` left behind.
"""

from __future__ import annotations

import abc
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_ascend_mooncake.launch.deployment import DeploymentSpec, LocalDeployment
from vllm_ascend_mooncake.launch.ports import free_port
from vllm_ascend_mooncake.launch.servers import (
    ServerError,
    VllmServer,
    start_helper,
    start_servers,
    stop_all,
)

from .transfer_logs import (
    error_lines,
    mooncake_timeouts,
    read_log,
    transfer_count_totals,
    weighted_mean_field,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
SHIM_DIR = Path(__file__).resolve().parent / "cpu_accelerator_shim"
SHIM_FLAG = "VAM_BENCH_CPU_ACCELERATOR_SHIM"

#: Seconds between vLLM's stats log lines (the "KV Transfer metrics" lines among them).
STATS_INTERVAL_S = 1

_PROXY_READY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class EngineSettings:
    """What every instance of every system shares."""

    model: str
    dtype: str = "float32"
    block_size: int = 32
    max_model_len: int = 512
    #: vLLM's prefix caching: on, off, or vLLM's default (None)
    prefix_caching: bool | None = None
    #: environment of every process (e.g. an ``LD_PRELOAD``), over the system's own
    env: Mapping[str, str] = field(default_factory=dict)
    #: a TP 1 instance runs its model in a worker process (see :class:`VllmServer`)
    worker_process: bool = False

    @property
    def engine_args(self) -> tuple[str, ...]:
        """``vllm serve`` arguments every instance gets from these settings."""
        if self.prefix_caching is None:
            return ()
        return ("--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",)

    def server(
        self,
        tp: int,
        log_path: Path,
        extra_env: dict[str, str],
        extra_args: Sequence[str] = (),
    ) -> VllmServer:
        """A (not yet started) instance with these settings (VllmServer's defaults otherwise)."""
        return VllmServer(
            self.model,
            tensor_parallel_size=tp,
            dtype=self.dtype,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            extra_args=[*self.engine_args, *extra_args],
            extra_env={**extra_env, **self.env},
            worker_process=self.worker_process,
            log_path=log_path,
        )


@dataclass
class TransferCheck:
    """Whether the logs show KV actually moved from prefill to decode, with the evidence."""

    ok: bool
    successful_transfers: int
    failure_counts: dict[str, int] = field(default_factory=dict)
    detail: str = ""
    error_lines: list[str] = field(default_factory=list)
    #: The connector's own mean time per transfer, from its logs. Not comparable one to one:
    #: ours times a pull on decode from its start (including waiting for the prefill's
    #: go-ahead); vLLM's times a push on prefill.
    mean_transfer_ms: float | None = None
    #: Mooncake batch transfers that hit the transport's 30 s timeout (retried or failed).
    mooncake_timeouts: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "successful_transfers": self.successful_transfers,
            "failure_counts": self.failure_counts,
            "detail": self.detail,
            "error_lines": self.error_lines,
            "mean_transfer_ms": self.mean_transfer_ms,
            "mooncake_timeouts": self.mooncake_timeouts,
        }


def _check_transfers(
    success_key: str,
    failure_keys: tuple[str, ...],
    logs: dict[str, Path],
    mean_time_key: str | None = None,
    counts: dict[str, int] | None = None,
) -> TransferCheck:
    """Sum the metrics of all ``logs`` (or take ``counts``, by the same keys, where the system
    counts more reliably elsewhere); ok when something moved and nothing failed."""
    totals: dict[str, int] = {}
    errors: list[str] = []
    mean_ms = None
    timeouts = 0
    for role, path in logs.items():
        text = read_log(path)
        for name, count in transfer_count_totals(text).items():
            totals[name] = totals.get(name, 0) + count
        errors += [f"{role}: {line}" for line in error_lines(text)]
        timeouts += mooncake_timeouts(text)
        if mean_time_key is not None and mean_ms is None:
            mean_ms = weighted_mean_field(text, success_key, mean_time_key)
    if counts is not None:
        totals = dict(counts)
    successes = totals.get(success_key, 0)
    failures = {key: totals.get(key, 0) for key in failure_keys}
    ok = successes > 0 and not any(failures.values())
    detail = f"{success_key}={successes}, " + ", ".join(f"{k}={v}" for k, v in failures.items())
    if mean_ms is not None:
        detail += f", mean {mean_time_key}={mean_ms:.1f}"
    detail += f", Mooncake 30 s transfer timeouts={timeouts}"
    return TransferCheck(ok, successes, failures, detail, errors, mean_ms, timeouts)


class BenchSystem(abc.ABC):
    """A system under test: start it, send requests to :attr:`url`, check transfers, stop it."""

    name: str
    description: str
    url: str

    @abc.abstractmethod
    def start(self, timeout_s: float) -> float:
        """Start every process and wait until requests can be served; return seconds taken."""
        ...

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop every process this system started (safe to call after a failed start)."""
        ...

    def transfer_check(self) -> TransferCheck | None:
        """Evidence that P/D moved KV over the connector; None for a colocated system."""
        return None

    @abc.abstractmethod
    def log_paths(self) -> list[Path]: ...

    @abc.abstractmethod
    def process_groups(self) -> list[int]:
        """Process-group ids of everything this system started (for CPU accounting)."""
        ...

    def named_process_groups(self) -> dict[str, int]:
        """:meth:`process_groups` by instance (``"prefill"``, ``"proxy"``...), for reports per
        process; numbered where the system does not name them."""
        return {f"group{i}": pgid for i, pgid in enumerate(self.process_groups())}

    def instances(self) -> dict[str, str]:
        """Base URL of each vLLM instance by role ("prefill", "decode" or "colocated"), whose
        ``/metrics`` the per-phase means (phase_means.py) read."""
        return {}


class ColocatedSystem(BenchSystem):
    name = "colocated"

    def __init__(self, settings: EngineSettings, tp: int, log_dir: Path) -> None:
        self.description = f"one vllm serve instance, TP {tp}, no connector"
        self.server = settings.server(
            tp, log_dir / "colocated.log", {"VLLM_LOG_STATS_INTERVAL": str(STATS_INTERVAL_S)}
        )
        self.url = self.server.base_url

    def start(self, timeout_s: float) -> float:
        self.server.start()
        return self.server.wait_ready(timeout_s)

    def stop(self) -> None:
        self.server.stop()

    def log_paths(self) -> list[Path]:
        return [self.server.log_path]

    def process_groups(self) -> list[int]:
        return [self.server.pid]

    def named_process_groups(self) -> dict[str, int]:
        return {"colocated": self.server.pid}

    def instances(self) -> dict[str, str]:
        return {"colocated": self.server.base_url}


class OursSystem(BenchSystem):
    def __init__(
        self,
        settings: EngineSettings,
        prefill_tp: int,
        decode_tp: int,
        log_dir: Path,
        kv_hold_timeout_s: int,
        name: str = "ours",
        proxy_args: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.description = (
            f"MooncakeHeteroConnector P/D, prefill TP {prefill_tp} -> decode TP {decode_tp}, "
            f"vam-proxy {' '.join(proxy_args)}".rstrip()
        )
        self.deployment = LocalDeployment(
            DeploymentSpec(
                model=settings.model,
                prefill_tp=prefill_tp,
                decode_tp=decode_tp,
                dtype=settings.dtype,
                block_size=settings.block_size,
                max_model_len=settings.max_model_len,
                # How long P keeps a request's KV for D (vLLM's connector: abort timeout).
                release_timeout_s=float(kv_hold_timeout_s),
                log_dir=str(log_dir / self.name),
                extra_env={"VLLM_LOG_STATS_INTERVAL": str(STATS_INTERVAL_S), **settings.env},
                proxy_args=proxy_args,
                prefill_args=settings.engine_args,
                decode_args=settings.engine_args,
                worker_process=settings.worker_process,
            )
        )
        self.url = self.deployment.proxy_url

    def start(self, timeout_s: float) -> float:
        return self.deployment.start(timeout_s)

    def stop(self) -> None:
        self.deployment.stop()

    def transfer_check(self) -> TransferCheck:
        # Counted from the instances' Prometheus counters (decode pulls; prefill releases by
        # timeout when no decode finished reading): vLLM drops the logged metrics of an interval
        # in which its engine produced no tokens. The logs still give errors and the mean time.
        totals = self.deployment.transfer_totals()
        return _check_transfers(
            "Num successful pulls",
            ("Num failed pulls", "Num expired releases"),
            {
                "decode": self.deployment.decode.log_path,
                "prefill": self.deployment.prefill.log_path,
            },
            mean_time_key="Avg pull time (ms)",
            counts={
                "Num successful pulls": totals.get("successful", 0),
                "Num failed pulls": totals.get("failed", 0),
                "Num expired releases": totals.get("expired", 0),
            },
        )

    def log_paths(self) -> list[Path]:
        return [
            self.deployment.prefill.log_path,
            self.deployment.decode.log_path,
            self.deployment.proxy_log,
        ]

    def process_groups(self) -> list[int]:
        return self.deployment.process_groups()

    def named_process_groups(self) -> dict[str, int]:
        prefill, decode, *proxies = self.deployment.process_groups()
        names = ["proxy", *(f"proxy{i}" for i in range(2, len(proxies) + 1))]
        return {"prefill": prefill, "decode": decode, **dict(zip(names, proxies, strict=True))}

    def instances(self) -> dict[str, str]:
        return {
            "prefill": self.deployment.prefill.base_url,
            "decode": self.deployment.decode.base_url,
        }


class PeerPDSystem(BenchSystem):
    """A peer connector's P/D pair, prefill and decode, behind its own front process (the proxy
    or router its documentation pairs it with)."""

    prefill: VllmServer
    decode: VllmServer
    front_log: Path
    front_what: str
    _front: subprocess.Popen[bytes] | None = None

    @abc.abstractmethod
    def front_command(self) -> list[str]:
        """The front process's command line (it serves :attr:`url`)."""
        ...

    def explain_front_failure(self, error: ServerError) -> ServerError:
        """What to add when the front process does not come up."""
        return error

    def start(self, timeout_s: float) -> float:
        """Like :meth:`LocalDeployment.start`: both instances, then the front process."""
        started = time.monotonic()
        start_servers((self.prefill, self.decode), timeout_s)
        try:
            self._front = start_helper(
                self.front_command(),
                self.front_log,
                f"{self.url}/health",
                timeout_s=_PROXY_READY_TIMEOUT_S,
                cwd=REPO_ROOT,
                what=self.front_what,
            )
        except ServerError as error:
            raise self.explain_front_failure(error) from error
        return time.monotonic() - started

    def stop(self) -> None:
        """Like :meth:`LocalDeployment.stop`: the front process, then decode and prefill."""
        front, self._front = self._front, None
        stop_all((front,), (self.decode, self.prefill))

    def log_paths(self) -> list[Path]:
        return [self.prefill.log_path, self.decode.log_path, self.front_log]

    def process_groups(self) -> list[int]:
        groups = [self.prefill.pid, self.decode.pid]
        return groups + ([self._front.pid] if self._front is not None else [])

    def instances(self) -> dict[str, str]:
        return {"prefill": self.prefill.base_url, "decode": self.decode.base_url}


def vllm_mooncake_config(role: str) -> dict[str, Any]:
    """``--kv-transfer-config`` for vLLM's in-tree connector over TCP."""
    config: dict[str, Any] = {
        "kv_connector": "MooncakeConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"mooncake_protocol": "tcp", "num_workers": 2},
    }
    if role == "kv_consumer":
        # A failed load must fail the request, not be recomputed silently (as with ours).
        config["kv_load_failure_policy"] = "fail"
    return config


class VllmMooncakeSystem(PeerPDSystem):
    name = "vllm_mooncake"
    front_what = "the MooncakeConnector proxy"

    def __init__(
        self,
        settings: EngineSettings,
        prefill_tp: int,
        decode_tp: int,
        log_dir: Path,
        kv_hold_timeout_s: int,
    ) -> None:
        self.description = (
            f"vLLM MooncakeConnector (tcp) P/D, prefill TP {prefill_tp} -> decode TP "
            f"{decode_tp}, benchmarks.e2e.mooncake_proxy"
        )
        self.log_dir = log_dir / "vllm_mooncake"
        self.bootstrap_port = free_port()
        inherited_path = os.environ.get("PYTHONPATH")
        env = {
            "VLLM_LOG_STATS_INTERVAL": str(STATS_INTERVAL_S),
            # One bootstrap server per P: a fixed default port would clash with another run.
            "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(self.bootstrap_port),
            # How long P keeps a request's KV for D; a lost transfer fails after this (+60 s).
            "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": str(kv_hold_timeout_s),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(SHIM_DIR), inherited_path])),
            SHIM_FLAG: "1",
        }
        self.prefill, self.decode = (
            settings.server(
                tp,
                self.log_dir / f"{label}.log",
                env,
                ["--kv-transfer-config", json.dumps(vllm_mooncake_config(role))],
            )
            for role, tp, label in (
                ("kv_producer", prefill_tp, "prefill"),
                ("kv_consumer", decode_tp, "decode"),
            )
        )
        self.proxy_port = free_port()
        self.url = f"http://127.0.0.1:{self.proxy_port}"
        self.front_log = self.log_dir / "proxy.log"

    @property
    def bootstrap_url(self) -> str:
        return f"http://127.0.0.1:{self.bootstrap_port}"

    def front_command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "benchmarks.e2e.mooncake_proxy",
            "--port",
            str(self.proxy_port),
            "--prefill",
            self.prefill.base_url,
            "--decode",
            self.decode.base_url,
            "--bootstrap",
            self.bootstrap_url,
        ]

    def explain_front_failure(self, error: ServerError) -> ServerError:
        return ServerError(
            f"{error}\n(P, D and P's bootstrap server {self.bootstrap_url}/query must "
            f"answer); prefill log tail:\n{self.prefill.log_tail(3000)}"
        )

    def proxy_stats(self) -> dict[str, Any] | None:
        """The proxy's count of failed prefill legs (None if it cannot be asked)."""
        try:
            with urllib.request.urlopen(f"{self.url}/proxy_stats", timeout=5) as response:
                return dict(json.load(response))
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def transfer_check(self) -> TransferCheck:
        # P pushes, so successes are logged on prefill; failed receives on decode.
        return _check_transfers(
            "Num successful transfers",
            ("Num failed transfers", "Num failed recvs", "Num KV expired reqs"),
            {"prefill": self.prefill.log_path, "decode": self.decode.log_path},
            mean_time_key="Avg xfer time (ms)",
        )


def nixl_config() -> dict[str, Any]:
    """``--kv-transfer-config`` for vLLM's NixlConnector on CPU: KV read from host memory
    (``kv_buffer_device: cpu``) with NIXL's UCX backend; both instances ``kv_both``, as vLLM's
    NIXL examples and vllm-router's P/D mode run them."""
    return {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        # A failed load must fail the request, not be recomputed silently (as with ours).
        "kv_load_failure_policy": "fail",
    }


class NixlSystem(PeerPDSystem):
    """vLLM's NixlConnector P/D on CPU behind ``vllm-router --vllm-pd-disaggregation
    --kv-connector nixl`` (the router its documentation pairs it with)."""

    name = "nixl"
    front_what = "vllm-router"

    def __init__(
        self,
        settings: EngineSettings,
        prefill_tp: int,
        decode_tp: int,
        log_dir: Path,
    ) -> None:
        self.description = (
            f"vLLM NixlConnector (UCX, kv_buffer_device cpu) P/D, prefill TP {prefill_tp} -> "
            f"decode TP {decode_tp}, vllm-router --vllm-pd-disaggregation"
        )
        self.log_dir = log_dir / "nixl"
        servers = []
        for role, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
            env = {
                "VLLM_LOG_STATS_INTERVAL": str(STATS_INTERVAL_S),
                # each instance serves its handshake on a port of its own (one per DP rank)
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                **{k: v for k, v in os.environ.items() if k.startswith("UCX_")},
            }
            servers.append(
                settings.server(
                    tp,
                    self.log_dir / f"{role}.log",
                    env,
                    ["--kv-transfer-config", json.dumps(nixl_config())],
                )
            )
        self.prefill, self.decode = servers
        self.router_port = free_port()
        self.url = f"http://127.0.0.1:{self.router_port}"
        self.front_log = self.log_dir / "router.log"

    def front_command(self) -> list[str]:
        return [
            str(Path(sys.executable).parent / "vllm-router"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.router_port),
            "--vllm-pd-disaggregation",
            "--kv-connector",
            "nixl",
            "--prefill",
            self.prefill.base_url,
            "--decode",
            self.decode.base_url,
            "--prometheus-port",
            str(free_port()),
        ]

    def transfer_check(self) -> TransferCheck:
        # Decode reads (NIXL pull): successes and failures are logged on decode.
        return _check_transfers(
            "Num successful transfers",
            ("Num failed transfers", "Num KV expired reqs", "Num notifs after expiry"),
            {"prefill": self.prefill.log_path, "decode": self.decode.log_path},
            mean_time_key="Avg xfer time (ms)",
        )
