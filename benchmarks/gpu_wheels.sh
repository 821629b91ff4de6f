#!/usr/bin/env bash
# Writes .whl/ (ignored by git): what benchmarks/gpu.sh needs on the lent GPU machine beyond its image.
#
#   bash benchmarks/gpu_wheels.sh        (no arguments, from the repository root; needs the network)
#
# That machine (Python 3.12, torch 2.11, transformers 5.17; no network) takes at most 64 MiB a call, the repository
# included, so only what the suite imports travels, at constraints-cpu.txt's versions: bitsandbytes, peft, hqq (a
# source archive only: built here pure-Python, DISABLE_CUDA=1, so it runs its PyTorch backend), termcolor (hqq's),
# and pytest, pluggy, iniconfig for the GPU test tier. Fails above 60 MiB with the repository.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LIMIT_MIB=60
# Not in constraints-cpu.txt (not dependencies of the package): the versions the CPU test venv runs.
EXTRA=(termcolor==3.3.0 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1)

pinned() {
    grep -x "$1==.*" constraints-cpu.txt || { echo "constraints-cpu.txt pins no $1" >&2; exit 1; }
}

rm -rf .whl
mkdir .whl
PLATFORMS=()
for n in 39 35 34 31 28 27 24 17; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d .whl "$(pinned bitsandbytes)" "$(pinned peft)" "${EXTRA[@]}"
DISABLE_CUDA=1 "$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-cache-dir --no-binary hqq \
    -w .whl "$(pinned hqq)"

wheels=$(stat -c %s .whl/*.whl | awk '{s += $1} END {print s}')
repo=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s}')
find .whl -type f -name '*.whl' -printf '%s %f\n' | sort -rn | awk '{printf "%8.1f MiB  %s\n", $1 / 1048576, $2}'
awk -v w="$wheels" -v r="$repo" -v limit="$LIMIT_MIB" 'BEGIN {
    total = (w + r) / 1048576
    printf "wheels %.1f MiB + repository %.1f MiB = %.1f MiB (limit %d MiB)\n", w / 1048576, r / 1048576, total, limit
    exit total > limit
}' || { echo "over the ${LIMIT_MIB} MiB limit: a device call carries at most 64 MiB" >&2; exit 1; }
