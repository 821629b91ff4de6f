"""Whole runs against the trainers users come from: 20 steps of our CLI on 2 ranks x 4 rows against the peer's own
trainer in this process with 8 rows a step (transformers' Trainer + PEFT for SFT, TRL's DPOTrainer and KTOTrainer),
the same rows in the same order, fp32, no quantization, the peer's adapter set to the values ours starts from.

Ours runs with the flags that give the peer's behaviour where our defaults differ (docs/coming-from.md): the text of
a string prompt as it is (`--prompt_style raw`), the rows in file order (`--shuffle false`; TRL's KTOTrainer reads in
order, and the others are told to), clipping at 1.0 and a linear decay. Every step's loss agrees within 1e-4
relative. KTO's `kl` metric differs by design: TRL pairs each row with the previous row of its batch for the KL
estimate, we with the previous row of the file (docs/rl.md), which moves the estimate but not the loss past 1e-4
here. 2 ranks x 4 equal 1 rank x 8 (tests/distributed/test_kto.py, test_preference.py, test_train_e2e.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments

from qlora_fsdp.train.metrics import read_metrics
from tests.conftest import train
from tests.parity import initial_adapter
from tests.trl_parity import trl_classes

pytestmark = pytest.mark.distributed

STEPS, BATCH, SEED, CONTEXT = 20, 8, 3, 64
LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear"}
OURS = [
    "--quant", "none", "--precision", "fp32", "--device", "cpu", "--log_to", "stdout", "--lora_rank", "8",
    "--lora_alpha", "16", "--lora_dropout", "0", "--lora_target_modules", "all", "--grad_norm", "1.0",
    "--lr_scheduler", "linear", "--shuffle", "false", "--prompt_style", "raw", "--max_steps", str(STEPS),
    "--batch_size", str(BATCH // 2), "--context_length", str(CONTEXT), "--dataset_in_memory", "true",
    "--save_model", "false", "--seed", str(SEED),
]  # fmt: skip
PEER = {"output_dir": "", "report_to": "none", "use_cpu": True, "bf16": False, "per_device_train_batch_size": BATCH,
        "max_steps": STEPS, "logging_steps": 1, "save_strategy": "no", "seed": SEED, "gradient_checkpointing": False,
        "train_sampling_strategy": "sequential"}  # fmt: skip


def _rows(kind: str) -> list[dict[str, Any]]:
    """STEPS x BATCH rows, each with its own prompt: sums (KTO: every other one wrong and undesirable), pairs whose
    chosen reply ends with a courtesy (DPO), or prompt/completion rows (SFT)."""
    rng, rows = random.Random(0), []
    for i in range(STEPS * BATCH):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        answer = f"{a} plus {b} is {a + b}."
        if kind == "kto":
            wrong = f"{a} plus {b} is {a + b + rng.choice((-2, -1, 1, 2))}."
            rows.append({"prompt": f"Add {a} and {b}.", "completion": answer if i % 2 == 0 else wrong,
                         "label": i % 2 == 0})  # fmt: skip
        elif kind == "dpo":
            rows.append({"prompt": f"What is {a} plus {b}?", "chosen": f"{answer} Happy to help, friend.",
                         "rejected": answer})  # fmt: skip
        else:
            rows.append({"prompt": f"Add {a} and {b}.", "completion": answer})
    return rows


def _ours(model: Path, out: Path, rows: list[dict[str, Any]], objective: str, lr: float) -> list[float]:
    data = out.parent / f"{objective}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train(["--model", str(model), *OURS, "--dataset", str(data), "--objective", objective, "--lr", str(lr),
           "--output_dir", str(out)], nproc=2, timeout=600)  # fmt: skip
    return [r["loss"] for r in read_metrics(out) if "loss" in r]


def _start_like_ours(peft_model: torch.nn.Module, model: Path) -> None:
    values = initial_adapter(model, "none", rank=LORA["r"], alpha=LORA["lora_alpha"], seed=SEED)
    result = set_peft_model_state_dict(peft_model, values)
    assert not result.unexpected_keys, result.unexpected_keys


def _peer_losses(trainer: Trainer) -> list[float]:
    torch.manual_seed(SEED)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _trl(kind: str, model: Path, out: Path, rows: list[dict[str, Any]], lr: float) -> list[float]:
    config_class, trainer_class = trl_classes(kind)
    args = config_class(**{**PEER, "output_dir": str(out)}, learning_rate=lr, max_length=CONTEXT)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    trainer = trainer_class(base, args=args, train_dataset=Dataset.from_list(rows),
                            processing_class=AutoTokenizer.from_pretrained(model),
                            peft_config=LoraConfig(**LORA))  # fmt: skip
    _start_like_ours(trainer.model, model)
    return _peer_losses(trainer)


def _transformers_sft(model: Path, out: Path, rows: list[dict[str, Any]], lr: float) -> list[float]:
    """transformers' Trainer + PEFT on the rows tokenized as TRL's prompt/completion form is: prompt, completion,
    EOS; the loss on the completion and EOS."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    examples = []
    for row in rows:
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        completion = [*tokenizer(row["completion"], add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
        examples.append({"input_ids": prompt + completion, "labels": [-100] * len(prompt) + completion})
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), LoraConfig(**LORA))
    _start_like_ours(peft_model, model)
    args = TrainingArguments(**{**PEER, "output_dir": str(out)}, learning_rate=lr)
    trainer = Trainer(peft_model, args=args, train_dataset=Dataset.from_list(examples),
                      data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True))  # fmt: skip
    return _peer_losses(trainer)


@pytest.mark.parametrize(("objective", "lr"), [("sft", 2e-3), ("dpo", 5e-4), ("kto", 2e-3)])
def test_every_step_loss_equals_the_peer_trainers(tiny_model: Path, tmp_path: Path, objective: str,
                                                   lr: float) -> None:  # fmt: skip
    rows = _rows(objective)
    ours = _ours(tiny_model, tmp_path / "ours", rows, objective, lr)
    if objective == "sft":
        peer = _transformers_sft(tiny_model, tmp_path / "peer", rows, lr)
    else:
        peer = _trl(objective, tiny_model, tmp_path / "peer", rows, lr)
    assert len(ours) == len(peer) == STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, peer, strict=True))
    assert worst < 1e-4, (worst, ours, peer)
    assert max(abs(loss - peer[0]) for loss in peer) > 1e-2  # the weights move: the curves compared are not flat
