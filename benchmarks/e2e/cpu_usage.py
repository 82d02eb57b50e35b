"""CPU time used by a system's processes, to explain latencies on a machine with few cores.

On 2 cores a P/D deployment runs twice the vLLM processes of a colocated instance. How many
cores a system keeps busy while idle, and whether it saturates the machine under load, says how
much of its latency may be contention rather than the connector. Linux only (reads ``/proc``),
like the rest of the launch code.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

from vllm_ascend_mooncake.launch.servers import process_group_members

_CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def parse_cpu_seconds(stat_line: str, ticks_per_s: int = _CLOCK_TICKS_PER_S) -> float:
    """User + system CPU seconds from one ``/proc/<pid>/stat`` line (all threads included)."""
    # Fields after "pid (comm) ": state ppid pgrp session tty tpgid flags minflt cminflt majflt
    # cmajflt utime stime ...; comm may contain spaces and parentheses.
    fields = stat_line[stat_line.rindex(")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / ticks_per_s


def group_cpu_seconds(process_groups: Iterable[int]) -> dict[int, float]:
    """CPU seconds used so far by each live process (pid -> seconds) of the given groups."""
    usage = {}
    for pgid in process_groups:
        for pid in process_group_members(pgid):
            try:
                usage[pid] = parse_cpu_seconds(Path(f"/proc/{pid}/stat").read_text())
            except (OSError, ValueError, IndexError):
                continue  # exited meanwhile
    return usage


def cpu_seconds_between(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds used between two snapshots, by processes present in the second."""
    return sum(max(0.0, seconds - before.get(pid, 0.0)) for pid, seconds in after.items())


def idle_cores(process_groups: list[int], window_s: float = 3.0) -> float:
    """Average number of cores the groups keep busy over ``window_s`` without requests."""
    before = group_cpu_seconds(process_groups)
    started = time.monotonic()
    time.sleep(window_s)
    after = group_cpu_seconds(process_groups)
    return cpu_seconds_between(before, after) / (time.monotonic() - started)
