"""An objective from one file of its own, trained through the real CLI on 2 ranks: the trainer reaches it only
through its spec and run hooks (tests/plugins/toy_objective.py; no other file names it)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from qlora_fsdp.train.metrics import read_metrics
from tests.conftest import DATASET, REPO_ROOT, train

pytestmark = pytest.mark.distributed

TOY = REPO_ROOT / "tests" / "plugins" / "toy_objective.py"
FLAGS = [
    "--dataset", str(DATASET), "--objective", f"{TOY}:TOY", "--quant", "bnb", "--precision", "fp32",
    "--context_length", "64", "--lr", "0.01", "--lora_dropout", "0", "--max_steps", "3", "--device", "cpu",
    "--log_to", "stdout", "--seed", "3",
]  # fmt: skip


def test_a_toy_objective_from_one_file_trains_on_two_ranks(tiny_model: Path, tmp_path: Path) -> None:
    """2 ranks x batch 2 equal 1 rank x batch 4, loss and grad_norm at every step: the toy's sums and weights go
    through the loop's cross-rank reduction as a built-in objective's do. Its own metric is logged, its evaluation
    counts rows (its spec's unit), and the adapter is saved."""
    runs = {}
    for nproc, batch in ((1, "4"), (2, "2")):
        out = tmp_path / f"ranks{nproc}"
        train(["--model", str(tiny_model), *FLAGS, "--batch_size", batch, "--eval_split", "0.02",
               "--output_dir", str(out)], nproc=nproc)  # fmt: skip
        runs[nproc] = read_metrics(out)
        assert (out / "adapter_model.safetensors").is_file()
    steps = {n: [r for r in records if "loss" in r] for n, records in runs.items()}
    assert len(steps[1]) == len(steps[2]) == 3
    for a, b in zip(steps[1], steps[2], strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4), (a["step"], a["grad_norm"], b["grad_norm"])
        assert a["tokens_per_row"] == pytest.approx(b["tokens_per_row"], rel=1e-9) and a["tokens_per_row"] > 1
    assert steps[1][-1]["loss"] < steps[1][0]["loss"]
    (evaluated,) = [r for r in runs[2] if "eval_loss" in r]
    assert evaluated["eval_rows"] > 0 and "eval_ppl" not in evaluated
