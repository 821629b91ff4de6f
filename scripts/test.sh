#!/usr/bin/env bash
# Install (CPU) and run the linter and the whole test suite: unit, multi-process (gloo) and end-to-end CLI tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_cpu.sh
VENV=${VENV:-.venv}
"$VENV/bin/ruff" check .
# --fast: the quick tier while you work. Every in-process unit test and the 2-rank end-to-end training with bnb and
# HQQ under FSDP2, down to an adapter PEFT loads (FSDP1 and the precomputed DPO reference are not in it yet).
if [ "${1:-}" = "--fast" ]; then
    shift
    set -- tests/unit tests/distributed/test_train_e2e.py -m "fast or not distributed" "$@"
fi
# Two workers, each taking whole test files (module fixtures build once): the multi-process tests leave cores idle
# while processes start and ranks wait on each other, which the other worker fills. PYTEST_WORKERS=0: one process.
# --no-loadscope-reorder: files go out in collection order, which tests/conftest.py starts with the longest ones
# (xdist's default order, most tests first, left the few-test multi-process files running alone at the end).
"$VENV/bin/python" -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
