"""The generation suite (--suite cpu-generation) run for real in its quick mode: every figure present and positive,
ratio = gathered / sharded from the same repetition, both modes sampling the same completions; and its check that
they did, which fails on a step where they did not. No timing thresholds."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.generation_suite import FIGURES, MODES, SAME, check_same

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.distributed
@pytest.mark.benchmark
def test_generation_suite_quick(tmp_path: Path) -> None:
    out = tmp_path / "results"
    cmd = [sys.executable, "benchmarks/run.py", "--suite", "cpu-generation", "--quick", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline"}
    proc = subprocess.run([*cmd, "--cache", str(tmp_path / "cache")], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=600, check=False)  # fmt: skip
    assert proc.returncode == 0, f"exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"

    results = json.loads((out / "results.json").read_text())
    assert results["suite"] == "cpu-generation" and results["quick"] is True
    rows = {r["key"]: r for r in results["rows"]}
    assert set(rows) == {key for key, *_ in FIGURES}
    summaries = results["details"]["summaries"]
    for key, r in rows.items():
        assert r["runs"]["ours"] == [s[key] for s in summaries["gathered"]], key
        assert r["runs"]["peer"] == [s[key] for s in summaries["sharded"]], key
        assert math.isclose(r["ratio"], r["ours"] / r["peer"], rel_tol=1e-9), key
        assert all(v > 0 and math.isfinite(v) for v in (r["ours"], r["peer"], r["ratio"])), key
    steps = results["details"]["steps"]
    settings = results["settings"]
    for mode in MODES:
        (run,) = steps[mode]
        assert [x["step"] for x in run] == list(range(1, settings["steps"] + 1))
        assert all(x["completions/mean_length"] > 0 for x in run)
    assert "--generation_mode gathered" in (out / "results.md").read_text()


def test_the_suite_refuses_modes_that_sampled_differently() -> None:
    step = {"step": 1, "reward": 0.5, "completions/mean_length": 8.0, "entropy": 6.2, "loss": 0.25}
    runs = {"sharded": [{"steps": [step]}], "gathered": [{"steps": [dict(step)]}]}
    check_same(runs)
    for key in SAME:
        other = copy.deepcopy(runs)
        other["gathered"][0]["steps"][0][key] += 1e-3
        with pytest.raises(RuntimeError, match=key):
            check_same(other)
