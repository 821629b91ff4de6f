"""The preference objectives through the real CLI on CPU ranks: the fresh adapter's first loss, N ranks x batch B
against 1 rank x batch N*B, exact resume, evaluation on held-out pairs, and the parameter bytes of an SFT run.

Each objective runs under another mix of quantization, FSDP version and training type, so together they cover
bnb and HQQ, FSDP1 and FSDP2, LoRA and DoRA, gradient accumulation and checkpointing (on by default)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from qlora_fsdp.train.metrics import read_metrics
from tests.conftest import DATASET, REPO_ROOT, stopped_at, train

pytestmark = pytest.mark.distributed

PAIRS = REPO_ROOT / "data" / "preference_tiny.jsonl"
COMMON = [
    "--precision", "fp32", "--context_length", "96", "--lr", "0.01", "--lora_rank", "8", "--lora_alpha", "16",
    "--lr_scheduler", "constant", "--device", "cpu", "--log_to", "stdout", "--seed", "7",
]  # fmt: skip
CASES = {
    "dpo": ("--quant", "bnb", "--fsdp_version", "2"),
    "ipo": ("--quant", "hqq", "--fsdp_version", "1"),
    "orpo": ("--quant", "bnb", "--fsdp_version", "1", "--train_type", "dora"),
    "simpo": ("--quant", "hqq", "--fsdp_version", "2", "--beta", "2.0", "--simpo_gamma", "1.0"),
}
# The first loss of a fresh adapter at the default beta of 0.1.
FRESH_LOSS = {"dpo": math.log(2), "ipo": (1 / (2 * 0.1)) ** 2}
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")  # fmt: skip


def _run(model: Path, out: Path, objective: str, *flags: str, nproc: int) -> list[dict]:
    args = ["--model", str(model), *COMMON, "--dataset", str(PAIRS), "--objective", objective, *CASES[objective]]
    train([*args, "--output_dir", str(out), *flags], nproc=nproc, timeout=600)
    return [r for r in read_metrics(out) if "loss" in r]


@pytest.mark.parametrize("objective", list(CASES))
def test_ranks_times_batch_is_one_rank_with_the_whole_batch(tiny_model: Path, tmp_path: Path, objective: str) -> None:
    """2 ranks x batch 2 (SimPO: batch 1 x 2 accumulated micro-batches) equal 1 rank x batch 4 step by step: the
    loss is a sum over pairs divided by the step's pairs over every rank (ORPO's cross-entropy by its tokens).
    No dropout: its masks are drawn per rank.

    Step 1 is the fresh adapter's (LoRA B = 0: the policy is the reference), so DPO's first loss is ln 2 with zero
    rewards, and IPO's (1 / (2 beta))^2."""
    split = ("--batch_size", "1", "--gradient_accumulation_steps", "2") if objective == "simpo" else ("--batch_size",
                                                                                                     "2")  # fmt: skip
    flags = ("--max_steps", "3", "--lora_dropout", "0")
    one = _run(tiny_model, tmp_path / "one", objective, "--batch_size", "4", *flags, nproc=1)
    two = _run(tiny_model, tmp_path / "two", objective, *split, *flags, nproc=2)
    for a, b in zip(one, two, strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4), (a["step"], a["grad_norm"], b["grad_norm"])
        for key in METRICS:
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-6), (a["step"], key, a[key], b[key])
    assert one[-1]["loss"] < one[0]["loss"]
    if objective in FRESH_LOSS:
        for first in (one[0], two[0]):
            assert math.isclose(first["loss"], FRESH_LOSS[objective], rel_tol=1e-6, abs_tol=1e-7), first["loss"]
            assert first["rewards/chosen"] == first["rewards/rejected"] == first["rewards/margins"] == 0.0


@pytest.mark.parametrize("objective", list(CASES))
def test_resume_is_exact(tiny_model: Path, tmp_path: Path, objective: str) -> None:
    """Steps 3-4 after a resume from step 2 equal the uninterrupted run's (dropout on: the RNG state matters)."""
    flags = ("--batch_size", "2", "--save_steps", "2")
    whole = _run(tiny_model, tmp_path / "whole", objective, *flags, "--max_steps", "4", nproc=2)
    out = tmp_path / "parts"
    stopped_at(tmp_path / "whole", out, step=2)
    resumed = _run(tiny_model, out, objective, *flags, "--max_steps", "4", "--resume_from", "auto", nproc=2)
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(resumed, whole[2:], strict=True):
        for key in ("loss", "grad_norm", *METRICS):
            assert math.isclose(a[key], b[key], rel_tol=1e-6, abs_tol=1e-9), (a["step"], key, a[key], b[key])


