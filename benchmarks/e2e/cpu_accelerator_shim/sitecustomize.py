"""Benchmark-only shim: let vLLM's in-tree ``MooncakeConnector`` start on CPU-only torch.

``MooncakeConnectorWorker.__init__`` (vLLM 0.32, mooncake_connector.py:1186) calls
``torch.accelerator.current_device_index()``, which on a CPU build of torch raises
``RuntimeError: Cannot access accelerator device when none is available.``. Everything after that
call works on CPU (``current_platform.set_device(0)`` is a no-op there), so the benchmark puts
this directory on ``PYTHONPATH`` of the vLLM-connector instances only, with
``VAM_BENCH_CPU_ACCELERATOR_SHIM=1``.

It changes nothing unless that flag is set, and then only at the moment the connector module is
imported, and only if ``torch.accelerator.is_available()`` is false: ``current_device_index``
then answers 0. Other processes, and machines with an accelerator, are untouched. Python imports
``sitecustomize`` at start-up in every process (spawned vLLM workers included, as they inherit
``PYTHONPATH``). This file shadows any other ``sitecustomize`` on the path, so keep it off the
path of anything but those instances.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

ENABLE_FLAG = "VAM_BENCH_CPU_ACCELERATOR_SHIM"
PATCHED_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"


def _patch_current_device_index() -> None:
    import torch

    if not torch.accelerator.is_available():
        torch.accelerator.current_device_index = lambda: 0


class _PatchBeforeConnectorImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; applies the patch when the connector module is first looked up.

    It stays on ``sys.meta_path`` (removing itself would disturb the import system's iteration
    over that list) and costs one string comparison per later import.
    """

    patched = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> Any:
        if fullname == PATCHED_MODULE and not self.patched:
            self.patched = True
            _patch_current_device_index()
        return None


if os.environ.get(ENABLE_FLAG) == "1":
    sys.meta_path.insert(0, _PatchBeforeConnectorImport())
