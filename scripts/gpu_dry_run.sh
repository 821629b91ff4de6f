#!/usr/bin/env bash
# The GPU suite's dry run on the GPU machine's stack, run by hand (needs the network, for the wheels):
#
#   bash scripts/gpu_dry_run.sh [OUT_DIR]                            (default OUT_DIR: results/gpu-dry-run)
#   PYTHON=VENV/bin/python bash scripts/gpu_dry_run.sh [OUT_DIR]     (another interpreter)
#
# PYTHON defaults to .venv-gpu-machine/bin/python, which scripts/install_gpu_machine.sh makes: a venv holding only
# what that machine has preinstalled (torch 2.11, transformers 5.17, accelerate, peft, safetensors, tokenizers,
# pyyaml, tqdm, numpy), so the carried wheels must provide the rest, as they must there.
#
# CI does not call this script: scripts/test_torch211.sh runs the same dry run as a test,
# tests/benchmarks/test_harness.py::test_gpu_script_dry_run (marker gpu_machine), with QLORA_GPU_PYTHON naming
# that venv, and the test also checks the figures in results.json. This script builds the wheels and runs the whole
# plan, like that test; it exits non-zero if any plan item failed (results.md names each one's cause).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv-gpu-machine/bin/python}
if [[ ! -x $PYTHON ]]; then
    echo "no $PYTHON: run bash scripts/install_gpu_machine.sh, or set PYTHON" >&2
    exit 2
fi
export PYTHON
bash benchmarks/gpu_wheels.sh
bash benchmarks/gpu.sh "${1:-results/gpu-dry-run}" --dry-run
