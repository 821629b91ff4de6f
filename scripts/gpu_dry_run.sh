#!/usr/bin/env bash
# The GPU suite's dry run on the GPU machine's stack, as CI runs it (needs the network, for the wheels):
#
#   PYTHON=VENV/bin/python bash scripts/gpu_dry_run.sh [OUT_DIR]     (default OUT_DIR: results/gpu-dry-run)
#
# VENV should hold only what that machine has preinstalled (torch 2.11, transformers 5.17, accelerate, peft,
# safetensors, tokenizers, pyyaml, tqdm, numpy): the carried wheels then provide the rest, as they must there.
# Exits non-zero if any plan item failed (results.md names each one's cause).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${PYTHON:?set PYTHON to the python of a venv with the GPU machine's packages}"
bash benchmarks/gpu_wheels.sh
bash benchmarks/gpu.sh "${1:-results/gpu-dry-run}" --dry-run
