"""A real model learns a preference through the CLI: SmolLM2-135M-Instruct, 4-bit (bnb) on 2 CPU ranks, DPO on
pairs whose chosen reply carries a sign-off the rejected one lacks. Random weights could not show this: the reward
accuracy on held-out pairs must rise to 0.9 because the model learned to prefer the sign-off.

The saved adapter then loads in PEFT on transformers' own model (holding the weights training computed with,
dequantized), and PEFT's reply log-probs of the held-out pairs equal the run's final evaluation's."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from qlora_fsdp.data import IGNORE_INDEX
from qlora_fsdp.data.cache import PREFERENCE, CacheSpec, open_cache
from qlora_fsdp.data.loader import held_out
from qlora_fsdp.data.rows import collate
from qlora_fsdp.model.hub import load_tokenizer
from qlora_fsdp.train.metrics import read_metrics
from tests.conftest import REPO_ROOT, train
from tests.parity import trained_adapter_model

pytestmark = pytest.mark.distributed

PAIRS = REPO_ROOT / "data" / "preference_tiny.jsonl"
SEED, SPLIT, CONTEXT = 5, 0.1, 128


def _held_out_logps(model: torch.nn.Module, tokenizer, cache_dir: Path, pairs: int | None = None) -> torch.Tensor:
    """Each held-out pair's (chosen, rejected) summed reply log-probs, from the model's whole logits: the pairs
    --eval_split held out, or the first `pairs` of them."""
    spec = CacheSpec(dataset=str(PAIRS), dataset_samples=0, prompt_style="chat", context_length=CONTEXT,
                     packing_split=False, train_on_inputs=False, objective=PREFERENCE)  # fmt: skip
    cache, _ = open_cache(spec, tokenizer, cache_dir=cache_dir)
    rows = np.flatnonzero(held_out(cache.examples, SPLIT, seed=SEED))[:pairs]
    items = []
    for at in rows:
        (c_ids, c_labels), (r_ids, r_labels) = cache.samples[int(at)]
        items.append({"input_ids": c_ids, "labels": c_labels, "rejected_input_ids": r_ids,
                      "rejected_labels": r_labels, "pair_index": [int(at)]})  # fmt: skip
    sums = []
    with torch.no_grad():
        for start in range(0, len(items), 8):
            batch = collate(items[start : start + 8], pad_id=tokenizer.pad_token_id or 0, context_length=CONTEXT,
                            pad_to_context=False)  # fmt: skip
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
            labels = batch["labels"][:, 1:]
            token = torch.gather(logits[:, :-1].log_softmax(-1), 2, labels.clamp(min=0)[..., None]).squeeze(-1)
            sums.append(torch.stack((token * (labels != IGNORE_INDEX)).sum(1).chunk(2), dim=1))
    return torch.cat(sums).double()


def test_smollm2_learns_to_prefer_the_sign_off(smollm2: Path, tmp_path: Path) -> None:
    out = tmp_path / "dpo"
    train(
        ["--model", str(smollm2), "--dataset", str(PAIRS), "--objective", "dpo", "--beta", "0.1",
         "--prompt_style", "chat", "--quant", "bnb", "--precision", "fp32", "--context_length", str(CONTEXT),
         "--batch_size", "2", "--max_steps", "12", "--lr", "5e-4", "--lora_rank", "8", "--lora_alpha", "16",
         "--lora_target_modules", "q_proj,v_proj,o_proj,down_proj", "--eval_split", str(SPLIT), "--eval_steps",
         "12", "--seed", str(SEED), "--device", "cpu", "--log_to", "stdout", "--dataset_cache_dir",
         str(tmp_path / "cache"), "--output_dir", str(out)],
        nproc=2,
        timeout=900,
    )  # fmt: skip
    records = read_metrics(out)
    steps = [r for r in records if "loss" in r]
    (last,) = [r for r in records if "eval_loss" in r]  # one evaluation, after the last step
    assert last["step"] == 12 and last["eval_pairs"] == 40
    assert last["eval_rewards/accuracies"] >= 0.9, last
    # ln 2 and a zero margin: the fresh adapter's (step 1's loss is computed before any update).
    assert abs(steps[0]["loss"] - math.log(2)) < 1e-5, steps[0]
    assert last["eval_loss"] < 0.9 * math.log(2) and last["eval_rewards/margins"] > 0, last
    assert sum(r["loss"] for r in steps[-3:]) / 3 < steps[0]["loss"], [r["loss"] for r in steps]

    # PEFT on transformers' model with the dequantized 4-bit weights: the run's held-out log-probs.
    tokenizer = load_tokenizer(smollm2)
    peft = trained_adapter_model(smollm2, out, "bnb")
    logps = _held_out_logps(peft, tokenizer, tmp_path / "cache")
    assert len(logps) == 40
    chosen, rejected = logps.mean(0).tolist()
    assert abs(chosen - last["eval_logps/chosen"]) < 1e-4 * abs(chosen), (chosen, last["eval_logps/chosen"])
    assert abs(rejected - last["eval_logps/rejected"]) < 1e-4 * abs(rejected), (rejected, last)
    # Control: the base model without the adapter is measurably elsewhere on the same pairs (the first 8 show it),
    # so the agreement is the adapter's.
    with peft.disable_adapter():
        base = _held_out_logps(peft, tokenizer, tmp_path / "cache", pairs=8)
    assert (base[:, 0] - logps[:8, 0]).abs().mean() > 10 * abs(chosen - last["eval_logps/chosen"])
