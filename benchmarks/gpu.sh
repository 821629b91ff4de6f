#!/usr/bin/env bash
# GPU suite: bash benchmarks/gpu.sh OUT_DIR [--dry-run] [--only NAME,...] [more benchmarks/run.py flags]
#
# One run of at most 9 minutes wall, in priority order, OUT_DIR/results.json and results.md written again after
# every item (a run stopped at any point keeps what it measured):
#   tests         the GPU test tier, pytest -m gpu (tests/gpu; at most 2 minutes)
#   bnb           our default (bnb, FSDP2) against the HF + PEFT + bitsandbytes loop at batch 8 x 2048
#   hqq           --quant hqq            compile       --compile true
#   whole-logits  --loss_chunk_tokens 0  fsdp1         --fsdp_version 1
#   bnb-1x512     the default at batch 1 x 512
# on a random Llama-2-7B-shaped model written to local disk (never downloaded): tokens/s, peak allocated and reserved
# CUDA memory while training and while loading (peaks reset once the model is built, on both sides), loading time,
# MFU. `--only hqq,fsdp1` runs those items alone (a second run for what the first had no time for; results.md
# names them). Every failed item's cause (its last error line) is in results.md.
# --dry-run runs the same code on the CPU with tiny shapes and a few steps (what the test suite checks).
#
# The GPU machine has no network and lacks bitsandbytes, hqq, termcolor and pytest; build what it needs beforehand,
# on a networked machine:
#
#   bash benchmarks/gpu_wheels.sh      # writes .whl/ (ignored by git): carry it with the device tool's `carry`
#
# The wheels are installed into a private directory put first on PYTHONPATH, never into the Python environment,
# with --dry-run too, so a dry run with PYTHON=a venv holding only that machine's packages (torch 2.11,
# transformers 5.17, accelerate, peft, safetensors, tokenizers, pyyaml, tqdm, numpy) runs what will run there.
# PYTHON picks the interpreter (default: .venv/bin/python for --dry-run if present, else python3).
set -euo pipefail

if [[ $# -lt 1 || $1 == -* ]]; then
    echo "usage: bash benchmarks/gpu.sh OUT_DIR [--dry-run] [--only NAME,...] [benchmarks/run.py flags]" >&2
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

SITE=$(mktemp -d "${TMPDIR:-/tmp}/qlora-fsdp-gpu-site.XXXXXX")
trap 'rm -rf "$SITE"' EXIT
shopt -s nullglob
WHEELS=(.whl/*.whl)
if ((${#WHEELS[@]})); then
    "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
        --target "$SITE" "${WHEELS[@]}"
    echo "wheels installed into $SITE: ${WHEELS[*]#.whl/}"
else
    echo "no .whl/ (bash benchmarks/gpu_wheels.sh builds it): using what $PY has installed"
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [[ $DRY_RUN == 0 ]]; then
    "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "no CUDA GPU visible; use --dry-run")'
fi
# The Python side keeps to its own budget (--budget_s, default 500 s; dry run 1100 s) and kills a job that outlasts
# it; this is the hard stop behind it, inside the 9 minutes with the install above.
LIMIT_S=$((DRY_RUN ? 1150 : 525))
status=0
timeout --kill-after=10 "$LIMIT_S" "$PY" benchmarks/run.py --suite gpu --out "$OUT" "$@" || status=$?
exit $status
