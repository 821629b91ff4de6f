#!/usr/bin/env bash
# A virtualenv that holds exactly what the lent GPU machine has preinstalled, on the CPU, plus the wheels carried to
# it (.whl/, benchmarks/gpu_wheels.sh): Python 3.12, torch 2.11 and transformers 5.17 (constraints-torch211.txt),
# accelerate, peft, safetensors, tokenizers, pyyaml, tqdm, numpy, and what those depend on; no datasets, pyarrow,
# pandas, fire or wandb. The GPU suite's dry run in it (QLORA_GPU_PYTHON, tests/benchmarks/test_harness.py) then
# fails here on a module that machine lacks, not on the machine. Needs the network (PyPI) for the wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV_GPU_MACHINE:-.venv-gpu-machine}
[ -x "$VENV/bin/python" ] || "$(bash scripts/python312.sh)" -m venv "$VENV"
# torch and its CUDA libraries from .wheelhouse/ where scripts/install_torch211.sh left them (else downloaded).
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check --find-links .wheelhouse)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" -c constraints-torch211.txt torch transformers accelerate peft safetensors tokenizers pyyaml tqdm numpy
PYTHON="$VENV/bin/python" bash benchmarks/gpu_wheels.sh
