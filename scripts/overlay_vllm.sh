#!/usr/bin/env bash
# Make .venv-vllm-X.Y-sources: vLLM X.Y's Python sources (PyPI's CUDA wheel, without its
# dependencies) over .venv's packages (the CPU torch, Mooncake, this checkout).
#
#   bash scripts/overlay_vllm.sh 0.34
#
# vLLM 0.33 and 0.34 have no CPU build and pin a CUDA torch 2.14 that these machines cannot run,
# but their scheduler and connector API are plain Python: with them first on sys.path and .venv's
# packages after (a .pth file), the tests that need no engine (tests/scheduler, the connector
# tests) run on that vLLM. vLLM falls back to its unspecified platform there (no GPU, no CPU
# build), so engine tests are not run. Idempotent: a second run only checks the version (seconds).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

series="${1:?usage: bash scripts/overlay_vllm.sh MAJOR.MINOR}"
if ! [[ "$series" =~ ^[0-9]+\.[0-9]+$ ]]; then
    echo "[overlay] error: expected a vLLM series like 0.34, got '$series'" >&2
    exit 2
fi
BASE="$REPO_ROOT/.venv"
VENV="$REPO_ROOT/.venv-vllm-$series-sources"
say() { echo "[overlay] $*"; }

[ -x "$BASE/bin/python" ] || { echo "[overlay] error: run scripts/setup.sh first" >&2; exit 1; }
base_site="$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

installed() {
    [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -I -c "
import sys, vllm
sys.exit(not vllm.__version__.startswith('$series.'))" 2>/dev/null
}

if installed; then
    say "vLLM $series sources ready in $VENV"
    exit 0
fi
rm -rf "$VENV"
"$BASE/bin/python" -m venv --without-pip "$VENV"
site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# .pth directories come after the venv's own site-packages: its vLLM shadows .venv's.
echo "$base_site" >"$site/zz_vam_base_packages.pth"
say "installing vllm==$series.* (no dependencies) into $VENV"
"$BASE/bin/python" -m pip install --quiet --no-deps --target "$site" "vllm==$series.*"
installed || { echo "[overlay] error: vllm $series does not import from $VENV" >&2; exit 1; }
say "ready: $("$VENV/bin/python" -I -c 'import vllm; print("vllm", vllm.__version__)')"
