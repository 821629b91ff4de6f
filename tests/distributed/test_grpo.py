"""GRPO through the real CLI on CPU ranks: N ranks x batch B against 1 rank x batch N*B (each completion is drawn
with its own seed, so it is the same whichever rank samples it), exact resume with dropout, TRL's metrics,
completions.jsonl, and the parameter bytes of an SFT run with the same flags."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from qlora_fsdp.objectives.grpo import COMPLETIONS_FILE
from qlora_fsdp.train.metrics import read_metrics
from tests.conftest import DATASET, REPO_ROOT, launch, stopped_at, train

pytestmark = pytest.mark.distributed

PROMPTS = REPO_ROOT / "data" / "grpo_tiny.jsonl"
REWARDS = REPO_ROOT / "tests" / "grpo_rewards.py"
COMMON = [
    "--dataset", str(PROMPTS), "--objective", "grpo", "--num_generations", "2", "--max_completion_length", "8",
    "--precision", "fp32", "--context_length", "96", "--lr", "0.01", "--lora_rank", "8", "--lora_alpha", "16",
    "--device", "cpu", "--log_to", "stdout", "--seed", "7",
    "--reward_funcs", f"{REWARDS}:token_sum,{REWARDS}:topic_length", "--reward_weights", "1,0.5",
]  # fmt: skip
METRICS = ("reward", "reward_std", "rewards/token_sum/mean", "rewards/token_sum/std", "rewards/topic_length/mean",
           "rewards/topic_length/std", "completions/mean_length", "completions/clipped_ratio", "frac_reward_zero_std",
           "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
           "clip_ratio/high_max", "entropy")  # fmt: skip


def _run(model: Path, out: Path, *flags: str, nproc: int) -> list[dict]:
    train(["--model", str(model), *COMMON, "--output_dir", str(out), *flags], nproc=nproc, timeout=600)
    return [r for r in read_metrics(out) if "loss" in r]


def _same(a: dict, b: dict, keys: tuple[str, ...], rel: float) -> None:
    """Equal within `rel`, or NaN in both (a function that scored no completion of the step has no mean)."""
    for key in keys:
        same = (math.isnan(a[key]) and math.isnan(b[key])) or math.isclose(a[key], b[key], rel_tol=rel, abs_tol=1e-7)
        assert same, (a["step"], key, a[key], b[key])


@pytest.mark.parametrize(("loss_type", "generation_mode", "iterations"), [("grpo", "sharded", 1),
                                                                          ("dapo", "gathered", 2)])  # fmt: skip
def test_ranks_times_batch_is_one_rank_with_the_whole_batch(tiny_model: Path, tmp_path: Path, loss_type: str,
                                                            generation_mode: str, iterations: int) -> None:  # fmt: skip
    """2 ranks x batch 2 equal 1 rank x batch 4 step by step, sampling included (bnb, FSDP2, --beta 0.04: the
    reference forward too), the 2 ranks sampling through the sharded model or with its weights gathered (the same
    completions either way). With --num_iterations 2, step 2 trains step 1's completions again (the same rewards,
    nothing sampled), against the log-probs they were sampled under, and step 3 samples anew. No dropout: its masks
    are drawn per rank."""
    flags = ("--quant", "bnb", "--max_steps", "3", "--lora_dropout", "0", "--beta", "0.04", "--loss_type", loss_type,
             "--num_iterations", str(iterations))  # fmt: skip
    one = _run(tiny_model, tmp_path / "one", *flags, "--batch_size", "4", nproc=1)
    two = _run(tiny_model, tmp_path / "two", *flags, "--batch_size", "2", "--generation_mode", generation_mode,
               nproc=2)  # fmt: skip
    sampled = [r for r in one + two if (r["step"] - 1) % iterations == 0]
    assert all(r["sampling/tokens_per_s"] > 0 for r in sampled)
    assert all("sampling/tokens_per_s" not in r for r in one + two if r not in sampled)
    if iterations == 2:
        _same(one[1], one[0], METRICS[:9], 0.0)  # the rewards and completions of step 1
        assert one[2]["reward"] != one[0]["reward"]
        # Step 1's ratio is 1 (its own log-probs, nothing clips); step 2 compares the moved policy with the log-probs
        # the completions were sampled under (measured: 0.72 of its tokens clip; none would against its own).
        assert one[0]["clip_ratio/region_mean"] == 0 < one[1]["clip_ratio/region_mean"]
    for a, b in zip(one, two, strict=True):
        _same(a, b, ("loss", "kl", *METRICS), 1e-5)
        _same(a, b, ("grad_norm",), 1e-4)
    assert one[0]["kl"] == 0.0 and all(r["grad_norm"] > 0 for r in one)  # step 1: the policy is the reference
    assert one[-1]["kl"] > 0
    assert one[0]["reward_std"] > 0 and one[0]["frac_reward_zero_std"] < 1  # the rewards vary: advantages are not 0


def test_resume_completions_log_and_parameter_bytes(tiny_model: Path, tmp_path: Path) -> None:
    """HQQ with FSDP1, dropout on, --num_iterations 3: steps 3-4 after a resume from step 2 equal the uninterrupted
    run's (step 3 reuses step 1's generation, which the checkpoint holds; step 4 samples anew, its seeds from the
    step); resumed on another world size between the steps of a generation, the run stops with one line;
    completions.jsonl holds a group per micro-batch of each generation with its prompt and rewards (None where a
    function did not score), the resumed file the uninterrupted one's; the parameter bytes per rank are an SFT
    run's."""
    flags = ("--quant", "hqq", "--fsdp_version", "1", "--batch_size", "2", "--lora_dropout", "0.1", "--max_steps",
             "4", "--save_steps", "2", "--gradient_accumulation_steps", "2", "--num_iterations", "3")  # fmt: skip
    whole = _run(tiny_model, tmp_path / "whole", *flags, nproc=2)
    out = tmp_path / "parts"
    stopped_at(tmp_path / "whole", out, step=2, metrics=True)
    # The interrupted run's lines, steps past the checkpoint included: the resumed run replaces those.
    lines = (tmp_path / "whole" / COMPLETIONS_FILE).read_text().splitlines()
    (out / COMPLETIONS_FILE).write_text("".join(line + "\n" for line in lines))
    resumed = _run(tiny_model, out, *flags, "--resume_from", "auto", nproc=2)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(resumed[2:], whole[2:], strict=True):
        _same(a, b, ("loss", "grad_norm", *METRICS), 1e-6)
    _same(whole[2], whole[0], METRICS[:9], 0.0)  # step 3 trained step 1's completions
    elsewhere = launch(REPO_ROOT / "train.py", ["--model", str(tiny_model), *COMMON, "--output_dir", str(out), *flags,
                                                "--resume_from", str(out / "checkpoint-2")], nproc=0)  # fmt: skip
    errors = [line for line in elsewhere.stderr.splitlines() if line.startswith("error:")]
    assert elsewhere.returncode == 2 and len(errors) == 1, elsewhere.stderr[-3000:]
    assert "step 2 falls between the --num_iterations 3 steps that reuse one generation" in errors[0]
    records = [json.loads(line) for line in lines]
    assert len(records) == 2 * 2 * 2  # generations (steps 1 and 4) x micro-batches x a group of 2
    assert [r["step"] for r in records] == [1, 1, 1, 1, 4, 4, 4, 4] and records[0]["prompt"] == records[1]["prompt"]
    assert set(records[0]["rewards"]) == {"token_sum", "topic_length"}
    assert any(r["rewards"]["topic_length"] is None for r in records)
    assert (out / COMPLETIONS_FILE).read_text() == (tmp_path / "whole" / COMPLETIONS_FILE).read_text()
    sft = tmp_path / "sft"
    train(["--model", str(tiny_model), "--dataset", str(DATASET), *COMMON[COMMON.index("--precision"):-4],
           *flags[:6], "--max_steps", "1", "--output_dir", str(sft)], nproc=2)  # fmt: skip
    assert whole[0]["param_bytes_per_rank"] == read_metrics(sft)[0]["param_bytes_per_rank"]


@pytest.mark.parametrize("case", ["full", "mixtral"])
def test_full_fine_tuning_and_a_mixture_of_experts_sample_and_train(tiny_model: Path, moe_models: dict[str, Path],
                                                                    tmp_path: Path, case: str) -> None:  # fmt: skip
    """As for DPO: --train_type full --quant none trains every weight with --beta 0 (no reference; FSDP1, whose flat
    parameters hide the trained head: its per-token losses take whole logits); a Mixtral samples through its
    quantized experts (bnb, FSDP2, weights gathered) and trains against the reference."""
    model, flags = {
        "full": (tiny_model, ("--quant", "none", "--train_type", "full", "--fsdp_version", "1", "--lr", "1e-3")),
        "mixtral": (moe_models["mixtral"], ("--quant", "bnb", "--generation_mode", "gathered", "--beta", "0.04")),
    }[case]  # fmt: skip
    records = _run(model, tmp_path / case, "--batch_size", "4", "--max_steps", "2", *flags, nproc=2)
    assert len(records) == 2
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["entropy"] > 0 for r in records)
    assert records[0]["reward_std"] > 0  # the completions differ, so advantages are not all 0
