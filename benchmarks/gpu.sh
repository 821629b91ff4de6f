#!/usr/bin/env bash
# GPU suite: bash benchmarks/gpu.sh OUT_DIR [--dry-run] [--only NAME,...] [more benchmarks/run.py flags]
# At most 9 minutes wall, items in priority order (benchmarks/README.md, "GPU suite"); --dry-run: on the CPU, tiny
# shapes. .whl/ (benchmarks/gpu_wheels.sh) goes into a private directory first on PYTHONPATH, never into the Python
# environment. PYTHON picks the interpreter (default: .venv/bin/python for --dry-run if present, else python3).
set -euo pipefail
if [[ $# -lt 1 || $1 == -* ]]; then
    echo "usage: bash benchmarks/gpu.sh OUT_DIR [--dry-run] [--only NAME,...] [benchmarks/run.py flags]" >&2
    exit 2
fi
DRY_RUN=0
for arg in "${@:2}"; do
    [[ $arg == --dry-run ]] && DRY_RUN=1
done
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
((DRY_RUN)) && [[ -z ${PYTHON:-} && -x .venv/bin/python ]] && PY=.venv/bin/python  # scripts/install_cpu.sh

SITE=$(mktemp -d "${TMPDIR:-/tmp}/qlora-fsdp-gpu-site.XXXXXX")
trap 'rm -rf "$SITE"' EXIT
WHEELS=(.whl/*.whl)
if [[ -f ${WHEELS[0]} ]]; then
    "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
        --target "$SITE" "${WHEELS[@]}"
    echo "wheels installed into $SITE: ${WHEELS[*]#.whl/}"
else
    echo "no .whl/ (bash benchmarks/gpu_wheels.sh builds it): using what $PY has installed"
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"

((DRY_RUN)) ||
    "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "no CUDA GPU visible; use --dry-run")'
# A hard stop behind run.py's own --budget_s (500 s, dry run 1100 s): its exit status is the script's (set -e).
timeout --kill-after=10 $((DRY_RUN ? 1150 : 525)) "$PY" benchmarks/run.py --suite gpu --out "$1" "${@:2}"