def test_evaluation_on_held_out_pairs_and_sft_parameter_bytes(tiny_model: Path, tmp_path: Path) -> None:
    """--eval_split holds pairs out: evaluation reports eval_loss and the reward metrics under eval_ names, and a
    DPO run keeps exactly the parameter bytes per rank of an SFT run with the same flags."""
    flags = ("--batch_size", "2", "--max_steps", "4", "--eval_split", "0.05", "--eval_steps", "2")
    _run(tiny_model, tmp_path / "dpo", "dpo", *flags, nproc=2)
    records = read_metrics(tmp_path / "dpo")
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert evals[0]["eval_pairs"] == 20 and all(f"eval_{key}" in evals[0] for key in METRICS)
    assert evals[-1]["eval_loss"] < math.log(2) and evals[-1]["eval_rewards/accuracies"] > 0.5
    sft = tmp_path / "sft"
    train(["--model", str(tiny_model), *COMMON, *CASES["dpo"], "--dataset", str(DATASET), "--batch_size", "2",
           "--max_steps", "1", "--output_dir", str(sft)], nproc=2)  # fmt: skip
    dpo_bytes = next(r for r in records if "loss" in r)["param_bytes_per_rank"]
    assert dpo_bytes == read_metrics(sft)[0]["param_bytes_per_rank"]


def test_precomputed_reference_trains_as_the_reference_forward(tiny_model: Path, tmp_path: Path) -> None:
    """--precompute_reference gives the steps (and the evaluations, whose held-out pairs are not in the table) that
    the per-step reference forward gives (both are the model with its adapters off), and a resume reads the table
    back instead of computing it again."""
    flags = ("--batch_size", "2", "--save_steps", "2", "--eval_split", "0.05", "--eval_steps", "2")
    online = _run(tiny_model, tmp_path / "online", "dpo", *flags, "--max_steps", "4", nproc=2)
    out = tmp_path / "table"
    first = train(["--model", str(tiny_model), *COMMON, "--dataset", str(PAIRS), "--objective", "dpo",
                   *CASES["dpo"], *flags, "--max_steps", "2", "--precompute_reference", "true", "--output_dir",
                   str(out)], nproc=2)  # fmt: skip
    assert "reference log-probs of 380 pairs computed in" in first.stdout
    again = train(["--model", str(tiny_model), *COMMON, "--dataset", str(PAIRS), "--objective", "dpo",
                   *CASES["dpo"], *flags, "--max_steps", "4", "--precompute_reference", "true", "--output_dir",
                   str(out), "--resume_from", "auto"], nproc=2)  # fmt: skip
    assert "reference log-probs of 380 pairs read back from" in again.stdout
    records = read_metrics(out)
    for a, b in zip([r for r in records if "loss" in r], online, strict=True):
        for key in ("loss", "grad_norm", "rewards/margins"):
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-7), (a["step"], key, a[key], b[key])
    online_evals = [r for r in read_metrics(tmp_path / "online") if "eval_loss" in r]
    table_evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in table_evals] == [2, 4]
    for a, b in zip(table_evals, online_evals, strict=True):
        for key in ("eval_loss", "eval_rewards/margins", "eval_rewards/chosen"):
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-7), (a["step"], key, a[key], b[key])


@pytest.mark.parametrize("objective", ["orpo", "simpo"])
def test_reference_free_objectives_train_every_weight(tiny_model: Path, tmp_path: Path, objective: str) -> None:
    """ORPO and SimPO need no reference, so --train_type full trains with them, FSDP1 included (whose flat
    parameters hide the trained head's own: its per-token losses take whole logits)."""
    args = ["--model", str(tiny_model), *COMMON, "--dataset", str(PAIRS), "--objective", objective, "--quant", "none",
            "--train_type", "full", "--fsdp_version", "1" if objective == "orpo" else "2", "--batch_size", "2",
            "--max_steps", "3", "--lr", "1e-3", "--output_dir", str(tmp_path / "out")]  # fmt: skip
    train(args, nproc=2)
    records = [r for r in read_metrics(tmp_path / "out") if "loss" in r]
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in records)
    assert records[-1]["loss"] < records[0]["loss"]
