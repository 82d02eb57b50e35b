#!/usr/bin/env bash
# Bring up a local P/D deployment (tiny model, prefill TP 2 -> decode TP 1, proxy), serve one
# request through it, print the answer and the KV-transfer statistics, stop everything.
# Arguments go to the demo (see --help): --prefill-tp, --decode-tp, --model, --keep-running.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

bash scripts/setup.sh
exec .venv/bin/python -m vllm_ascend_mooncake.launch.demo "$@"
