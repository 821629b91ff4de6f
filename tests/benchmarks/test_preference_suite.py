"""The preference suite (--suite cpu-preference) run for real in its quick mode, and its data builder: every figure
present, ratio = ours / SFT's, parameter bytes identical, the same tokens at every step; no timing thresholds."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from benchmarks.preference_suite import OBJECTIVES, PEAKS, plan, write_datasets
from tests.benchmarks.suites import run_suite

FIGURES = ("param_bytes_per_rank", "rss_peak_growth_bytes", "tensor_peak_bytes", "peak_rss_bytes", "step_time_s")


@pytest.mark.distributed
@pytest.mark.benchmark
def test_preference_suite_quick(tmp_path: Path) -> None:
    results, report = run_suite(tmp_path, "cpu-preference")
    rows = {r["key"]: r for r in results["rows"]}
    assert set(rows) == {f"{f}_dpo" for f in FIGURES}
    for key, r in rows.items():
        assert r["better"] == "lower" and len(r["runs"]["ours"]) == len(r["runs"]["peer"]) == 1, key
        assert all(v > 0 and math.isfinite(v) for v in (r["ours"], r["peer"], r["ratio"])), key

    # The first bar holds exactly: a preference run holds the same parameters as SFT, rank by rank.
    assert rows["param_bytes_per_rank_dpo"]["ratio"] == 1.0
    (acceptance,) = results["details"]["acceptance"]
    assert acceptance["objective"] == "dpo" and acceptance["param_bytes_identical"] is True
    assert set(acceptance["peak_ratio"]) == set(PEAKS) and acceptance["peak_bar"] == 1.15
    assert isinstance(acceptance["passed"], bool)

    s = results["settings"]
    runs = results["details"]["runs"]
    assert set(runs) == {"sft", "dpo"}
    (sft,), (dpo,) = runs["sft"], runs["dpo"]
    assert (sft["batch_size"], dpo["batch_size"]) == (2 * s["pairs_per_rank"], s["pairs_per_rank"])
    assert sft["ranks"][0]["baseline_rss_bytes"] > 0
    # The same tokens at every step, none of them padding: 2 ranks x 2B sequences of sequence_tokens.
    tokens = s["nproc"] * 2 * s["pairs_per_rank"] * s["sequence_tokens"]
    for run in (sft, dpo):
        assert [x["tokens"] for x in run["steps"]] == [tokens] * s["steps"]
        assert [x["packing_efficiency"] for x in run["steps"]] == [1.0] * s["steps"]
        assert len(run["ranks"]) == s["nproc"]
        for rank in run["ranks"]:
            # The probe reset the high-water mark before step 1 and after every step; the profiler saw step S.
            assert rank["reset"] and len(rank["steps"]) == s["steps"] and rank["baseline_rss_bytes"] > 0
            assert rank["tensor_peak_bytes"] > 0 and rank["memory_events"] > 0
            assert all(x["peak_rss_bytes"] >= x["rss_after_bytes"] > 0 for x in rank["steps"])
        # metrics.jsonl's peak_memory_bytes_per_rank is the probe's per-step peak of each rank.
        for rank in run["ranks"]:
            probed = [x["peak_rss_bytes"] for x in rank["steps"]]
            assert [x["peak_memory_bytes_per_rank"][rank["rank"]] for x in run["steps"]] == probed
    assert [x["label_tokens"] for x in sft["steps"]] == [x["label_tokens"] for x in dpo["steps"]]
    assert "rewards/accuracies" in dpo["steps"][0] and "rewards/accuracies" not in sft["steps"][0]

    for heading in ("### DPO", "### Acceptance", "### Data and measures", "### Launches"):
        assert heading in report


def test_datasets_train_the_same_sequences(tiny_model: Path, tmp_path: Path) -> None:
    """Through the trainer's own encoding, every pair's sides and the SFT rows are the same sequences, each of
    sequence_tokens, with the reply and its EOS labelled; the files are deterministic."""
    from qlora_fsdp.data.formats import encode_examples, load_examples, pair_example
    from qlora_fsdp.model.hub import load_tokenizer

    p = dataclasses.replace(plan(quick=True, threads=1, reps=None, idle_wait_s=None, precision="fp32"), steps=4)
    info = write_datasets(p, tiny_model, tmp_path / "a")
    assert write_datasets(p, tiny_model, tmp_path / "b")["pairs"] == info["pairs"] == p.pairs
    for name in ("pairs.jsonl", "sft.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()

    tokenizer = load_tokenizer(tiny_model)
    lines = (tmp_path / "a" / "pairs.jsonl").read_text().splitlines()
    pairs = [pair_example(json.loads(line), "pairs", prompt_style="alpaca") for line in lines]
    sides = encode_examples([e for pair in pairs for e in (pair.chosen, pair.rejected)], tokenizer,
                            train_on_inputs=False)  # fmt: skip
    sft = encode_examples(load_examples(str(tmp_path / "a" / "sft.jsonl")), tokenizer, train_on_inputs=False)
    assert sft == sides and len(sides) == 2 * p.pairs
    for ids, labels in sides:
        assert len(ids) == p.sequence_tokens and sum(x != -100 for x in labels) == p.reply_tokens + 1
    assert all(pair.defect() is None for pair in pairs)


def test_plan_checks() -> None:
    """--objectives picks the compared objectives (default all four); unpadded sequences and 3 steps are needed."""
    full = plan(quick=False, threads=2, reps=None, idle_wait_s=None, precision="fp32")
    assert full.objectives == OBJECTIVES and full.sequence_tokens % 8 == 0 and full.steps >= 3
    picked = plan(quick=True, threads=2, reps=None, idle_wait_s=None, objectives=("simpo", "dpo", "simpo"))
    assert picked.objectives == ("simpo", "dpo")
    with pytest.raises(ValueError, match="--objectives"):
        plan(quick=True, threads=2, reps=None, idle_wait_s=None, objectives=("kto",))
    with pytest.raises(ValueError, match="multiple of 8"):
        dataclasses.replace(full, reply_tokens=full.reply_tokens + 1).check()
    with pytest.raises(ValueError, match=">= 3"):
        dataclasses.replace(full, steps=2).check()
