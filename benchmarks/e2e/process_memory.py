"""Resident memory of every process of a system, by instance and role (Linux: reads ``/proc``).

A system names its process groups by instance (``colocated``; ``prefill``, ``decode``,
``proxy``); every live member of a group is read: its VmRSS, and its role from its command line
(:func:`.rss_growth.process_role`). Several processes of one label (two workers without a rank in
their title) are summed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path

from vllm_ascend_mooncake.launch.servers import process_group_members

from .rss_growth import parse_vm_rss_kib, process_label, process_role


def read_cmdline(pid: int) -> list[str]:
    """A process's arguments (empty if it exited)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def read_rss_mib(pid: int) -> float | None:
    """A process's VmRSS in MiB (None if it exited or has none)."""
    try:
        kib = parse_vm_rss_kib(Path(f"/proc/{pid}/status").read_text())
    except OSError:
        return None
    return None if kib is None else kib / 1024


def rss_by_process(groups: Mapping[str, int]) -> dict[str, float]:
    """MiB resident per process label (``"prefill engine-core"``, ``"proxy"``) of the given
    process groups (instance name -> process-group id)."""
    out: dict[str, float] = {}
    for instance, pgid in groups.items():
        for pid in process_group_members(pgid):
            rss = read_rss_mib(pid)
            if rss is None:
                continue
            label = process_label(instance, process_role(read_cmdline(pid)))
            out[label] = out.get(label, 0.0) + rss
    return out


def pids_by_process(groups: Mapping[str, int]) -> dict[str, list[int]]:
    """The PIDs behind each process label (for a report: which process to look into)."""
    out: dict[str, list[int]] = {}
    for instance, pgid in groups.items():
        for pid in process_group_members(pgid):
            with contextlib.suppress(OSError):
                label = process_label(instance, process_role(read_cmdline(pid)))
                out.setdefault(label, []).append(pid)
    return out


def maps_library(pid: int, path: str) -> bool:
    """Whether the process has the shared library at ``path`` mapped (e.g. a preloaded
    allocator); False if it exited."""
    try:
        return path in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False
