#!/usr/bin/env bash
# GPU suite: bash benchmarks/gpu.sh OUT_DIR [--dry-run] [more benchmarks/run.py flags, e.g. --peak_flops 989e12]
#
# Writes OUT_DIR/results.json and OUT_DIR/results.md: tokens/s, peak reserved/allocated CUDA memory and MFU of our
# bnb and HQQ training on a random Llama-2-7B-shaped model (written to local disk, never downloaded), at batch
# 1 x 512 and 8 x 2048, against the HF + PEFT + bitsandbytes loop, within about 9 minutes of machine time; then
# the same with whole logits (--loss_chunk_tokens 0) and with --compile true, each against the default run.
# --dry-run runs the same code on the CPU with tiny shapes and a few steps (what the test suite checks).
#
# The GPU machine has no network. It must provide python with a CUDA build of torch, transformers, peft,
# accelerate, safetensors, tokenizers, pyyaml and tqdm. Anything else it lacks is installed from wheels carried in
# .whl/ (ignored by git; pass it with the device tool's `carry`). Download them beforehand, on a networked machine,
# for the device's Python (3.12 here):
#
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl \
#       bitsandbytes==0.50.2 hqq==0.2.8.post1 fire==0.7.1 datasets==5.2.0 wandb==0.31.0
#
# (versions as in constraints-cpu.txt). A pure-Python package that publishes only a source archive can be turned
# into a wheel the same way with `pip wheel --no-deps -w .whl NAME==VERSION`.
set -euo pipefail

if [[ $# -lt 1 || $1 == -* ]]; then
    echo "usage: bash benchmarks/gpu.sh OUT_DIR [--dry-run] [benchmarks/run.py flags]" >&2
    exit 2
fi
OUT=$1
shift
DRY_RUN=0
for arg in "$@"; do
    [[ $arg == --dry-run ]] && DRY_RUN=1
done

cd "$(dirname "$0")/.."
if [[ -n ${PYTHON:-} ]]; then
    PY=$PYTHON
elif [[ $DRY_RUN == 1 && -x .venv/bin/python ]]; then
    PY=.venv/bin/python  # the CPU install of scripts/install_cpu.sh
else
    PY=python3
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

shopt -s nullglob
WHEELS=(.whl/*.whl)
if ((${#WHEELS[@]})); then
    if [[ $DRY_RUN == 1 ]]; then
        # Check that the wheels would install, without changing this (CPU) environment.
        "$PY" -m pip install --dry-run --quiet --no-deps --no-index "${WHEELS[@]}"
    else
        "$PY" -m pip install --quiet --no-deps --no-index "${WHEELS[@]}"
    fi
    echo "wheels: ${WHEELS[*]}"
fi

if [[ $DRY_RUN == 0 ]]; then
    "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "no CUDA GPU visible; use --dry-run")'
fi
# The Python side keeps to its own budget (--budget_s, default 480 s); this is the hard stop behind it.
exec timeout --kill-after=10 540 "$PY" benchmarks/run.py --suite gpu --out "$OUT" "$@"
