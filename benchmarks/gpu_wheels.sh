#!/usr/bin/env bash
# Writes .whl/ (ignored by git): what benchmarks/gpu.sh needs on the lent GPU machine (Python 3.12, torch 2.11,
# transformers 5.17; no network; 64 MiB a call with the repository) beyond its image, at constraints-cpu.txt's
# versions: bitsandbytes, peft, hqq (a source archive, built here pure-Python with DISABLE_CUDA=1: its PyTorch backend),
# termcolor (hqq's), pytest, pluggy, iniconfig (the GPU tier). `bash benchmarks/gpu_wheels.sh`, with the network.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LIMIT_MIB=60
EXTRA=(termcolor==3.3.0 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1)  # not package dependencies: the CPU test venv's

pinned() {
    grep -x "$1==.*" constraints-cpu.txt || { echo "constraints-cpu.txt pins no $1" >&2; exit 1; }
}

rm -rf .whl  # pip makes it again
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform={manylinux_2_{39,35,34,31,28,27,24,17},manylinux2014,manylinux1}_x86_64 \
    -d .whl "$(pinned bitsandbytes)" "$(pinned peft)" "${EXTRA[@]}"
DISABLE_CUDA=1 "$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-cache-dir --no-binary hqq \
    -w .whl "$(pinned hqq)"

# A tracked file deleted from the working tree is not carried: stat skips it (its failure is not the script's).
repo=$(git ls-files -z --cached --others --exclude-standard | { xargs -0 stat -c %s 2>/dev/null || true; } |
    awk '{s += $1} END {print s / 1048576}')
find .whl -type f -name '*.whl' -printf '%s %f\n' | sort -rn | awk -v repo="$repo" -v limit="$LIMIT_MIB" '
    {wheels += $1 / 1048576}
    {printf "%8.1f MiB  %s\n", $1 / 1048576, $2}
    END {
        printf "wheels %.1f MiB + repository %.1f MiB = %.1f MiB (limit %d MiB)\n", wheels, repo, wheels + repo, limit
        exit wheels + repo > limit
    }' || { echo "over the ${LIMIT_MIB} MiB limit: a device call carries at most 64 MiB" >&2; exit 1; }
