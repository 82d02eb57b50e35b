"""A complete P/D deployment on this machine: prefill and decode `vllm serve` plus the proxy.

Used by the demo, the end-to-end tests and the benchmarks. Both instances load the connector by
name (the package's vLLM plugin registers it) with Mooncake over TCP; they are started at the same
time to halve the start-up wait, and everything is stopped by process group.

By default everything listens on 127.0.0.1. Each instance can instead run on a :class:`Host` of
its own, an address plus a command prefix that runs programs there: the two-host test puts
prefill and decode in network namespaces (``vam_testing/netns.py`` in the repository, not
shipped), with the proxy beside decode, as a cross-node deployment would.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..connector.config import ConnectorConfig
from ..names import CONNECTOR_NAME
from ..options import default_of
from .ports import free_port, free_port_range
from .prometheus import metric_samples, metric_sum, metrics_text
from .servers import (
    StartedInContext,
    VllmServer,
    start_helper,
    start_servers,
    stop_all,
)

_METRICS_LINE = re.compile(r"KV Transfer metrics: (.*)$")


@dataclass(frozen=True)
class Host:
    """Where an instance runs: the address it serves on and advertises (``VLLM_HOST_IP``, so
    the connector's side channel and Mooncake too), and the prefix that runs a program there.

    The prefix must exec its command (``ip netns exec NS`` does), so that the PID started is the
    program's and stopping its process group stops the program.
    """

    address: str = "127.0.0.1"
    command_prefix: tuple[str, ...] = ()


LOOPBACK = Host()


@dataclass
class DeploymentSpec:
    model: str
    prefill_tp: int = 2
    decode_tp: int = 1
    #: data-parallel engines behind the prefill instance's one API server
    prefill_dp: int = 1
    dtype: str = "float32"
    block_size: int = 32
    #: the prefill instance's block size where it differs from decode's (``block_size``)
    prefill_block_size: int | None = None
    max_model_len: int = 512
    release_timeout_s: float = default_of(ConnectorConfig, "release_timeout_s")
    # vLLM's kv_load_failure_policy on decode: "fail" (error the request) or "recompute".
    decode_failure_policy: str = "fail"
    # Fix the prefill engine id (vLLM draws a random one), e.g. to restart it under the same id.
    prefill_engine_id: str | None = None
    extra_connector_config: dict[str, Any] = field(default_factory=dict)
    log_dir: str | None = None
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)
    proxy_args: tuple[str, ...] = ()  # e.g. ("--serial-legs",)
    # Both instances share this host's cores: a step that runs no tokens waits longer for a
    # transfer, so an instance whose requests only wait for KV takes less CPU from the other's
    # forward (docs/deploy-single-host.md, "sharing cores"); the connector's default is 10 ms.
    idle_step_wait_ms: float = 50.0
    #: Decode pairs with the deployment's prefill at start-up (``prefill_side_channels``), so an
    #: incompatible pair stops decode's start-up instead of failing its first request.
    pair_at_start: bool = True
    #: A TP 1 instance runs its model in a worker process of its own (vLLM's CPU default) rather
    #: than in its engine-core process (vLLM's default on GPU, and quicker to start here);
    #: see :class:`VllmServer`.
    worker_process: bool = False


def connector_config(
    spec: DeploymentSpec, role: str, side_channel_port: int, prefill_address: str = "127.0.0.1"
) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of one instance; decode's names the prefill it pairs with
    at start-up (``prefill_address``, ``side_channel_port``) unless ``spec.pair_at_start`` is
    off."""
    config: dict[str, Any] = {"kv_connector": CONNECTOR_NAME, "kv_role": role}
    pairing: dict[str, Any] = {}
    if role == "kv_consumer":
        config["kv_load_failure_policy"] = spec.decode_failure_policy
        if spec.pair_at_start:
            host = f"[{prefill_address}]" if ":" in prefill_address else prefill_address
            pairing["prefill_side_channels"] = f"{host}:{side_channel_port}"
    elif spec.prefill_engine_id:
        config["engine_id"] = spec.prefill_engine_id
    return {
        **config,
        "kv_connector_extra_config": {
            "prefill": {"tp_size": spec.prefill_tp, "dp_size": spec.prefill_dp},
            "decode": {"tp_size": spec.decode_tp},
            "side_channel_port": side_channel_port,
            "release_timeout_s": spec.release_timeout_s,
            "idle_step_wait_ms": spec.idle_step_wait_ms,
            **pairing,
            **spec.extra_connector_config,
        },
    }


def _data_parallel_args(dp_size: int) -> tuple[str, ...]:
    """vLLM's arguments for ``dp_size`` engines behind one API server on this host: the
    engines' RPC port is drawn free, so that deployments side by side do not collide."""
    if dp_size == 1:
        return ()
    return ("--data-parallel-size", str(dp_size), "--data-parallel-rpc-port", str(free_port()))


class LocalDeployment(StartedInContext):
    """Prefill + decode + proxy: on 127.0.0.1, or on the given hosts (the proxy beside decode)."""

    def __init__(
        self, spec: DeploymentSpec, *, prefill_host: Host = LOOPBACK, decode_host: Host = LOOPBACK
    ) -> None:
        self.spec = spec
        self.hosts = {"kv_producer": prefill_host, "kv_consumer": decode_host}
        log_dir = Path(spec.log_dir or tempfile.mkdtemp(prefix="vam-pd-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self.side_channel_port = free_port_range(spec.prefill_tp * spec.prefill_dp)
        env = {
            # TP > 1 on a couple of cores: pinning OpenMP threads to cores oversubscribes them.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_LOG_STATS_INTERVAL": "1",
            **spec.extra_env,
        }

        self._env = env
        self._restarts = 0
        self.prefill = self.make_server("kv_producer")
        self.decode = self.make_server("kv_consumer")
        self.proxy_port = free_port()
        self.proxy_log = log_dir / "proxy.log"
        self._proxy: subprocess.Popen[bytes] | None = None
        self._extra_proxies: list[subprocess.Popen[bytes]] = []
        self._extra_servers: list[VllmServer] = []

    def make_server(
        self,
        role: str,
        *,
        port: int | None = None,
        name: str | None = None,
        side_channel_port: int | None = None,
        **overrides: Any,
    ) -> VllmServer:
        """A (not yet started) instance of this deployment; ``overrides`` replace spec fields.
        ``side_channel_port``: for a prefill instance beside this deployment's own, its own base
        port (the deployment's by default)."""
        spec = replace(self.spec, **overrides) if overrides else self.spec
        producer = role == "kv_producer"
        base_port = self.side_channel_port if side_channel_port is None else side_channel_port
        config = connector_config(spec, role, base_port, self.hosts["kv_producer"].address)
        host = self.hosts[role]
        return VllmServer(
            spec.model,
            # A port free here is free on a host of its own too (a fresh network namespace).
            port=free_port() if port is None else port,
            host=host.address,
            command_prefix=host.command_prefix,
            tensor_parallel_size=spec.prefill_tp if producer else spec.decode_tp,
            dtype=spec.dtype,
            block_size=(spec.prefill_block_size or spec.block_size)
            if producer
            else spec.block_size,
            max_model_len=spec.max_model_len,
            extra_args=[
                "--kv-transfer-config",
                json.dumps(config),
                *(_data_parallel_args(spec.prefill_dp) if producer else ()),
                *(spec.prefill_args if producer else spec.decode_args),
            ],
            extra_env={"VLLM_HOST_IP": host.address, **self._env},
            worker_process=spec.worker_process,
            log_path=self.log_dir / f"{name or ('prefill' if producer else 'decode')}.log",
        )

    def add_server(self, role: str, *, name: str, **overrides: Any) -> VllmServer:
        """An instance beside the deployment's own (e.g. a prefill of another TP or block size,
        with a ``side_channel_port`` of its own), made like :meth:`make_server`: started with
        them, their start-ups overlapping (a start-up is mostly one core importing: a TP 1
        instance took 12.5 s alone, two together 13.5 s, three 20.6 s on 2 cores), or at once if
        the deployment runs already; stopped with them."""
        server = self.make_server(role, name=name, **overrides)
        self._extra_servers.append(server)
        if self._proxy is not None:
            start_servers((server,), 600.0)
        return server

    def kill(self, role: str) -> None:
        """SIGKILL a whole instance (its process group), ``"prefill"`` or ``"decode"``, as a
        crash would."""
        server = self._instance(role)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, 9)
        server.stop()

    def freeze(self, role: str) -> None:
        """SIGSTOP a whole instance, as a host stall would: it answers nothing until thawed."""
        os.killpg(self._instance(role).pid, signal.SIGSTOP)

    def thaw(self, role: str) -> None:
        """SIGCONT an instance stopped by :meth:`freeze`."""
        os.killpg(self._instance(role).pid, signal.SIGCONT)

    def restart(self, role: str, timeout_s: float = 600.0, **overrides: Any) -> float:
        """Start a new ``role`` instance on the same ports; ``overrides`` replace spec fields
        (e.g. ``prefill_engine_id=None`` for a fresh engine id). Its log gets a new name."""
        old = self._instance(role)
        self._restarts += 1
        server = self.make_server(
            "kv_producer" if role == "prefill" else "kv_consumer",
            port=old.port,
            name=f"{role}-{self._restarts + 1}",
            **overrides,
        )
        setattr(self, role, server)
        server.start()
        return server.wait_ready(timeout_s)

    def _instance(self, role: str) -> VllmServer:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', not {role!r}")
        return getattr(self, role)

    @property
    def proxy_host(self) -> Host:
        """The proxy runs beside decode, as the vLLM and Mooncake P/D examples place it."""
        return self.hosts["kv_consumer"]

    @property
    def proxy_url(self) -> str:
        return f"http://{self.proxy_host.address}:{self.proxy_port}"

    def start(self, timeout_s: float = 600.0, *, one_at_a_time: bool = False) -> float:
        """Start everything: both instances (and those of :meth:`add_server`) until they answer
        `/health`, then the proxy.

        The instances start at the same time unless ``one_at_a_time``: instances sharing one
        GPU must not profile its memory while the other allocates (vLLM sizes its KV cache
        from what the profiling run saw)."""
        started = time.monotonic()
        servers = (self.prefill, self.decode, *self._extra_servers)
        if one_at_a_time:
            for server in servers:
                start_servers((server,), max(1.0, timeout_s - (time.monotonic() - started)))
        else:
            start_servers(servers, timeout_s)
        self._proxy = self._start_proxy(self.proxy_port, self.proxy_log, self.spec.proxy_args)
        return time.monotonic() - started

    def add_proxy(self, *proxy_args: str) -> str:
        """Start another proxy in front of the same instances, e.g. ``"--serial-legs"`` next to
        the default one, and return its URL; :meth:`stop` stops it too."""
        port = free_port()
        log = self.log_dir / f"proxy-{port}.log"
        self._extra_proxies.append(self._start_proxy(port, log, proxy_args))
        return f"http://{self.proxy_host.address}:{port}"

    def _start_proxy(
        self, port: int, log_path: Path, proxy_args: tuple[str, ...]
    ) -> subprocess.Popen[bytes]:
        """A proxy process in a session of its own; returns once it answers (its `/health` is
        its own liveness: the instances were waited for already, and a fault test may start a
        proxy in front of one that is down)."""
        host = self.proxy_host
        return start_helper(
            [
                *host.command_prefix,
                sys.executable,
                "-m",
                "vllm_ascend_mooncake.proxy",
                "--host",
                host.address,
                "--port",
                str(port),
                "--prefill",
                self.prefill.base_url,
                "--decode",
                self.decode.base_url,
                # as its vLLM instances (--disable-uvicorn-access-log): no line per request
                "--no-access-log",
                *proxy_args,
            ],
            log_path,
            f"http://{host.address}:{port}/health",
            # the instances' environment (a side-channel secret: the proxy renews holds)
            env={**os.environ, **self._env},
        )

    def stop(self) -> None:
        """Stop the proxies, then decode, prefill and the added instances (each by process
        group)."""
        stop_all(
            (self._proxy, *self._extra_proxies), (self.decode, self.prefill, *self._extra_servers)
        )

    def process_groups(self) -> list[int]:
        """Process-group ids of the instances and of the proxies started (each runs in a
        session of its own), e.g. to account for their CPU."""
        proxies = [p.pid for p in (self._proxy, *self._extra_proxies) if p is not None]
        return [self.prefill.pid, self.decode.pid, *proxies]

    def transfer_metrics(self) -> str | None:
        """The last "KV Transfer metrics" line the decode instance logged (pulls happen there)."""
        last = None
        try:
            for line in self.decode.log_path.read_text(errors="replace").splitlines():
                match = _METRICS_LINE.search(line)
                if match:
                    last = match.group(1)
        except OSError:
            return None
        return last

    def transfer_totals(self) -> dict[str, int]:
        """Pulls that succeeded and failed on decode (each decode rank counts its own) and
        prefill's releases by timeout (holds no read-done notice freed), from the instances'
        Prometheus counters. An instance that is not running is left out.

        Not from the logged "KV Transfer metrics": vLLM logs an interval in which its engine
        produced no tokens at DEBUG level and then discards it, so a pull that failed on an
        otherwise idle engine (or a release by timeout on an idle prefill) never shows there.
        """
        totals: dict[str, int] = {}
        if self.decode.is_running():
            text = metrics_text(self.decode.base_url)
            totals["successful"] = round(
                metric_sum(text, "vllm:mooncake_hetero_pull_seconds_count")
            )
            totals["failed"] = round(metric_sum(text, "vllm:mooncake_hetero_failed_pulls_total"))
        if self.prefill.is_running():
            text = metrics_text(self.prefill.base_url)
            totals["expired"] = round(
                metric_sum(text, "vllm:mooncake_hetero_expired_releases_total")
            )
        return totals

    def failed_pulls_by_kind(self) -> dict[str, int]:
        """Decode's failed pulls by kind (:class:`~..datapath.failures.FailureKind`), the kinds
        that occurred only; empty when decode is not running."""
        if not self.decode.is_running():
            return {}
        counts: dict[str, int] = {}
        text = metrics_text(self.decode.base_url)
        for labels, value in metric_samples(text, "vllm:mooncake_hetero_failed_pulls_total"):
            if round(value):
                counts[labels["kind"]] = counts.get(labels["kind"], 0) + round(value)
        return counts

    def _start(self) -> None:
        self.start()

    def _stop(self) -> None:
        self.stop()


__all__ = [
    "LOOPBACK",
    "DeploymentSpec",
    "Host",
    "LocalDeployment",
    "connector_config",
]
