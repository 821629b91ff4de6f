#!/usr/bin/env bash
# Prints a Python 3.12 interpreter, the GPU machine's version: PYTHON312 if set, python3.12 on PATH where it runs,
# else pyenv's. Exits 1 with a one-line error if there is none.
set -euo pipefail
for candidate in "${PYTHON312:-}" python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python; do
    if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
        command -v "$candidate"
        exit 0
    fi
done
echo "no Python 3.12 found: put python3.12 on PATH or name it with PYTHON312=..." >&2
exit 1
