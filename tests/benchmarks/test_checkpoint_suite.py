"""The checkpoint suite (--suite cpu-checkpoint) run for real in its quick mode, and its log parsing and stall
arithmetic on made-up runs: every figure present, ratio = async / sync, the same checkpoint on both sides; no
timing thresholds."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from benchmarks.checkpoint_suite import CASES, STALL_BAR, analyse, parse_saves, plan
from tests.benchmarks.suites import run_suite

FIGURES = ("stall_logged_s", "stall_steps_s", "write_s", "step_s", "peak_rss_bytes", "rss_rise_bytes",
           "checkpoint_bytes")  # fmt: skip


@pytest.mark.distributed
@pytest.mark.benchmark
def test_checkpoint_suite_quick(tmp_path: Path) -> None:
    results, report = run_suite(tmp_path, "cpu-checkpoint")
    rows = {r["key"]: r for r in results["rows"]}
    assert set(rows) == {f"{f}_{c}" for f in FIGURES for c in CASES}
    for key, r in rows.items():
        assert r["better"] == "lower" and len(r["runs"]["ours"]) == len(r["runs"]["peer"]) == 1, key
        # An async save may print 0.00 s; every synchronous figure is a real cost.
        assert r["peer"] > 0 and r["ours"] >= 0 and math.isfinite(r["ratio"]), key

    s = results["settings"]
    assert s["saves"] == [2, 4, 6] and s["nproc"] == 2
    for case in CASES:
        # The same state on both sides: the same tensors bit for bit; the files around them (DCP's metadata, the
        # per-rank pickles, trainer_state.json) name the run's own paths and flags, a few bytes apart.
        assert abs(rows[f"checkpoint_bytes_{case}"]["ratio"] - 1.0) < 1e-3
        (compared,) = results["details"]["compared"][case]
        assert compared["identical"] and compared["tensors"] > 0 and compared["tensor_bytes"] > 0
        sides = results["details"]["summaries"][case]
        for side in ("sync", "async"):
            (summary,) = sides[side]
            assert [x["step"] for x in summary["saves"]] == s["saves"]
            assert all("steps_stall_s" in x for x in summary["saves"] if x["step"] < s["steps"])
            assert summary["peak_rss_bytes"] >= summary["rss_rise_bytes"] > 0
        # The async side printed when training went on and later when the checkpoint was complete.
        assert all("goes_on_s" in x for x in sides["async"][0]["saves"])
        assert not any("goes_on_s" in x for x in sides["sync"][0]["saves"])
    full, lora = (results["models"][c]["parameters"] for c in CASES)
    trainable = {c: results["details"]["summaries"][c]["sync"][0]["trainable_parameters"] for c in CASES}
    assert trainable["full"] == full and 0 < trainable["lora"] < lora

    acceptance = {a["case"]: a for a in results["details"]["acceptance"]}
    assert set(acceptance) == set(CASES) and acceptance["full"]["stall_bar"] == STALL_BAR
    assert acceptance["lora"]["stall_bar"] is None
    assert all(isinstance(a["passed"], bool) and a["checkpoints_identical"] for a in acceptance.values())

    for heading in ("### full", "### lora", "### Acceptance", "### Saves", "### Launches"):
        assert heading in report


SYNC_LOG = """\
trainable parameters: 10
step 1 loss 6.2 lr 1.0e-05 tokens/s 100
step 2 loss 6.1 lr 1.0e-05 tokens/s 100
checkpoint saved to /o/checkpoint-2 in 3.00s
step 3 loss 6.0 lr 1.0e-05 tokens/s 100
step 4 loss 5.9 lr 1.0e-05 tokens/s 100
checkpoint saved to /o/checkpoint-4 in 5.00s
step 5 loss 5.8 lr 1.0e-05 tokens/s 100
"""
ASYNC_LOG = """\
step 1 loss 6.2 lr 1.0e-05 tokens/s 100
step 2 loss 6.1 lr 1.0e-05 tokens/s 100
checkpoint /o/checkpoint-2: training goes on after 0.50s, the rest is written in the background
step 3 loss 6.0 lr 1.0e-05 tokens/s 100
checkpoint saved to /o/checkpoint-2 in 9.00s
step 4 loss 5.9 lr 1.0e-05 tokens/s 100
checkpoint /o/checkpoint-4: training goes on after 0.70s, the rest is written in the background
step 5 loss 5.8 lr 1.0e-05 tokens/s 100
checkpoint saved to /o/checkpoint-4 in 8.00s
"""


def _run(log: str, *, async_save: bool, seconds: list[float], between: list[float]) -> dict:
    """A made-up run: step k takes seconds[k-1] (100 tokens), between[b-1] passes after step b."""
    elapsed, records = 0.0, []
    for step, own in enumerate(seconds, start=1):
        elapsed += own
        records.append({"step": step, "tokens": 100, "tokens_per_s": 100 / own, "elapsed_s": elapsed,
                        "trainable_parameters": 10})  # fmt: skip
        elapsed += between[step - 1] if step <= len(between) else 0.0
    ranks = [{"rank": r, "baseline_rss_bytes": 100, "steps": [{"peak_rss_bytes": 150 + r}] * len(seconds)}
             for r in range(2)]  # fmt: skip
    return {"async_save": async_save, "metrics": records, "ranks": ranks, "checkpoint": {"bytes": 7},
            "saves": parse_saves(log, async_save=async_save, expected=[2, 4])}  # fmt: skip


@pytest.mark.distributed
def test_stalls_from_the_log_and_the_step_times() -> None:
    """The logged stall is the save's own line; the step-time stall is the time between two steps at the save's
    boundary (and where an async save was marked complete) less the quiet boundaries' median, whatever each step's
    own time."""
    sync = analyse(_run(SYNC_LOG, async_save=False, seconds=[9, 4, 7, 5, 6], between=[0.1, 3.1, 0.1, 5.1]), 5)
    assert [x["logged_stall_s"] for x in sync["saves"]] == [3.0, 5.0] and sync["stall_logged_s"] == 4.0
    assert [x["completed_after_step"] for x in sync["saves"]] == [2, 4]
    assert [round(x["steps_stall_s"], 9) for x in sync["saves"]] == [3.0, 5.0]
    assert math.isclose(sync["between_steps_quiet_s"], 0.1) and math.isclose(sync["step_s"], 5.5)
    assert sync["steps_writing"] == [] and sync["step_s_writing"] is None
    assert (sync["peak_rss_bytes"], sync["rss_rise_bytes"], sync["checkpoint_bytes"]) == (151, 51, 7)

    # Async: checkpoint-2 is marked complete after step 3 (0.4 s more than a quiet boundary), checkpoint-4 after
    # the last step (training is over: not a stall). Steps 3 and 5 ran beside a background write.
    run = _run(ASYNC_LOG, async_save=True, seconds=[9, 4, 8, 5, 8], between=[0.1, 0.6, 0.5, 0.8])
    asyn = analyse(run, 5)
    assert [x["logged_stall_s"] for x in asyn["saves"]] == [0.5, 0.7] and asyn["write_s"] == 8.5
    assert [round(x["steps_stall_s"], 9) for x in asyn["saves"]] == [0.9, 0.7]
    assert asyn["steps_writing"] == [3, 5] and (asyn["step_s_writing"], asyn["step_s_quiet"]) == (8.0, 4.5)


def test_parse_refuses_missing_lines() -> None:
    with pytest.raises(RuntimeError, match="expected"):
        parse_saves(SYNC_LOG, async_save=False, expected=[2, 4, 6])
    with pytest.raises(RuntimeError, match="incomplete"):
        parse_saves(SYNC_LOG, async_save=True, expected=[2, 4])
    with pytest.raises(RuntimeError, match="incomplete"):
        parse_saves(ASYNC_LOG, async_save=False, expected=[2, 4])


def test_plan_checks() -> None:
    full = plan(quick=False, threads=2, reps=None, idle_wait_s=None, precision="bf16")
    assert full.saves == [2, 4, 6] and full.timed_saves == [2, 4] and full.full_model["num_layers"] == 8
    assert plan(quick=False, threads=2, reps=None, idle_wait_s=None, precision="fp32").full_model["num_layers"] == 4
    with pytest.raises(ValueError, match=">= 2"):
        dataclasses.replace(full, save_steps=1).check()
    with pytest.raises(ValueError, match="no save before the last step"):
        dataclasses.replace(full, steps=2).check()
