"""The long-context suite (--suite cpu-long-context) run for real in its quick mode, and its plan and search: every
figure present, ratio = ours / S=1 untiled's, every run trained rows that fill its context; no memory thresholds (the
quick model is too small for the issue's bars, which the full suite reports)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from benchmarks.long_context_suite import (
    LONGEST_BAR,
    SP_PEAK_BAR,
    TILED_PEAK_BAR,
    grid_runs,
    longest_context,
    plan,
    tiles,
    write_rows,
)
from tests.benchmarks.suites import run_suite

FIGURES = ("tensor_peak_bytes", "rss_peak_growth_bytes", "tokens_per_s")


@pytest.mark.distributed
@pytest.mark.benchmark
def test_long_context_suite_quick(tmp_path: Path) -> None:
    results, report = run_suite(tmp_path, "cpu-long-context")
    s = results["settings"]
    (context,) = s["contexts"]
    tiled = tiles(plan(quick=True, threads=2, reps=None, idle_wait_s=None), context, 1)
    # The quick grid: S=2 and S=1 tiled beside S=1 untiled at one context, then the three acceptance rows.
    grid = {f"{f}_{context}_{v}" for f in FIGURES for v in ("s2", "s1_tiled")}
    rows = {r["key"]: r for r in results["rows"]}
    assert set(rows) == grid | {"accept_sp_peak", "accept_tiled_peak", "accept_longest"}
    for key, r in rows.items():
        assert len(r["runs"]["ours"]) == len(r["runs"]["peer"]) == 1, key
        assert all(v > 0 and math.isfinite(v) for v in (r["ours"], r["peer"], r["ratio"])), key

    # Every acceptance row stands beside S=1 untiled from the same run, with the bar.
    summaries = results["details"]["summaries"]
    base = summaries[f"{context}/1/0"][0]["tensor_peak_bytes"]
    assert rows["accept_sp_peak"]["peer"] == rows["accept_tiled_peak"]["peer"] == base
    assert rows["accept_sp_peak"]["ours"] == summaries[f"{context}/2/0"][0]["tensor_peak_bytes"]
    assert rows["accept_tiled_peak"]["ours"] == summaries[f"{context}/1/{tiled}"][0]["tensor_peak_bytes"]
    bars = {a["name"]: (a["bar"], a["passed"]) for a in results["details"]["acceptance"]}
    assert {k: b for k, (b, _) in bars.items()} == {"sp_peak": SP_PEAK_BAR, "tiled_peak": TILED_PEAK_BAR,
                                                   "longest": LONGEST_BAR}  # fmt: skip
    assert all(isinstance(passed, bool) for _, passed in bars.values())

    # The longest-context search: the budget is S=1's peak at the base context plus the margin, and each answer is
    # a candidate whose measured peak fits while the next measured one (if any) does not.
    search = results["details"]["search"]
    assert set(search) == {"1", "2"} and results["details"]["budget_bytes"] > summaries[f"{s['base_context']}/1/0"][0][
        "tensor_peak_bytes"]  # fmt: skip
    for size, found in search.items():
        peaks = {int(c): b for c, b in found["peaks"].items()}
        assert found["longest"] in s["candidates"] and peaks[found["longest"]] <= results["details"]["budget_bytes"]
        assert all(b > results["details"]["budget_bytes"] for c, b in peaks.items() if c > found["longest"]), size
    assert rows["accept_longest"]["ours"] == search["2"]["longest"]
    assert rows["accept_longest"]["peer"] == search["1"]["longest"]

    # Every run trained one row of exactly its context on each of its S ranks, which all measured every step.
    for key, runs in results["details"]["runs"].items():
        ctx, size, _ = map(int, key.split("/"))
        for run in runs:
            assert [x["tokens"] for x in run["steps"]] == [ctx] * s["steps"], key
            assert len(run["ranks"]) == size, key
            for rank in run["ranks"]:
                assert rank["reset"] and len(rank["steps"]) == s["steps"] and rank["baseline_rss_bytes"] > 0
                assert rank["tensor_peak_bytes"] > 0 and rank["memory_events"] > 0

    for heading in (f"### {context} tokens", "### the issue's ratios", "### Every run", "### Longest context",
                    "### Against the issue's bars", "### Launches"):  # fmt: skip
        assert heading in report


def test_plan_checks() -> None:
    """The full plan is the issue's grid; contexts that would be padded or split unevenly, a plan without the S=1
    baseline, a single step and heads that do not split are refused."""
    full = plan(quick=False, threads=2, reps=None, idle_wait_s=None, precision="fp32")
    assert full.contexts == (4096, 8192, 16384) and full.sizes == full.tiled_sizes == (1, 2, 4)
    assert len(grid_runs(full)) == 18 and (16384, 1, 16) in grid_runs(full) and (4096, 4, 2) in grid_runs(full)
    assert full.candidates()[0] == full.base_context and full.candidates()[-1] == full.contexts[-1]
    quick = plan(quick=True, threads=2, reps=3, idle_wait_s=None)
    assert quick.reps == 3 and quick.base_context in quick.candidates()
    for bad, match in (
        (dict(contexts=(4096, 8196)), "not multiples of 32"),
        (dict(search_step=500), "not multiples of 32"),
        (dict(steps=1), ">= 2"),
        (dict(sizes=(2, 4), tiled_sizes=(2,)), "need S = 1"),
        (dict(contexts=(8192, 4096)), "ascend"),
        (dict(model={**full.model, "num_heads": 12, "num_kv_heads": 3}), "do not split"),
    ):
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(full, **bad).check()


def test_tiles_follow_auto_with_a_floor() -> None:
    """A tile per hidden-size tokens of the rank's slice (--tiled_mlp auto's rule), never fewer than 2."""
    p = plan(quick=False, threads=2, reps=None, idle_wait_s=None)  # hidden 1024
    assert [tiles(p, 16384, s) for s in (1, 2, 4)] == [16, 8, 4]
    assert [tiles(p, 4096, s) for s in (1, 2, 4)] == [4, 2, 2]  # auto would give 1 tile at S=4


def test_longest_context_search() -> None:
    """Known answers are reused, launches go up from the longest known fit (stride doubling, then bisection), and
    the answer is the longest candidate under the limit."""
    candidates = list(range(512, 4097, 128))
    for limit in (512, 700, 1024, 1100, 2000, 4096):
        launched: list[int] = []

        def fits(context: int, limit: int = limit, launched: list[int] = launched) -> bool:
            launched.append(context)
            return context <= limit

        known = {512: True, 4096: limit >= 4096}
        expected = max(c for c in candidates if c <= limit)
        assert longest_context(candidates, known, fits) == expected, limit
        assert len(launched) == len(set(launched)) <= 2 * math.ceil(math.log2(len(candidates))), (limit, launched)
        assert all(known[c] == (c <= limit) for c in launched)
    # An answer next to a known fit costs one launch; nothing fitting gives None.
    tried: list[int] = []
    assert longest_context([512, 576, 640], {512: True}, lambda c: tried.append(c) or False) == 512 and tried == [576]
    assert longest_context([512, 576], {}, lambda c: False) is None


def test_rows_fill_every_context(tmp_path: Path) -> None:
    """One row a step, each with more words (so more tokens) than the largest context; the same file every time."""
    p = plan(quick=False, threads=2, reps=None, idle_wait_s=None)
    a, b = write_rows(p, tmp_path / "a"), write_rows(p, tmp_path / "b")
    assert a.read_bytes() == b.read_bytes()
    rows = [json.loads(line) for line in a.read_text().splitlines()]
    assert len(rows) == p.steps and all(len(r["text"].split()) > p.contexts[-1] for r in rows)
