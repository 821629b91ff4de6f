"""The generation suite (--suite cpu-generation) run for real in its quick mode: every figure present and positive,
ratio = gathered / sharded from the same repetition, both modes sampling the same completions; and its check that
they did, which fails on a step where they did not. No timing thresholds."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest

from benchmarks.generation_suite import FIGURES, MODES, SAME, check_same
from tests.benchmarks.suites import run_suite


@pytest.mark.distributed
@pytest.mark.benchmark
def test_generation_suite_quick(tmp_path: Path) -> None:
    results, report = run_suite(tmp_path, "cpu-generation")
    rows = {r["key"]: r for r in results["rows"]}
    assert set(rows) == {key for key, *_ in FIGURES}
    summaries = results["details"]["summaries"]
    for key, r in rows.items():
        assert r["runs"]["ours"] == [s[key] for s in summaries["gathered"]], key
        assert r["runs"]["peer"] == [s[key] for s in summaries["sharded"]], key
        assert all(v > 0 and math.isfinite(v) for v in (r["ours"], r["peer"], r["ratio"])), key
    steps = results["details"]["steps"]
    settings = results["settings"]
    for mode in MODES:
        (run,) = steps[mode]
        assert [x["step"] for x in run] == list(range(1, settings["steps"] + 1))
        assert all(x["completions/mean_length"] > 0 for x in run)
    assert "--generation_mode gathered" in report


def test_the_suite_refuses_modes_that_sampled_differently() -> None:
    step = {"step": 1, "reward": 0.5, "completions/mean_length": 8.0, "entropy": 6.2, "loss": 0.25}
    runs = {"sharded": [{"steps": [step]}], "gathered": [{"steps": [dict(step)]}]}
    check_same(runs)
    for key in SAME:
        other = copy.deepcopy(runs)
        other["gathered"][0]["steps"][0][key] += 1e-3
        with pytest.raises(RuntimeError, match=key):
            check_same(other)
