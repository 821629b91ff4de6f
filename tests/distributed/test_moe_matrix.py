"""The mixture-of-experts matrix: every family of tests/moe_models.py MATRIX, built by transformers' own classes
and saved by its own save_pretrained, trained by the real CLI on 2 CPU ranks (one launch each: 6 steps over the
same two rows, fp32, evaluated on them at the end), then handed to PEFT.

Each run's loss falls; its adapter loads with `PeftModel.from_pretrained` onto transformers' own model of the
checkpoint with exactly the saved keys and values (no missing, unexpected or mis-shaped key: PEFT building one
adapter more or fewer, or of another rank, shows); and PEFT on transformers' model, its weights the bytes training
quantized (checked against the run's manifest) dequantized, gives the logits this project's own model with the
saved adapter gives (1e-5, fp32) and the eval loss the 2 ranks computed (1e-5 relative).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qlora_fsdp.data.formats import load_examples
from qlora_fsdp.data.rows import fit_examples
from qlora_fsdp.model.attention import fix_latent_attention, indexer_linears
from qlora_fsdp.model.hub import load_tokenizer
from qlora_fsdp.model.lora import load_saved_adapter
from qlora_fsdp.quant.experts import router_gates
from qlora_fsdp.train.metrics import read_metrics
from tests import parity
from tests.conftest import train
from tests.distributed.test_moe_e2e import ROWS  # two rows that 2 ranks x batch 1 take whole every step
from tests.moe_models import MATRIX, build_moe_model

pytestmark = pytest.mark.distributed

STEPS, CONTEXT = 6, 96
COMMON = [
    "--precision", "fp32", "--context_length", str(CONTEXT), "--lr", "0.01", "--lora_rank", "8", "--lora_alpha", "16",
    "--lora_dropout", "0", "--lora_target_modules", "all", "--lr_scheduler", "constant", "--device", "cpu",
    "--log_to", "stdout", "--seed", "7", "--batch_size", "1", "--max_steps", str(STEPS),
    "--router_aux_loss_coef", "0",  # the loss is the cross-entropy alone, as PEFT's model computes it
]  # fmt: skip
LOGITS_ATOL = 1e-5


def row_batches(model: Path, data: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each row tokenized and labelled as training does (prompt unlabelled), unpadded: (input ids, labels)."""
    samples, stats = fit_examples(
        load_examples(str(data)), load_tokenizer(model), context_length=CONTEXT, train_on_inputs=False
    )
    assert stats.samples == len(ROWS) and not stats.truncated
    return [(torch.tensor([ids]), torch.tensor([labels])) for ids, labels in samples]


@pytest.mark.parametrize("row", list(MATRIX))
def test_trains_and_peft_loads_the_adapter_with_training_logits(tiny_model: Path, tmp_path: Path, row: str) -> None:
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    family, quant, sizes = MATRIX[row]
    model = build_moe_model(family, tmp_path / family, tokenizer_from=tiny_model, **sizes)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "out"
    train(["--model", str(model), "--quant", quant, "--dataset", str(data), "--eval_dataset", str(data), *COMMON,
           "--output_dir", str(out)], nproc=2)  # fmt: skip

    records = read_metrics(out)
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == STEPS
    assert sum(losses[-2:]) < sum(losses[:2]), f"loss did not fall: {losses}"

    saved = load_file(out / "adapter_model.safetensors")
    base = parity.quantized_base(model, quant, out)
    choosers = tuple(f".{name}." for name in router_gates(base.model) | indexer_linears(base.model))
    adapted = [key for key in saved if choosers and any(chooser in key for chooser in choosers)]
    assert not adapted, f"a router or indexer was adapted: {adapted[:3]}"
    assert any(".experts." in key and "lora_B" in key and t.abs().sum() > 0 for key, t in saved.items())
    own = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), out)
    state = get_peft_model_state_dict(own)
    assert set(state) == set(saved), f"missing {set(saved) - set(state)}, unexpected {set(state) - set(saved)}"
    assert all(torch.equal(state[key].to(t.dtype), t) for key, t in saved.items())
    del own

    parity.check_quantized_like(base, out)
    dequantized = parity.dequantized_transformers_model(model, base)
    fix_latent_attention(dequantized)  # a tiny DeepSeek-V2's 2 KV heads: transformers would repeat complete keys
    reference = PeftModel.from_pretrained(dequantized, out).eval()
    config = json.loads((out / "adapter_config.json").read_text())
    ours = load_saved_adapter(base.model, out / "adapter_model.safetensors", config, dtype=torch.float32).eval()
    batches = parity.step_batches(model, data, context=CONTEXT, rows=len(ROWS))
    worst, sums, count = 0.0, 0.0, 0
    with torch.no_grad():
        for batch in batches:
            inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}
            worst = max(worst, (ours(**inputs).logits - reference(**inputs).logits).abs().max().item())
            part, n = parity.label_loss_sum(reference, batch)
            sums, count = sums + part.item(), count + n
    print(f"matrix {row}: losses {losses[0]:.4f} -> {losses[-1]:.4f}, {len(saved)} adapter tensors, "
          f"logits max |ours - PEFT| {worst:.2e}")  # fmt: skip
    assert worst <= LOGITS_ATOL, f"logits of the saved adapter: this project's model and PEFT's differ by {worst}"
    final = [r for r in records if "eval_loss" in r][-1]
    assert final["eval_tokens"] == count
    assert final["eval_loss"] == pytest.approx(sums / count, rel=1e-5), (final["eval_loss"], sums / count)
