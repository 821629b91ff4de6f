"""What the comparisons of our objectives with TRL's trainers share (tests/unit/objectives/test_*_trl.py and
test_sampling.py): TRL's trainer on the tiny model with a LoRA adapter drawn as if trained, our objective's loss as
the training loop makes it, and the gradient and metric comparisons."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer
from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer

from qlora_fsdp.objectives.base import Forward, combined_loss
from qlora_fsdp.objectives.preference import PreferenceObjective
from qlora_fsdp.parallel.precision import PRECISIONS

CPU = torch.device("cpu")
FP32 = Forward(CPU, PRECISIONS["fp32"])
PAD = 1  # the tiny tokenizer's <|pad|>
TOL = 1e-5


def trl_classes(kind: str) -> tuple[type, type[Trainer]]:
    if kind == "dpo":
        return DPOConfig, DPOTrainer
    if kind == "kto":
        return KTOConfig, KTOTrainer
    with warnings.catch_warnings():  # "APIs here are unstable"
        warnings.simplefilter("ignore")
        from trl.experimental.cpo import CPOConfig, CPOTrainer
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer
    return {"orpo": (ORPOConfig, ORPOTrainer), "cpo": (CPOConfig, CPOTrainer)}[kind]


def perturb(model: nn.Module, *, seed: int = 1, scale: float = 0.05) -> None:
    """Non-zero B matrices, as after some training: the adapter changes the model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * scale)


def trl_trainer(kind: str, model_dir: Path, out: Path, **settings: Any) -> Trainer:
    """TRL's trainer (dpo, orpo, cpo or kto, which unpairs the pair) on the tiny base model, wrapped by TRL with a
    LoRA adapter, then perturbed."""
    config_class, trainer_class = trl_classes(kind)
    args = config_class(output_dir=str(out), report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False,
                        max_length=64, seed=0, **settings)  # fmt: skip
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.pad_token_id == PAD
    dataset = Dataset.from_dict({"prompt": ["Hello"], "chosen": [" yes"], "rejected": [" no"]})  # never trained on
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    trainer = trainer_class(base, args=args, train_dataset=dataset, processing_class=tokenizer, peft_config=lora)
    perturb(trainer.model)
    trainer.model.train()
    return trainer


def ours(
    objective: PreferenceObjective, model: nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(loss, its parts divided by their weights, logged metrics) as the training loop makes them."""
    parts, sums = objective.loss_sum(model, batch)
    weights = torch.tensor(objective.weights(batch), dtype=torch.float32)
    metrics = objective.logged(sums.tolist(), weights.tolist())
    return combined_loss(parts, weights), parts / weights, metrics


def lora_params(model: nn.Module) -> list[nn.Parameter]:
    params = [p for n, p in model.named_parameters() if p.requires_grad]
    assert params and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    return params


def grad(loss: torch.Tensor, params: list[nn.Parameter]) -> torch.Tensor:
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def assert_metrics(ours: dict[str, float], trl: dict[str, float], names: tuple[str, ...]) -> None:
    for name in names:
        assert ours[name] == pytest.approx(trl[name], rel=TOL, abs=TOL), name


def last_metrics(trainer: Trainer) -> dict[str, float]:
    """DPOTrainer's metrics of its last _compute_loss."""
    return {k: v[-1] for k, v in trainer._metrics["train"].items()}
