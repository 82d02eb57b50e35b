#!/usr/bin/env bash
# The one-GPU check (benchmarks/gpu/run_gpu_check.py): install the [cuda] stack if it is not
# importable yet, then run prefill + decode + proxy on one GPU against a colocated instance and
# write a JSON report, all within VAM_GPU_CHECK_LIMIT_S (default 600 s).
#
#   bash benchmarks/gpu/run.sh [run_gpu_check options, e.g. --protocol rdma --json PATH]
#
# The virtualenv is $VAM_GPU_VENV (default .venv-cuda), created with --system-site-packages so a
# machine or image that already has vLLM's CUDA stack uses it. With --device cpu (the dry run) it
# is scripts/setup.sh's .venv unless VAM_GPU_VENV names one.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"
LIMIT_S="${VAM_GPU_CHECK_LIMIT_S:-600}"
STARTED=$SECONDS

say() { echo "[gpu-check] $*"; }
left() { echo $((LIMIT_S - (SECONDS - STARTED))); }

device=cuda
previous=""
for arg in "$@"; do
    [ "$previous" = "--device" ] && device="$arg"
    case "$arg" in --device=*) device="${arg#--device=}" ;; esac
    previous="$arg"
done

if [ "$device" = cpu ]; then
    if [ -z "${VAM_GPU_VENV:-}" ]; then
        bash scripts/setup.sh
    fi
    VENV="${VAM_GPU_VENV:-$REPO_ROOT/.venv}"
else
    VENV="${VAM_GPU_VENV:-$REPO_ROOT/.venv-cuda}"
    if [ ! -x "$VENV/bin/python" ]; then
        python="$(command -v python3.11 || command -v python3.12 || command -v python3)"
        say "creating $VENV with $("$python" --version) (system site packages visible)"
        "$python" -m venv --system-site-packages "$VENV"
    fi
fi
PYTHON="$VENV/bin/python"

check_stack() { "$PYTHON" -m benchmarks.gpu.run_gpu_check --device "$device" --check-stack; }

status=0
check_stack || status=$?
if [ "$status" -eq 3 ]; then
    # The stack imports; only this checkout's editable install (the vLLM plugin entry point) is
    # missing: no download needed.
    say "installing this checkout without dependencies (pip install --no-deps -e .)"
    "$PYTHON" -m pip install --quiet --no-deps --no-build-isolation -e . ||
        "$PYTHON" -m pip install --quiet --no-deps -e .
elif [ "$status" -eq 4 ]; then
    if [ "$device" = cpu ]; then
        echo "[gpu-check] error: scripts/setup.sh left the CPU stack incomplete" >&2
        exit 2
    fi
    say "installing -e '.[cuda,test]' into $VENV (downloads vLLM, CUDA torch, Mooncake)"
    log="$VENV/pip-install-cuda.log"
    if ! timeout "$(left)" "$PYTHON" -m pip install -e '.[cuda,test]' >"$log" 2>&1; then
        tail -n 30 "$log" >&2
        cat >&2 <<MESSAGE
[gpu-check] error: could not install the [cuda] stack (log: $log).
[gpu-check] This machine may not reach PyPI, or the install outran the ${LIMIT_S} s limit.
[gpu-check] Install it where PyPI is reachable ('pip install -e ".[cuda,test]"' into a venv,
[gpu-check] or use an image with vLLM 0.33 or 0.34 + mooncake-transfer-engine-cuda13) and point
[gpu-check] VAM_GPU_VENV at that venv; then rerun this script.
MESSAGE
        exit 2
    fi
elif [ "$status" -ne 0 ]; then
    echo "[gpu-check] error: the stack check itself failed (status $status)" >&2
    exit 2
fi
if [ "$status" -ne 0 ] && ! check_stack; then
    echo "[gpu-check] error: the stack still does not import after the install (see above)" >&2
    exit 2
fi

remaining="$(left)"
if [ "$remaining" -lt 120 ]; then
    echo "[gpu-check] error: only ${remaining} s of the ${LIMIT_S} s limit left after the install;" \
        "rerun (the stack is installed now)" >&2
    exit 2
fi
say "running the check (${remaining} s left of ${LIMIT_S} s)"
# The script keeps its own budget 15 s short of the limit; timeout's SIGTERM stops the instances
# and still writes the report, SIGKILL follows 20 s later.
exec timeout --kill-after=20 "$remaining" \
    "$PYTHON" -m benchmarks.gpu.run_gpu_check --budget-s "$((remaining - 15))" "$@"
