"""Run a script exactly as `python SCRIPT ARGS` would, then record this process's peak RSS (VmHWM).

`python -m benchmarks.cli_probe train.py --flags` (or the same under `torchrun -m`) is our real CLI; the probe
only adds one file per rank, `$BENCH_PEAK_RSS_FILE.rankR`, because the CLI's own peak_memory_bytes comes from
ru_maxrss, which on Linux also counts the launcher's (the harness's or torchrun's) high-water mark.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from benchmarks.common import peak_rss_bytes


def main() -> None:
    script, args = sys.argv[1], sys.argv[2:]
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        out = os.environ.get("BENCH_PEAK_RSS_FILE")
        if out:
            Path(f"{out}.rank{os.environ.get('RANK', '0')}").write_text(str(peak_rss_bytes()))


if __name__ == "__main__":
    main()
