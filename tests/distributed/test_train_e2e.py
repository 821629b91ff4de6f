"""The core path end to end: torchrun, 2 CPU ranks, bnb and HQQ, down to an adapter PEFT loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qlora_fsdp.metrics import read_metrics
from tests.conftest import DATASET, train

pytestmark = pytest.mark.distributed

STEPS = 30
COMMON = [
    "--dataset", str(DATASET), "--precision", "fp32", "--context_length", "96", "--lr", "0.01",
    "--lora_rank", "16", "--lora_alpha", "32", "--lora_dropout", "0", "--lr_scheduler", "constant",
    "--device", "cpu", "--log_to", "stdout", "--seed", "7",
]  # fmt: skip


@pytest.fixture(scope="module", params=["bnb", "hqq"])
def two_rank_run(request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """30 steps on 2 ranks x batch 1 (global batch 2), the product's main path."""
    out = tmp_path_factory.mktemp(f"run-{request.param}")
    args = ["--model", str(tiny_model), "--quant", request.param, "--batch_size", "1", "--max_steps", str(STEPS)]
    result = train([*args, *COMMON, "--output_dir", str(out)], nproc=2)
    return request.param, out, result


def test_loss_falls(two_rank_run) -> None:
    _, out, _ = two_rank_run
    losses = [r["loss"] for r in read_metrics(out)]
    assert len(losses) == STEPS
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first, f"loss did not fall: first 5 mean {first:.4f}, last 5 mean {last:.4f}"


def test_metrics_records_have_required_fields(two_rank_run) -> None:
    _, out, _ = two_rank_run
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert r["tokens_per_s"] > 0 and r["lr"] > 0 and r["loss"] > 0
        assert len(r["peak_memory_bytes_per_rank"]) == 2 and min(r["peak_memory_bytes_per_rank"]) > 0
        assert r["peak_memory_bytes"] == r["peak_memory_bytes_per_rank"][0]


def test_adapter_loads_in_peft_without_key_mismatch(two_rank_run, tiny_model: Path) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    _, out, result = two_rank_run
    assert f"adapter saved to {out.resolve()}" in result.stdout + result.stderr
    saved = load_file(out / "adapter_model.safetensors")

    fresh = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), LoraConfig.from_pretrained(out))
    expected = set(get_peft_model_state_dict(fresh))
    assert set(saved) == expected, f"missing {expected - set(saved)}, unexpected {set(saved) - expected}"
    incompatible = set_peft_model_state_dict(fresh, saved)
    assert not incompatible.unexpected_keys
    assert not [k for k in incompatible.missing_keys if "lora_" in k]

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), out)
    state = get_peft_model_state_dict(loaded)
    for key, tensor in saved.items():
        assert torch.equal(state[key].to(tensor.dtype), tensor), key


def test_adapter_trained(two_rank_run) -> None:
    _, out, _ = two_rank_run
    saved = load_file(out / "adapter_model.safetensors")
    lora_b = [t for k, t in saved.items() if "lora_B" in k]
    assert lora_b and any(t.abs().sum() > 0 for t in lora_b), "every lora_B is still zero: nothing trained"
    # Every target of 'all' was adapted: 7 linears x 2 layers x (A, B).
    assert len(saved) == 7 * 2 * 2


def test_rank_equivalence(two_rank_run, tiny_model: Path, tmp_path: Path) -> None:
    """1 rank x batch 2 must reproduce the per-step losses of 2 ranks x batch 1 (same global batch and seed)."""
    quant, out, _ = two_rank_run
    args = [
        "--model",
        str(tiny_model),
        "--quant",
        quant,
        "--batch_size",
        "2",
        "--max_steps",
        "5",
        "--save_model",
        "false",
    ]
    train([*args, *COMMON, "--output_dir", str(tmp_path)], nproc=0)
    single = [r["loss"] for r in read_metrics(tmp_path)]
    sharded = [r["loss"] for r in read_metrics(out)][:5]
    assert single == pytest.approx(sharded, rel=1e-3), f"1x2 {single} vs 2x1 {sharded}"
    assert not (tmp_path / "adapter_model.safetensors").exists()
