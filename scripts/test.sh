#!/usr/bin/env bash
# Set up (idempotent), lint, and run the test suite; arguments go to pytest (default: tests/).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

bash scripts/setup.sh

echo "[test] ruff check"
.venv/bin/ruff check .

echo "[test] pytest $*"
# pytest's exit code 5 (no tests collected) is a failure like any other non-zero code.
exec .venv/bin/python -m pytest "$@"
