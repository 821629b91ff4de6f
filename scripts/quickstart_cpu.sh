#!/usr/bin/env bash
# Install, build the tiny model, and QLoRA-train it on 2 CPU processes with the bundled data.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_cpu.sh
VENV=${VENV:-.venv}
OUT=${OUT:-output/quickstart}
"$VENV/bin/python" scripts/make_tiny_model.py --output "$OUT/tiny-model"
# One thread per rank: what torchrun picks itself when OMP_NUM_THREADS is unset, after a four-line warning.
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$VENV/bin/torchrun" --standalone --nproc_per_node=2 train.py \
    --config configs/tiny-cpu.yaml --model "$OUT/tiny-model" --output_dir "$OUT/adapter" --overwrite true
echo "adapter: $(cd "$OUT/adapter" && pwd)"
