"""KTO through the real CLI on CPU ranks: the fresh adapter's first loss, N ranks x batch B against 1 rank x batch
N*B (training and evaluation), exact resume with dropout, the precomputed reference against the per-step one, and
the parameter bytes of an SFT run with the same flags."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from qlora_fsdp.objectives.reference import REFERENCE_FILE
from qlora_fsdp.train.metrics import read_metrics
from tests.conftest import DATASET, REPO_ROOT, stopped_at, train

pytestmark = pytest.mark.distributed

ROWS = REPO_ROOT / "data" / "kto_tiny.jsonl"
COMMON = [
    "--dataset", str(ROWS), "--objective", "kto", "--precision", "fp32", "--context_length", "96", "--lr", "0.01",
    "--lora_rank", "8", "--lora_alpha", "16", "--device", "cpu", "--log_to", "stdout", "--seed", "7",
]  # fmt: skip
METRICS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def _run(model: Path, out: Path, *flags: str, nproc: int) -> list[dict]:
    train(["--model", str(model), *COMMON, "--output_dir", str(out), *flags], nproc=nproc, timeout=600)
    return read_metrics(out)


def _same(a: dict, b: dict, keys: tuple[str, ...], rel: float) -> None:
    for key in keys:
        assert math.isclose(a[key], b[key], rel_tol=rel, abs_tol=1e-7), (a["step"], key, a[key], b[key])


def test_ranks_times_batch_is_one_rank_with_the_whole_batch(tiny_model: Path, tmp_path: Path) -> None:
    """2 ranks x batch 2 equal 1 rank x batch 4, steps and evaluation: the loss is a sum over rows divided by the
    step's rows over every rank, and the KL estimate a mean over the micro-batch's rows over every rank (a mean of
    each rank's own would differ). bnb with FSDP1; no dropout (its masks are drawn per rank).

    Step 1 is the fresh adapter's (the policy is the reference): every reward and the KL estimate are 0, and the loss
    1 - sigmoid(0) = 0.5 at unit weights."""
    flags = ("--quant", "bnb", "--fsdp_version", "1", "--max_steps", "3", "--lora_dropout", "0", "--eval_split",
             "0.05", "--eval_steps", "3")  # fmt: skip
    one = _run(tiny_model, tmp_path / "one", *flags, "--batch_size", "4", nproc=1)
    two = _run(tiny_model, tmp_path / "two", *flags, "--batch_size", "2", nproc=2)
    steps = [[r for r in run if "loss" in r] for run in (one, two)]
    for a, b in zip(*steps, strict=True):
        _same(a, b, ("loss", *METRICS), 1e-5)
        _same(a, b, ("grad_norm",), 1e-4)
    for first in (steps[0][0], steps[1][0]):
        assert math.isclose(first["loss"], 0.5, rel_tol=1e-6), first
        assert first["kl"] == first["rewards/chosen"] == first["rewards/rejected"] == 0.0
    assert steps[0][-1]["loss"] < 0.5 and steps[0][-1]["rewards/margins"] > 0
    assert steps[0][-1]["kl"] > 0  # the estimate moves once the policy does: a later step's loss depends on it
    (eval_one,), (eval_two,) = ([r for r in run if "eval_loss" in r] for run in (one, two))
    assert eval_one["eval_rows"] == eval_two["eval_rows"] == 40
    _same(eval_one, eval_two, ("eval_loss", *(f"eval_{k}" for k in METRICS)), 1e-5)


def test_resume_precomputed_reference_and_parameter_bytes(tiny_model: Path, tmp_path: Path) -> None:
    """HQQ with FSDP2, dropout on. With --precompute_reference, the steps equal those of the per-step reference
    forward (both are the model with its adapters off; a row's KL sequence is fixed, so the table holds its log-probs
    too); steps 3-4 after a resume from step 2, which reads the table back, equal the uninterrupted run's; and the
    run keeps exactly the parameter bytes per rank of an SFT run with the same flags (no second model)."""
    flags = ("--quant", "hqq", "--fsdp_version", "2", "--batch_size", "2", "--lora_dropout", "0.1", "--max_steps",
             "4", "--save_steps", "2")  # fmt: skip
    online = [r for r in _run(tiny_model, tmp_path / "online", *flags, nproc=2) if "loss" in r]
    whole = [r for r in _run(tiny_model, tmp_path / "whole", *flags, "--precompute_reference", "true", nproc=2)
             if "loss" in r]  # fmt: skip
    for a, b in zip(whole, online, strict=True):
        _same(a, b, ("loss", "grad_norm", "kl", "rewards/margins"), 1e-5)
    out = tmp_path / "parts"
    stopped_at(tmp_path / "whole", out, step=2)
    shutil.copy(tmp_path / "whole" / REFERENCE_FILE, out)  # written before the first step
    resumed = train(["--model", str(tiny_model), *COMMON, "--output_dir", str(out), *flags, "--precompute_reference",
                     "true", "--resume_from", "auto"], nproc=2)  # fmt: skip
    assert "reference log-probs of 800 rows read back from" in resumed.stdout
    after = [r for r in read_metrics(out) if "loss" in r]
    assert [r["step"] for r in after] == [3, 4]
    for a, b in zip(after, whole[2:], strict=True):
        _same(a, b, ("loss", "grad_norm", *METRICS), 1e-6)
    sft = tmp_path / "sft"
    train(["--model", str(tiny_model), *COMMON[4:], "--dataset", str(DATASET), *flags[:6], "--max_steps", "1",
           "--output_dir", str(sft)], nproc=2)  # fmt: skip
    assert whole[0]["param_bytes_per_rank"] == read_metrics(sft)[0]["param_bytes_per_rank"]
