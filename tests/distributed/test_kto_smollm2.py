"""A real model learns from unpaired labels through the CLI: SmolLM2-135M-Instruct, 4-bit (bnb) on 2 CPU ranks, KTO
on completions labelled desirable when they carry a sign-off and undesirable when they lack it. Random weights could
not show this: on 40 held-out prompts, each with a desirable and an undesirable completion, the desirable one must
gain more reward (beta x its log-ratio against the reference) in at least 90% of them.

The rewards are measured by PEFT on transformers' own model holding the weights training computed with (the 4-bit
base dequantized), the saved adapter on for the policy and off for the reference. The same settings in TRL's
KTOTrainer with PEFT on the unquantized model reach a comparable accuracy (docs/rl.md quotes both)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qlora_fsdp.data import IGNORE_INDEX
from qlora_fsdp.data.formats import encode_examples
from qlora_fsdp.data.rows import collate
from qlora_fsdp.model.hub import load_tokenizer
from qlora_fsdp.train.metrics import read_metrics
from tests.conftest import REPO_ROOT, train
from tests.parity import trained_adapter_model

pytestmark = pytest.mark.distributed

ROWS = REPO_ROOT / "data" / "kto_tiny.jsonl"
PAIRS = REPO_ROOT / "data" / "preference_tiny.jsonl"
HELD_OUT = 40
BETA, STEPS = 0.1, 8
SETTINGS = ["--objective", "kto", "--beta", str(BETA), "--prompt_style", "chat", "--quant", "bnb", "--precision",
            "fp32", "--context_length", "128", "--batch_size", "2", "--max_steps", str(STEPS), "--lr", "1e-3",
            "--lora_rank", "8", "--lora_alpha", "16", "--lora_target_modules", "q_proj,v_proj,o_proj,down_proj",
            "--seed", "5", "--device", "cpu", "--log_to", "stdout"]  # fmt: skip


def held_out_pairs() -> list[dict]:
    """The last 40 preference pairs: their prompts are in no training row."""
    return [json.loads(line) for line in PAIRS.read_text().splitlines()][-HELD_OUT:]


def training_rows(path: Path) -> Path:
    """kto_tiny.jsonl without the held-out prompts."""
    held = {pair["prompt"] for pair in held_out_pairs()}
    rows = [line for line in ROWS.read_text().splitlines() if json.loads(line)["prompt"] not in held]
    path.write_text("\n".join(rows) + "\n")
    return path


def _logps(model: torch.nn.Module, tokenizer, items: list[dict]) -> torch.Tensor:
    sums = []
    with torch.no_grad():
        for start in range(0, len(items), 8):
            batch = collate(items[start : start + 8], pad_id=tokenizer.pad_token_id or 0, context_length=128,
                            pad_to_context=False)  # fmt: skip
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
            labels = batch["labels"][:, 1:]
            token = torch.gather(logits[:, :-1].log_softmax(-1), 2, labels.clamp(min=0)[..., None]).squeeze(-1)
            sums.append((token * (labels != IGNORE_INDEX)).sum(1))
    return torch.cat(sums).double()


def held_out_accuracy(model: torch.nn.Module, tokenizer) -> tuple[float, float]:
    """(the share of held-out prompts whose desirable completion gains more reward, the mean reward margin), the
    model a PEFT model whose adapter is the policy; prompts framed by the chat template, as --prompt_style chat."""
    from qlora_fsdp.data.chat import conversation_from_pair

    sides = [conversation_from_pair(p["prompt"], reply, "held out") for p in held_out_pairs()
             for reply in (p["chosen"], p["rejected"])]  # fmt: skip
    items = [{"input_ids": ids, "labels": labels} for ids, labels in
             encode_examples(sides, tokenizer, train_on_inputs=False)]  # fmt: skip
    policy = _logps(model, tokenizer, items)
    with model.disable_adapter():
        reference = _logps(model, tokenizer, items)
    rewards = (BETA * (policy - reference)).reshape(-1, 2)
    margins = rewards[:, 0] - rewards[:, 1]
    return float((margins > 0).double().mean()), float(margins.mean())


def test_smollm2_learns_which_completions_are_desirable(smollm2: Path, tmp_path: Path) -> None:
    out = tmp_path / "kto"
    train(["--model", str(smollm2), "--dataset", str(training_rows(tmp_path / "rows.jsonl")), *SETTINGS,
           "--dataset_cache_dir", str(tmp_path / "cache"), "--output_dir", str(out)], nproc=2,
          timeout=900)  # fmt: skip
    steps = [r for r in read_metrics(out) if "loss" in r]
    assert len(steps) == STEPS and abs(steps[0]["loss"] - 0.5) < 1e-5, steps[0]  # the fresh adapter's
    tokenizer = load_tokenizer(smollm2)
    peft = trained_adapter_model(smollm2, out, "bnb")
    accuracy, margin = held_out_accuracy(peft, tokenizer)
    assert accuracy >= 0.9 and margin > 0, (accuracy, margin, [r["loss"] for r in steps])
