"""The per-step benchmarks run and report every cost: the scheduler side's (every prefill request
held and every decode request pulled through the real connector scheduler and vLLM's request
objects, no engine) and the worker side's (the product's tracker and pull reports).

The scheduler's once raised on its first request: its block ids started at 0, vLLM's null block,
which the scheduler rightly refuses to hold, so no params came back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(module: str, requests: int, tmp_path: Path) -> dict:
    """Run ``benchmarks.micro.<module>`` with ``requests`` in flight; its JSON results."""
    out = tmp_path / f"{module}.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            f"benchmarks.micro.{module}",
            "--requests",
            str(requests),
            "--json",
            str(out),
        ],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
        timeout=300,
    )
    results = json.loads(out.read_text())
    assert results["requests_in_flight"] == requests
    return results


def test_bench_scheduler_reports_every_step_cost(tmp_path: Path) -> None:
    results = run_benchmark("bench_scheduler", 40, tmp_path)
    for key in (
        "prefill_request_finished_us_per_request",
        "decode_match_and_alloc_us_per_request",
        "build_connector_meta_ms_burst_all_new",
        "build_connector_meta_ms_steady_8_new_median",
        "build_connector_meta_ms_idle",
    ):
        assert results[key] > 0, key


def test_bench_worker_step_reports_both_sides(tmp_path: Path) -> None:
    results = run_benchmark("bench_worker_step", 300, tmp_path)
    for key in (
        "prefill_hold_us_per_request",
        "prefill_claim_us_per_request",
        "prefill_step_ms_steady_8_freed_median",
        "prefill_step_ms_idle_median",
        "decode_admit_us_per_request",
        "decode_step_ms_steady_8_landed_median",
        "decode_step_ms_idle_median",
    ):
        assert results[key] > 0, key
