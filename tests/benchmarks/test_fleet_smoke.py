"""The fleet simulation (``python -m benchmarks.fleet``) at CI size: a few peers, a few hundred
requests, its faults included. It runs the product's side channels, trackers and receivers in
separate processes over loopback ZMQ (no bytes move); these tests check that it runs, that every
failed pull is attributed to an abort or an injected fault, and that it reports every field the
table and the curves are made of."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # the benchmark lives outside the installed package
    sys.path.insert(0, str(REPO_ROOT))

run = importlib.import_module("benchmarks.fleet.run")
report = importlib.import_module("benchmarks.fleet.report")
workers = importlib.import_module("benchmarks.fleet.workers")

PROCESS_FIELDS = (
    "threads_setup",
    "threads_max",
    "threads_end",
    "fds_setup",
    "fds_max",
    "fds_end",
    "rss_setup_mib",
    "rss_max_mib",
    "rss_end_mib",
)


def settings(shape: str, size: int, requests: int, faults: bool) -> run.Settings:
    return run.Settings(
        shape=shape,
        size=size,
        requests=requests,
        rate=400.0,
        early_fraction=0.25,
        abort_fraction=0.05,
        min_tokens=128,
        max_tokens=4096,
        early_delay_s=0.02,
        faults=faults,
        freeze_s=1.0,
        workers_per_host=2,
        seed=3,
        drain_s=30.0,
        timing=workers.Timing(side_channel_timeout_s=2.0, claim_wait_s=3.0, prefill_wait_s=5.0),
    )


def check_fields(result: dict, requests: int) -> None:
    assert result["requests"] == requests
    assert result["pulls_done"] + result["pulls_failed"] == requests
    assert result["failed_unattributed"] == 0, result["unattributed_examples"]
    assert result["pulls_done"] > requests // 2
    for name in ("claim_to_grant", "early_hold_to_grant", "read_done_to_release"):
        latency = result["latency"][name]
        assert latency["n"] > 0 and 0 <= latency["p50_ms"] <= latency["p99_ms"], name
    assert set(result["cpu_us_per_pull"]) == {"decode", "prefill"}
    assert set(result["cpu_us_per_pull_net_of_idle"]) == {"decode", "prefill"}
    assert result["tcp_time_wait_at_end"] >= 0
    for anatomy in result["anatomy_at_end"].values():
        assert anatomy["threads"]["MainThread"] == 1 and anatomy["fds"]
    for role in ("decode", "prefill"):
        summary = result["per_process_max"][role]
        assert all(summary[key] is not None for key in PROCESS_FIELDS), (role, summary)
    for process in result["processes"]:
        assert process["workers"] >= 1
        if process["alive_at_end"]:
            assert process["threads_end"] > 0 and process["fds_end"] > 0
    row = report.markdown_table([result]).splitlines()[-1]
    assert row.startswith(f"| {result['shape']} | {result['size']} |")


@pytest.mark.timeout(120)
def test_fan_in_with_faults() -> None:
    """One decode worker, five prefill workers in four processes: one killed, one frozen, one
    replaced under a new port, while 300 requests (early pulls and aborts among them) run."""
    result = run.run_point(settings("fan-in", 5, 300, faults=True), log=lambda _: None)
    check_fields(result, 300)
    assert [f["fault"] for f in result["faults"]] == ["kill", "freeze", "replace"]
    assert set(result["failed_by_cause"]) <= {"abort", "kill", "freeze", "replace"}
    killed = [p for p in result["processes"] if not p["alive_at_end"]]
    assert len(killed) == 1 and killed[0]["role"] == "prefill"


@pytest.mark.timeout(120)
def test_fan_out() -> None:
    """One prefill worker serving three decode workers in two processes."""
    result = run.run_point(settings("fan-out", 3, 200, faults=False), log=lambda _: None)
    check_fields(result, 200)
    assert result["faults"] == [] and result["decode_workers"] == 3
    assert sum(p["role"] == "decode" for p in result["processes"]) == 2


def test_png(tmp_path: Path) -> None:
    """The curves' PNG is drawn from two sizes' results (Pillow; no plotting library)."""
    pytest.importorskip("PIL")
    latency = {"n": 1, "p50_ms": 1.0, "p99_ms": 2.0, "max_ms": 2.0}
    results = [
        {
            "shape": "fan-in",
            "size": size,
            "per_process_max": {
                role: dict.fromkeys(PROCESS_FIELDS, size + 10) for role in ("decode", "prefill")
            },
            "latency": {
                name: latency
                for name in ("claim_to_grant", "early_hold_to_grant", "read_done_to_release")
            },
        }
        for size in (1, 16, 128)
    ]
    path = report.write_png(results, tmp_path / "fleet.png")
    assert path is not None and path.stat().st_size > 1000
