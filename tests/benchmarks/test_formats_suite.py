"""The checkpoint-formats suite (--suite cpu-formats) run for real in its quick mode: every figure of both sections
present and positive, ratio = the format's / bf16's from the same repetitions, every format loading into the same
resident bytes; and that check, which fails when one did not. No timing thresholds."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.formats_suite import FIGURES, check_same_model

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.distributed
@pytest.mark.benchmark
def test_formats_suite_quick(tmp_path: Path) -> None:
    out = tmp_path / "results"
    cmd = [sys.executable, "benchmarks/run.py", "--suite", "cpu-formats", "--quick", "--out", str(out),
           "--cache", str(tmp_path / "cache")]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"

    results = json.loads((out / "results.json").read_text())
    assert results["suite"] == "cpu-formats" and results["quick"] is True
    rows = {r["key"]: r for r in results["rows"]}
    sums = results["details"]["summaries"]
    for fmt in ("bnb-4bit", "fp8"):
        for key, *_ in FIGURES:
            r = rows[f"{key}_{fmt.replace('-', '_')}"]
            assert r["runs"]["ours"] == [s[key] for s in sums[fmt]], key
            assert r["runs"]["peer"] == [s[key] for s in sums["bf16"]], key
            assert r["ours"] > 0 and r["peer"] > 0 and math.isclose(r["ratio"], r["ours"] / r["peer"], rel_tol=1e-9)
    # The files people download are smaller than the bf16 release, and each rank reads less of them.
    assert rows["checkpoint_bytes_bnb_4bit"]["ratio"] < 0.5 and rows["read_bytes_bnb_4bit"]["ratio"] < 1
    assert "### pre-quantized bnb 4-bit" in (out / "results.md").read_text()


def test_formats_must_load_into_the_same_model() -> None:
    same = {"bf16": [{"resident_bytes": 10.0}], "fp8": [{"resident_bytes": 10.0}]}
    check_same_model(same)
    with pytest.raises(RuntimeError, match="different resident bytes"):
        check_same_model({**same, "bnb-4bit": [{"resident_bytes": 11.0}]})
