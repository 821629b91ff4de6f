"""What the benchmark tests share: benchmarks/run.py run as a user runs it, and the checks every suite's rows get."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import THREADS

REPO_ROOT = Path(__file__).resolve().parents[2]
ROW_FIELDS = ("section", "key", "figure", "unit", "better", "ours", "peer", "ratio", "runs")


def env() -> dict[str, str]:
    """This environment with the repository importable, tokenizers on one thread and wandb offline."""
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline"}


def run(cmd: list[str], *, timeout: float, environ: dict[str, str] | None = None) -> None:
    """`cmd` from the repository root; its output's tail in the failure when it exits non-zero."""
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=environ or env(), capture_output=True, text=True, timeout=timeout,
                          check=False)  # fmt: skip
    output = f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\n{output}"


def run_suite(tmp_path: Path, suite: str, *options: str, timeout: float = 600) -> tuple[dict[str, Any], str]:
    """`benchmarks/run.py --suite SUITE --quick OPTIONS` on this test process's threads, its model cache and output
    under `tmp_path`: results.json and results.md, once checked for what every suite's hold (the suite, unique row
    keys, every row field, ratio = ours / peer, every figure in the report)."""
    out = tmp_path / "results"
    cmd = [sys.executable, "benchmarks/run.py", "--suite", suite, "--quick", "--threads", str(THREADS), *options]
    run([*cmd, "--out", str(out), "--cache", str(tmp_path / "cache")], timeout=timeout)
    results, report = json.loads((out / "results.json").read_text()), (out / "results.md").read_text()
    assert results["suite"] == suite and results["quick"] is True
    keys = [r["key"] for r in results["rows"]]
    assert len(keys) == len(set(keys)), f"duplicate row keys: {keys}"
    for r in results["rows"]:
        assert all(name in r for name in ROW_FIELDS), r["key"]
        assert math.isclose(r["ratio"], r["ours"] / r["peer"], rel_tol=1e-9), r["key"]
        assert r["figure"] in report, r["key"]
    return results, report


def positive(obj: Any, where: str, *, may_be_zero: tuple[str, ...] = ()) -> None:
    """Every number below `obj` is finite and > 0 (booleans and strings are not figures), except under `may_be_zero`
    keys of its top dicts."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k not in may_be_zero:
                positive(v, f"{where}.{k}", may_be_zero=may_be_zero)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            positive(v, f"{where}[{i}]")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        assert obj > 0 and math.isfinite(obj), f"{where} = {obj}"
