"""The MoE suite (--suite cpu-moe) run for real in its quick mode: every figure present and positive, ratio =
ours / peer, the byte counts consistent with one another; no timing thresholds."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.moe_suite import QUICK_MOE, dense_sizes, plan
from tests.benchmarks.suites import positive, run_suite

QUANTS, WORLD = ("bnb", "hqq"), (1, 2)  # --quick: both backends at 1 and 2 ranks
KEYS = {
    *(f"{k}_{q}_n{n}" for k in ("resident_bytes_per_rank", "base_bytes_per_rank") for q in QUANTS for n in WORLD),
    "step_time_s",
    "train_peak_rss_bytes",
}


@pytest.mark.distributed
@pytest.mark.benchmark
def test_moe_suite_quick(tmp_path: Path) -> None:
    # bf16 named, not left to the CPU's choice (fp32 where it has no native bf16): the byte counts below assume it.
    results, report = run_suite(tmp_path, "cpu-moe", "--precision", "bf16")
    rows = {r["key"]: r for r in results["rows"]}
    assert set(rows) == KEYS
    for key, r in rows.items():
        assert r["better"] == "lower" and r["runs"]["ours"] and r["runs"]["peer"], key
        positive({k: r[k] for k in ("ours", "peer", "ratio", "runs")}, key)
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

    for heading in ("### Models", "### Where Hugging Face's bytes are", "### Launches"):
        assert heading in report


def test_plan_quants() -> None:
    """--quants picks the memory section's backends; the full suite's default is bnb alone."""
    assert plan(quick=False, threads=2, reps=None, idle_wait_s=None, precision="fp32").quants == ("bnb",)
    assert plan(quick=True, threads=2, reps=None, idle_wait_s=None, quants=("hqq",)).quants == ("hqq",)
    with pytest.raises(ValueError, match="--quants"):
        plan(quick=True, threads=2, reps=None, idle_wait_s=None, quants=("gptq",))
