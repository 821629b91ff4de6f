"""Mixture-of-experts models through the rest of training: exact resume under both FSDP versions, and packed chat
rows with evaluation and the router's load-balancing loss."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from qlora_fsdp.train.metrics import read_metrics
from tests.conftest import DATASET, stopped_at, train

pytestmark = pytest.mark.distributed

COMMON = [
    "--precision", "fp32", "--context_length", "96", "--lr", "0.01", "--lora_rank", "8", "--lora_alpha", "16",
    "--lr_scheduler", "constant", "--device", "cpu", "--log_to", "stdout", "--seed", "7", "--batch_size", "1",
]  # fmt: skip
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _run(model: Path, out: Path, *flags: str) -> list[dict]:
    train(["--model", str(model), *COMMON, "--output_dir", str(out), *flags], nproc=2, timeout=600)
    return read_metrics(out)


@pytest.mark.parametrize(
    ("family", "quant", "version"),
    [("mixtral", "bnb", 2), ("qwen2_moe", "hqq", 1)],
    ids=["mixtral-bnb-fsdp2", "qwen2moe-hqq-fsdp1"],
)
def test_resume_is_exact(moe_models: dict[str, Path], tmp_path: Path, family: str, quant: str, version: int) -> None:
    """Steps 4-6 after a resume from step 3 equal the uninterrupted run's: the expert adapters and their optimizer
    state are saved and restored with the rest (dropout on, so the RNG state matters too)."""
    flags = ("--dataset", str(DATASET), "--quant", quant, "--fsdp_version", str(version), "--save_steps", "3",
             "--router_aux_loss_coef", "0.01")  # fmt: skip
    whole = _run(moe_models[family], tmp_path / "whole", *flags, "--max_steps", "6")
    out = tmp_path / "parts"
    stopped_at(tmp_path / "whole", out, step=3)
    resumed = _run(moe_models[family], out, *flags, "--max_steps", "6", "--resume_from", "auto")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for a, b in zip(resumed, whole[3:], strict=True):
        for key in ("loss", "grad_norm", "aux_loss"):
            assert math.isclose(a[key], b[key], rel_tol=1e-6), (a["step"], key, a[key], b[key])


def test_packed_chat_rows_with_evaluation_and_router_loss(moe_models: dict[str, Path], tmp_path: Path) -> None:
    """Packed chat rows train Qwen3-MoE (bnb, FSDP2) with the load-balancing loss logged per step, expert loads
    that add up to top-k x tokens, and evaluation on held-out rows."""
    rows = [
        {"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                      {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]}
        for i in range(120)
    ]  # fmt: skip
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    out = tmp_path / "out"
    records = _run(
        moe_models["qwen3_moe"], out, "--dataset", str(data), "--chat_template", str(template), "--packing", "true",
        "--eval_split", "0.1", "--eval_steps", "6", "--quant", "bnb", "--max_steps", "12",
        "--router_aux_loss_coef", "0.02", "--batch_size", "2",
    )  # fmt: skip
    steps = [r for r in records if "loss" in r and "eval_loss" not in r]
    assert len(steps) == 12
    for r in steps:
        assert r["aux_loss"] > 0 and r["expert_load_max"] >= r["expert_load_mean"] > 0
    first, last = sum(r["loss"] for r in steps[:3]) / 3, sum(r["loss"] for r in steps[-3:]) / 3
    assert last < first, (first, last)
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [6, 12] and all(math.isfinite(r["eval_loss"]) for r in evals)
    config = json.loads((out / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["experts.down_proj", "experts.gate_up_proj"]


@pytest.mark.parametrize(("family", "quant"), [("mixtral", "bnb"), ("mixtral", "hqq"), ("qwen2_moe", "bnb"),
                                               ("qwen3_moe", "bnb")])  # fmt: skip
def test_resident_bytes_are_at_most_0_6x_the_bf16_model(
    moe_models: dict[str, Path], tmp_path: Path, family: str, quant: str
) -> None:
    """bf16 training on 2 ranks: every parameter a rank holds (quantized experts and attention, their state, the
    bf16 embeddings, norms and routers, and the adapters), summed over the ranks, against 2 bytes per parameter of
    the transformers model. Unquantized experts alone would be about 0.8x."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(moe_models[family]))
    bf16_bytes = 2 * sum(p.numel() for p in model.parameters())
    flags = ("--dataset", str(DATASET), "--quant", quant, "--max_steps", "1", "--save_model", "false")
    common = [arg if arg != "fp32" else "bf16" for arg in COMMON]
    train(["--model", str(moe_models[family]), *common, "--output_dir", str(tmp_path), *flags], nproc=2, timeout=600)
    resident = sum(read_metrics(tmp_path)[0]["param_bytes_per_rank"])
    assert resident <= 0.6 * bf16_bytes, (resident, bf16_bytes, resident / bf16_bytes)
