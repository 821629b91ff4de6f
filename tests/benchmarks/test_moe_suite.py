"""The MoE suite (--suite cpu-moe) run for real in its quick mode: every figure present and positive, ratio =
ours / peer, the byte counts consistent with one another; no timing thresholds."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.moe_suite import QUICK_MOE, dense_sizes, plan

REPO_ROOT = Path(__file__).resolve().parents[2]
ROW_FIELDS = ("section", "key", "figure", "unit", "better", "ours", "peer", "ratio", "runs")
QUANTS, WORLD = ("bnb", "hqq"), (1, 2)  # --quick: both backends at 1 and 2 ranks
KEYS = {
    *(f"{k}_{q}_n{n}" for k in ("resident_bytes_per_rank", "base_bytes_per_rank") for q in QUANTS for n in WORLD),
    "step_time_s",
    "train_peak_rss_bytes",
}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline"}


def _positive(obj: Any, where: str) -> None:
    """Every number below `obj` is finite and > 0 (booleans are not figures)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            _positive(v, f"{where}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _positive(v, f"{where}[{i}]")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        assert obj > 0 and math.isfinite(obj), f"{where} = {obj}"


@pytest.mark.distributed
@pytest.mark.benchmark
def test_moe_suite_quick(tmp_path: Path) -> None:
    out = tmp_path / "results"
    # bf16 named, not left to the CPU's choice (fp32 where it has no native bf16): the byte counts below assume it.
    cmd = [sys.executable, "benchmarks/run.py", "--suite", "cpu-moe", "--quick", "--precision", "bf16"]
    cmd += ["--out", str(out)]
    proc = subprocess.run([*cmd, "--cache", str(tmp_path / "cache")], cwd=REPO_ROOT, env=_env(), capture_output=True,
                          text=True, timeout=600, check=False)  # fmt: skip
    assert proc.returncode == 0, f"exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"

    results = json.loads((out / "results.json").read_text())
    assert results["suite"] == "cpu-moe" and results["quick"] is True
    rows = {r["key"]: r for r in results["rows"]}
    assert len(rows) == len(results["rows"]) and set(rows) == KEYS
    for key, r in rows.items():
        assert all(name in r for name in ROW_FIELDS), key
        assert r["better"] == "lower" and r["runs"]["ours"] and r["runs"]["peer"], key
        assert math.isclose(r["ratio"], r["ours"] / r["peer"], rel_tol=1e-9), key
        _positive({k: r[k] for k in ("ours", "peer", "ratio", "runs")}, key)
    assert results["wall_time_s"] > 0

    # The pair: an MoE whose dense twin has its active parameters (up to the routers) and the same tokenizer.
    moe, dense = results["models"]["moe"], results["models"]["dense"]
    assert moe["architecture"] == "MixtralForCausalLM" and dense["architecture"] == "LlamaForCausalLM"
    assert moe["dtypes_on_disk"] == ["BF16"] and moe["sizes"]["num_local_experts"] == QUICK_MOE["experts"]
    assert dense["sizes"]["intermediate_size"] == dense_sizes(QUICK_MOE, 512)["intermediate_size"]
    routers = QUICK_MOE["layers"] * QUICK_MOE["experts"] * QUICK_MOE["hidden"]
    assert moe["active_parameters"] - dense["parameters"] == routers
    assert moe["parameters"] > moe["active_parameters"] > 0

    details = results["details"]
    peer = details["peer"]
    # HF's 4-bit load leaves the fused experts in 16-bit: they are most of what it holds.
    assert peer["fused_expert_tensors"] == 2 * QUICK_MOE["layers"] and peer["fused_expert_dtypes"] == ["bfloat16"]
    assert peer["fused_expert_bytes"] == moe["expert_bytes_on_disk"] and peer["linear4bit_layers"] > 0
    assert rows["resident_bytes_per_rank_bnb_n1"]["peer"] == peer["model_bytes"]["total"]
    for quant in QUANTS:
        by_n = details["memory"][quant]
        assert set(by_n) == {str(n) for n in WORLD}
        for n, run in by_n.items():
            # Every rank holds the same bytes, the log's line says what metrics.jsonl says, every step was taken.
            assert len(set(run["param_bytes_per_rank"])) == 1 and len(run["param_bytes_per_rank"]) == int(n)
            assert run["printed_param_bytes_per_rank"] in (None, run["param_bytes_per_rank"])
            assert len(run["steps"]) == results["settings"]["memory_steps"]
            assert 0 < run["adapter_bytes"] < max(run["param_bytes_per_rank"]) * int(n)
        # Sharding divides what a rank holds, up to a few bytes of padding per tensor.
        assert by_n["2"]["sharding_efficiency"] == pytest.approx(1.0, abs=0.01)
        assert rows[f"base_bytes_per_rank_{quant}_n1"]["ours"] < rows[f"resident_bytes_per_rank_{quant}_n1"]["ours"]
    # Both models trained the same tokens at every step.
    step = details["step_time"]
    assert step["same_tokens_per_step"] and len(step["seconds"]["moe"]) == len(step["seconds"]["dense"]) == 1

    report = (out / "results.md").read_text()
    for r in results["rows"]:
        assert r["figure"] in report, r["key"]
    for heading in ("### Models", "### Where Hugging Face's bytes are", "### Launches"):
        assert heading in report


def test_plan_quants() -> None:
    """--quants picks the memory section's backends; the full suite's default is bnb alone."""
    assert plan(quick=False, threads=2, reps=None, idle_wait_s=None, precision="fp32").quants == ("bnb",)
    assert plan(quick=True, threads=2, reps=None, idle_wait_s=None, quants=("hqq",)).quants == ("hqq",)
    with pytest.raises(ValueError, match="--quants"):
        plan(quick=True, threads=2, reps=None, idle_wait_s=None, quants=("gptq",))
