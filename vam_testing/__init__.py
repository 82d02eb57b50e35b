"""Test fixtures shared by the test suite and the benchmarks: the data-path harness, the reference
model of which KV heads live where, the emulated two-host network, and the fake vLLM requests
that drive the connector's scheduler side (``scheduler_fakes``).

They live at the repository's root, beside ``tests/`` and ``benchmarks/``, not in the shipped
package: the wheel installs only ``vllm_ascend_mooncake`` (pyproject.toml's packages.find), and no
module of it imports these (tests/core/test_import_graph.py checks). What the demo and the
launchers need lives in :mod:`vllm_ascend_mooncake.launch`. Run from the repository's root:
pytest puts it on ``sys.path`` (pyproject.toml's ``pythonpath``), as ``python -m benchmarks...``
does; a child process started with ``python -m vam_testing...`` gets it through
:func:`child_env`, and a ``multiprocessing`` spawn child inherits its parent's ``sys.path``.

Importing this package needs nothing beyond the standard library; the heavy libraries are
imported by the modules and functions that use them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

#: The repository's root: the folder that holds this package, ``tests/`` and ``benchmarks/``.
REPO_ROOT = Path(__file__).resolve().parent.parent


def child_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with :data:`REPO_ROOT` first on
    ``PYTHONPATH``, so that a child Python finds this package whatever its working directory."""
    env = dict(os.environ if base is None else base)
    rest = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO_ROOT) if not rest else f"{REPO_ROOT}{os.pathsep}{rest}"
    return env
