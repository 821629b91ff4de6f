#!/usr/bin/env bash
# Install (CPU) and run the linter and the whole test suite: unit, multi-process (gloo) and end-to-end CLI tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_cpu.sh
VENV=${VENV:-.venv}
"$VENV/bin/ruff" check .
"$VENV/bin/python" -m pytest -q "$@"
