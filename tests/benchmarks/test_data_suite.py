"""The data suite (--suite cpu-data) run for real in its quick mode, plus its parts that launch nothing heavy: the
synthetic dataset, the time-to-first-step wrapper and the parsing of the cache's log line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.data_suite import FIELD_TOKENS, cache_line, ensure_dataset, plan
from tests.benchmarks.suites import REPO_ROOT, env, positive, run_suite

KEYS = {
    "build_wall_s", "build_s", "time_to_first_step_s", "tokens_per_s", "packing_efficiency",
    *(f"train_peak_rss_rank{r}_bytes" for r in (0, 1)), *(f"train_peak_rss_growth_rank{r}_mb" for r in (0, 1)),
}  # fmt: skip
SIGNED = ("train_peak_rss_growth_rank0_mb", "train_peak_rss_growth_rank1_mb")
"""Differences of two peaks: noise can make them zero or negative."""


@pytest.mark.distributed
@pytest.mark.benchmark
def test_data_suite_quick(tmp_path: Path, tiny_model: Path) -> None:
    results, report = run_suite(tmp_path, "cpu-data", "--model", str(tiny_model))
    rows = {r["key"]: r for r in results["rows"]}
    assert set(rows) == KEYS
    for key, r in rows.items():
        assert r["runs"]["ours"] and r["runs"]["peer"], key
        if key not in SIGNED:
            positive({k: r[k] for k in ("ours", "peer", "ratio", "runs")}, key)

    details = results["details"]
    # 1. Each build ran with the processes asked for, into a directory of its own, and built (not reused).
    for procs, (build,) in details["builds"].items():
        assert build["built"] and build["processes"] == int(procs) and build["wall_s"] > build["build_s"] > 0
        assert f"--dataset_num_proc {procs}" in build["command"]
    assert len({b[0]["path"] for b in details["builds"].values()}) == 2
    # 2. The first run built the cache the second reused; the first record came before the process exited.
    (first,), (cached,) = details["first_step"]["first"], details["first_step"]["cached"]
    assert (
        first["cache"]["built"] and not cached["cache"]["built"] and first["cache"]["path"] == cached["cache"]["path"]
    )
    for run in (first, cached):
        assert 0 < run["first_step_s"] < run["exit_s"] and run["first_step_s"] > run["steps"][0]["elapsed_s"]
    # 3. Both slices of the file trained from caches built beforehand, every rank's peak recorded.
    large, small = results["settings"]["rss_rows"]
    runs = details["training_runs"]
    assert runs["large"][0]["cache"]["examples"] == large and runs["small"][0]["cache"]["examples"] == small
    assert all(len(p) == 2 and min(p) > 0 for n in details["memory"]["peaks"].values() for p in n)
    # 4. The same rows at every step; padding to the context fills rows of exactly 2 ranks x batch x context.
    assert details["padding"]["same_rows_per_step"]
    p = results["settings"]
    for step in runs["pad_to_context"][0]["steps"]:
        assert step["packing_efficiency"] == pytest.approx(step["tokens"] / (2 * p["batch_size"] * 1024))
    assert rows["packing_efficiency"]["ours"] > rows["packing_efficiency"]["peer"]

    tokens = details["dataset"]["field_tokens_first_2000"]
    assert FIELD_TOKENS[0] - 5 <= tokens["min"] and tokens["max"] <= FIELD_TOKENS[1] + 10
    assert [c["unit"] for c in results["checks"]] == ["x", "MB", "MB"]
    assert all(isinstance(c["passed"], bool) for c in results["checks"])
    launches = results["conditions"]["launches"]
    assert len(launches) == 8 and all(e["foreign_cores"] >= 0 for e in launches)

    for heading in ("### Dataset", "### Acceptance bars", "### Launches"):
        assert heading in report


def test_synthetic_dataset_is_deterministic(tiny_model: Path, tmp_path: Path) -> None:
    """The same plan writes the same bytes; rows are alpaca rows whose fields hold ~20-400 tokens."""
    small = plan(quick=True, rows=300, threads=1, reps=None, idle_wait_s=None, precision="fp32")
    paths = [ensure_dataset(small, tiny_model, tmp_path / name) for name in ("a", "b")]
    (a, info), (b, _) = paths
    assert a.read_bytes() == b.read_bytes() and info["rows"] == 300
    rows = [json.loads(line) for line in a.read_text().splitlines()]
    assert len(rows) == 300 and all(set(r) == {"instruction", "input", "output"} and r["output"] for r in rows)
    assert 0.3 < sum(bool(r["input"]) for r in rows) / len(rows) < 0.7
    tokens = info["field_tokens_first_2000"]
    assert FIELD_TOKENS[0] - 5 <= tokens["min"] < 60 and 340 < tokens["max"] <= FIELD_TOKENS[1] + 10


@pytest.mark.distributed
def test_first_step_wrapper_times_the_first_record(tmp_path: Path) -> None:
    """The wrapper reports when the first line appeared (not when the command ended) and passes its status on."""
    metrics, result = tmp_path / "metrics.jsonl", tmp_path / "timing.json"
    code = (
        f"import time, pathlib; p = pathlib.Path({str(metrics)!r}); p.write_text(''); time.sleep(0.6); "
        "p.write_text('{}\\n'); time.sleep(0.8); raise SystemExit(3)"
    )
    cmd = [sys.executable, "-m", "benchmarks.data_suite", "first-step", str(result), str(metrics), "--"]
    proc = subprocess.run([*cmd, sys.executable, "-c", code], cwd=REPO_ROOT, env=env(), timeout=60, check=False)
    timing = json.loads(result.read_text())
    assert proc.returncode == 3
    assert 0.6 <= timing["first_step_s"] < timing["exit_s"] - 0.5, timing


def test_cache_line() -> None:
    built = (
        "INFO qlora_fsdp.data.loader: dataset d.jsonl: tokenized cache built in 30.9 s with 2 process(es) at "
        "/tmp/c/6fa5: 20000 examples (d.jsonl: 20000), 19990 samples, 5014525 tokens, 38.8 MiB"
    )
    assert cache_line(built) == {"built": True, "path": "/tmp/c/6fa5", "build_s": 30.9, "processes": 2,
                                  "examples": 20000, "samples": 19990, "tokens": 5014525, "mib": 38.8}  # fmt: skip
    reused = "tokenized cache reused at /tmp/c/6fa5: 20 examples (d.jsonl: 20), 20 samples, 5014 tokens, 0.1 MiB"
    assert cache_line(reused)["built"] is False and cache_line("no such line") is None
