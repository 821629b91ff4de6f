"""The trainer in this very process, as `python train.py` runs it with one rank: the code paths the 5-minute tier
would otherwise only reach through launched processes (FSDP1's units, the training loop, the objectives with a
precomputed reference) run and learn here, in seconds."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from safetensors.torch import load_file

from qlora_fsdp.config.options import build_config
from qlora_fsdp.train.metrics import read_metrics
from qlora_fsdp.train.trainer import run

REPO_ROOT = Path(__file__).resolve().parents[3]
BASE = {
    "precision": "fp32", "context_length": 64, "batch_size": 2, "max_steps": 3, "lr": 0.01, "lora_rank": 4,
    "lora_alpha": 8, "lora_dropout": 0.0, "device": "cpu", "log_to": "stdout", "seed": 3, "save_model": True,
}  # fmt: skip


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_fsdp1_trains_and_saves_in_one_process(no_launcher: None, tiny_model: Path, tmp_path: Path, quant: str) -> None:
    flags = {**BASE, "model": str(tiny_model), "quant": quant, "fsdp_version": 1, "output_dir": str(tmp_path),
             "dataset": str(REPO_ROOT / "data" / "alpaca_tiny.jsonl"), "dataset_samples": 6}  # fmt: skip
    result = run(build_config(flags).validate())
    losses = [r["loss"] for r in read_metrics(tmp_path)]
    assert losses == pytest.approx(result.losses) and len(losses) == 3 and all(map(math.isfinite, losses))
    assert losses[-1] < losses[0], "three steps on six rows at lr 0.01 did not lower the loss"
    assert any(v.abs().sum() > 0 for k, v in load_file(tmp_path / "adapter_model.safetensors").items() if "lora_B" in k)


def test_dpo_with_a_precomputed_reference_in_one_process(no_launcher: None, tiny_model: Path, tmp_path: Path) -> None:
    flags = {**BASE, "model": str(tiny_model), "quant": "bnb", "objective": "dpo", "precompute_reference": True,
             "dataset": str(REPO_ROOT / "data" / "preference_tiny.jsonl"), "dataset_samples": 6,
             "output_dir": str(tmp_path)}  # fmt: skip
    run(build_config(flags).validate())
    records = read_metrics(tmp_path)
    assert len(records) == 3
    # Step 1: the adapters are zero, so the policy is the reference: every reward is 0 and the loss is log 2.
    assert records[0]["loss"] == pytest.approx(math.log(2), rel=1e-5)
    assert records[-1]["loss"] < records[0]["loss"]
