"""Every timeline stamp of the continued route's requests, as ms after the proxy received them.

``request_timeline.py`` splits a request's proxy-side TTFT along a fixed critical path; this reads
the same ``request timeline`` lines (``VAM_TIMELINE_LOG=1``) and prints, per stamp of any process
(the proxy's, prefill's scheduler and worker: ``arrived`` is vLLM's ``arrival_time``, set when
prefill's API server starts rendering the prompt), its median and mean offset from the proxy's
``received``, in order, and the step from the stamp before it: where the milliseconds between the
proxy and prefill's scheduler, and back, go.

    python -m benchmarks.e2e.hop_stamps LOG_DIR [LOG_DIR ...] [--mode continued] [--skip N]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from .request_timeline import join, read_records


def offsets(log_dirs: list[Path], mode: str, skip: int = 0) -> tuple[int, dict[str, list[float]]]:
    """(requests, "source.name" -> ms after the proxy received each request that has it); the
    first ``skip`` requests (by arrival) left out (warm-up)."""
    paths = [path for log_dir in log_dirs for path in sorted(log_dir.rglob("*.log"))]
    joined = join(read_records(paths))
    entries = [
        entry
        for entry in joined.values()
        if entry.get("mode") == mode and ("proxy", "received") in entry["stamps"]
    ]
    entries.sort(key=lambda entry: entry["stamps"][("proxy", "received")])
    entries = entries[skip:]
    result: dict[str, list[float]] = {}
    for entry in entries:
        start = entry["stamps"][("proxy", "received")]
        for (source, name), at in entry["stamps"].items():
            result.setdefault(f"{source}.{name}", []).append(1e3 * (at - start))
    return len(entries), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log_dirs", nargs="+", type=Path)
    parser.add_argument("--mode", default="continued")
    parser.add_argument("--skip", type=int, default=0, help="first requests left out (warm-up)")
    args = parser.parse_args()
    count, stamps = offsets(args.log_dirs, args.mode, args.skip)
    print(f"{count} {args.mode} requests; ms after proxy.received")
    print(f"{'stamp':32} {'median':>8} {'mean':>8} {'step(median)':>13} {'n':>4}")
    previous = 0.0
    for name, values in sorted(stamps.items(), key=lambda item: statistics.median(item[1])):
        median = statistics.median(values)
        print(
            f"{name:32} {median:8.2f} {statistics.fmean(values):8.2f} "
            f"{median - previous:13.2f} {len(values):4d}"
        )
        previous = median


if __name__ == "__main__":
    main()
