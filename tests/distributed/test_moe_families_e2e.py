"""The MoE families outside the parametrized suites, trained by the real CLI on 2 CPU ranks (one launch each, 6
steps over the same two rows): PhiMoE with bnb and HQQ (its router, an nn.Linear subclass returning a tuple, once
got an adapter and failed at step 1), DeepSeek-V2 (latent attention with 2 KV heads for 4 query heads in its config,
once repeated twice in sdpa) and OLMoE with bnb. The loss falls, and the saved adapter loads in PEFT on the
unquantized transformers model with exactly the saved keys and values, and lowers that model's loss on the rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qlora_fsdp.data.formats import load_examples
from qlora_fsdp.data.rows import fit_examples
from qlora_fsdp.model.hub import load_tokenizer
from qlora_fsdp.train.metrics import read_metrics
from tests.conftest import train
from tests.distributed.test_moe_e2e import ROWS  # two rows that 2 ranks x batch 1 take whole every step
from tests.moe_models import build_moe_model

pytestmark = pytest.mark.distributed

STEPS, CONTEXT = 6, 96
COMMON = [
    "--precision", "fp32", "--context_length", str(CONTEXT), "--lr", "0.01", "--lora_rank", "8", "--lora_alpha", "16",
    "--lora_dropout", "0", "--lora_target_modules", "all", "--lr_scheduler", "constant", "--device", "cpu",
    "--log_to", "stdout", "--seed", "7", "--batch_size", "1", "--max_steps", str(STEPS),
]  # fmt: skip
COMBOS = [("phimoe", "bnb"), ("phimoe", "hqq"), ("deepseek_v2", "bnb"), ("olmoe", "bnb")]


def row_batches(model: Path, data: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each row tokenized and labelled as training does (prompt unlabelled), unpadded: (input ids, labels)."""
    samples, stats = fit_examples(
        load_examples(str(data)), load_tokenizer(model), context_length=CONTEXT, train_on_inputs=False
    )
    assert stats.samples == len(ROWS) and not stats.truncated
    return [(torch.tensor([ids]), torch.tensor([labels])) for ids, labels in samples]


@pytest.mark.parametrize(("family", "quant"), COMBOS, ids=[f"{f}-{q}" for f, q in COMBOS])
def test_trains_and_the_adapter_loads_in_peft(tiny_model: Path, tmp_path: Path, family: str, quant: str) -> None:
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = build_moe_model(family, tmp_path / family, tokenizer_from=tiny_model)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    out = tmp_path / "out"
    train(["--model", str(model), "--quant", quant, "--dataset", str(data), *COMMON, "--output_dir", str(out)], nproc=2)

    losses = [r["loss"] for r in read_metrics(out) if "loss" in r]
    assert len(losses) == STEPS
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    assert last < first, f"loss did not fall: {losses}"

    saved = load_file(out / "adapter_model.safetensors")
    assert not [key for key in saved if ".router." in key or ".gate." in key], "a router was adapted"
    assert any(".experts." in key and "lora_B" in key and t.abs().sum() > 0 for key, t in saved.items())
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), out).eval()
    state = get_peft_model_state_dict(loaded)
    assert set(state) == set(saved), f"missing {set(saved) - set(state)}, unexpected {set(state) - set(saved)}"
    assert all(torch.equal(state[key].to(t.dtype), t) for key, t in saved.items())
    with torch.no_grad():
        adapted = sum(loaded(input_ids=ids, labels=labels).loss.item() for ids, labels in row_batches(model, data))
        with loaded.disable_adapter():
            base = sum(loaded(input_ids=ids, labels=labels).loss.item() for ids, labels in row_batches(model, data))
    assert adapted < base, f"the adapter does not lower the unquantized model's loss: {adapted} vs {base}"
