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
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir --find-links .wheelhouse)
"${PIP[@]}" --upgrade pip
# Where the torch 2.11 venv has them, torch, triton and the CUDA libraries (about 4.5 GB) become hard links to its
# files, which pip then finds installed: a second copy ran CI's disk out of space. Not their console scripts (torchrun
# and the like), which name the other venv's interpreter.
TORCH211=${VENV_TORCH211:-.venv-torch211}
if [ -x "$TORCH211/bin/python" ]; then
    "$TORCH211/bin/python" - "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" <<'EOF'
import importlib.metadata
import os
import sys
from pathlib import Path

site = Path(sys.argv[1])
for dist in importlib.metadata.distributions():
    name = dist.metadata["Name"].lower()
    if name in ("torch", "triton") or name.startswith(("nvidia-", "cuda-")):
        for file in dist.files or ():
            source, target = Path(dist.locate_file(file)), site / file
            if file.parts[0] != ".." and source.is_file() and not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                os.link(source, target)
EOF
fi
"${PIP[@]}" -c constraints-torch211.txt torch transformers accelerate peft safetensors tokenizers pyyaml tqdm numpy
PYTHON="$VENV/bin/python" bash benchmarks/gpu_wheels.sh
