#!/usr/bin/env bash
# GPU suite: bash benchmarks/gpu.sh OUT_DIR [--dry-run] [--only NAME,...] [more benchmarks/run.py flags]
#
# At most 9 minutes wall, items in priority order (benchmarks/README.md, "GPU suite"); --dry-run: on the CPU, tiny
# shapes. .whl/ (benchmarks/gpu_wheels.sh) goes into a private directory first on PYTHONPATH, never into the Python
# environment. PYTHON picks the interpreter (default: .venv/bin/python for --dry-run if present, else python3).
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
PY=${PYTHON:-python3}
if [[ -z ${PYTHON:-} && $DRY_RUN == 1 && -x .venv/bin/python ]]; then
    PY=.venv/bin/python  # the CPU install of scripts/install_cpu.sh
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

((DRY_RUN)) ||
    "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "no CUDA GPU visible; use --dry-run")'
# The hard stop behind the Python side's own budget (--budget_s: 500 s, dry run 1100 s), inside the 9 minutes; its
# exit status is the script's (set -e), and the trap still removes $SITE.
timeout --kill-after=10 $((DRY_RUN ? 1150 : 525)) "$PY" benchmarks/run.py --suite gpu --out "$OUT" "$@"
