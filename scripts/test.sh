#!/usr/bin/env bash
# Install (CPU) and run the linter and the whole CPU test suite: unit, multi-process (gloo) and end-to-end CLI tests.
#
#   bash scripts/test.sh            the whole suite (what CI runs); the tests marked gpu_machine run in
#                                   scripts/test_torch211.sh instead, on the GPU machine's stack
#   bash scripts/test.sh --fast     the 5-minute tier: every test that starts no process, plus the tests marked
#                                   fast (2-rank end-to-end training with bnb and HQQ down to an adapter PEFT loads)
#   bash scripts/test.sh ARGS...    more pytest arguments (a -m of yours replaces the tier's selection)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_cpu.sh
VENV=${VENV:-.venv}
"$VENV/bin/ruff" check .
SELECT="not gpu_machine"
if [ "${1:-}" = "--fast" ]; then
    shift
    SELECT="fast or not (distributed or gpu or gpu_machine)"
fi
# Two workers, each taking whole test files (module fixtures build once): the multi-process tests leave cores idle
# while processes start and ranks wait on each other, which the other worker fills (three workers on these two
# cores were slower in .ci/run: 1,921 s of pytest against 1,755). PYTEST_WORKERS=0: one process. --durations:
# the slowest tests, for CI's log.
# --no-loadscope-reorder: files go out in collection order, which tests/conftest.py starts with the longest ones
# (xdist's default order, most tests first, left the few-test multi-process files running alone at the end).
"$VENV/bin/python" -m pytest -q -n "${PYTEST_WORKERS:-2}" --durations=25 --dist loadfile --no-loadscope-reorder \
    -m "$SELECT" "$@"
