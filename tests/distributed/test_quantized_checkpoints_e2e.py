"""The checkpoints people download, trained by the real CLI on 2 CPU ranks (one launch each, 6 steps over the same
two rows): gpt-oss and Llama 4 with bnb and HQQ, gpt-oss from its MXFP4 release (experts kept, or dequantized and
quantized with --quant), DeepSeek-V3 from an FP8 release, DeepSeek-V4 from its FP8 release with FP4 experts (kept),
a pre-quantized bitsandbytes 4-bit Llama and scripts/export_quantized.py's HQQ export of one.

Each run's loss falls, and its adapter loads in PEFT onto transformers' own loading of the same files and lowers
that model's loss on the rows. Where the checkpoint's quantization is kept, the bytes rank 0 digested for the
manifest are the file's, and every rank's first forward checks its shards against them (verify_packed). gpt-oss and
Llama 4 run in bf16, their resident bytes summed over the ranks at most 0.6x the bf16 model's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qlora_fsdp.checkpoint.manifest import read_manifest
from qlora_fsdp.train.metrics import read_metrics
from tests.conftest import train
from tests.distributed.test_moe_e2e import ROWS  # two rows that 2 ranks x batch 1 take whole every step
from tests.distributed.test_moe_matrix import CONTEXT, row_batches
from tests.moe_models import build_moe_model
from tests.quantized_checkpoints import (
    bnb_4bit_checkpoint,
    file_digests,
    fp4_expert_digests,
    fp8_checkpoint,
    hqq_digests,
    hqq_export,
    mxfp4_checkpoint,
    mxfp4_digests,
)

pytestmark = pytest.mark.distributed

STEPS = 6
COMMON = [
    "--context_length", str(CONTEXT), "--lr", "0.01", "--lora_rank", "8", "--lora_alpha", "16", "--lora_dropout",
    "0", "--lora_target_modules", "all", "--lr_scheduler", "constant", "--device", "cpu", "--log_to", "stdout",
    "--seed", "7", "--batch_size", "1", "--max_steps", str(STEPS),
]  # fmt: skip
RUNS = {
    "gpt_oss-bnb": ("gpt_oss", "bnb", []),
    "gpt_oss-hqq": ("gpt_oss", "hqq", []),
    "llama4-bnb": ("llama4", "bnb", []),
    "llama4-hqq": ("llama4", "hqq", []),
    "gpt_oss-mxfp4-kept-bnb": ("gpt_oss-mxfp4", "bnb", ["--mxfp4", "keep"]),
    "gpt_oss-mxfp4-hqq": ("gpt_oss-mxfp4", "hqq", ["--mxfp4", "dequantize"]),
    "deepseek_v3-fp8-bnb": ("deepseek_v3-fp8", "bnb", []),
    "deepseek_v3-fp8-hqq": ("deepseek_v3-fp8", "hqq", []),
    "deepseek_v4-fp4-kept-bnb": ("deepseek_v4-fp4", "bnb", ["--mxfp4", "keep"]),
    "llama-bnb-4bit": ("llama-bnb-4bit", "bnb", []),
    "llama-hqq-export": ("llama-hqq-export", "hqq", []),
}
"""run id -> (checkpoint, --quant, more flags)."""
BF16 = ("gpt_oss", "llama4")
"""The dense releases, trained in bf16 for the resident-bytes bound."""


def checkpoint(kind: str, root: Path, tiny_model: Path) -> Path:
    """The checkpoint `kind` names, written as its release ships it."""
    family, _, fmt = kind.partition("-")
    if family == "llama":
        export = hqq_export if fmt == "hqq-export" else bnb_4bit_checkpoint
        return export(tiny_model, root / kind)
    dense = build_moe_model(family, root / family, tokenizer_from=tiny_model)
    if fmt == "mxfp4":
        return mxfp4_checkpoint(dense, root / kind)
    if fmt == "fp4":  # DeepSeek-V4's release: FP8 with E8M0 scales, its routed experts FP4
        return fp8_checkpoint(dense, root / kind, block=(2, 16), scale_fmt="ue8m0", fp4_experts=True)
    return fp8_checkpoint(dense, root / kind, block=(8, 8)) if fmt == "fp8" else dense


@pytest.mark.parametrize("run", list(RUNS))
def test_trains_and_the_adapter_loads_on_transformers_loading(tiny_model: Path, tmp_path: Path, run: str) -> None:
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    kind, quant, flags = RUNS[run]
    model = checkpoint(kind, tmp_path, tiny_model)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    out = tmp_path / "out"
    precision = "bf16" if kind in BF16 else "fp32"
    train(["--model", str(model), "--quant", quant, "--dataset", str(data), "--precision", precision, *COMMON,
           *flags, "--output_dir", str(out)], nproc=2)  # fmt: skip

    records = read_metrics(out)
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == STEPS
    assert sum(losses[-2:]) < sum(losses[:2]), f"loss did not fall: {losses}"
    if kind in BF16:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
        bf16_bytes = 2 * sum(p.numel() for p in skeleton.parameters())
        resident = sum(records[0]["param_bytes_per_rank"])
        assert resident <= 0.6 * bf16_bytes, (resident, bf16_bytes, resident / bf16_bytes)
    manifest = read_manifest(out)
    assert manifest is not None
    if kind == "llama-bnb-4bit":  # no second rounding: the file's bytes and state
        assert manifest.layers == file_digests(model)
    if kind == "llama-hqq-export":  # an export of ours trains on as it is, each layer shared out to no rank
        assert manifest.layers == hqq_digests(model)
    if "--mxfp4" in flags and flags[-1] == "keep":
        experts = {n: d for n, d in manifest.layers.items() if ".experts." in n}
        assert experts == (fp4_expert_digests(model) if kind.endswith("-fp4") else mxfp4_digests(model))

    if kind == "llama-hqq-export":  # HQQ's own loader reads its qmodel.pt
        from hqq.models.hf.base import AutoHQQHFModel

        base_model = AutoHQQHFModel.from_quantized(str(model), compute_dtype=torch.float32, device="cpu")
    else:
        base_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base_model, out).eval()
    with torch.no_grad():
        adapted = sum(loaded(input_ids=ids, labels=labels).loss.item() for ids, labels in row_batches(model, data))
        with loaded.disable_adapter():
            base = sum(loaded(input_ids=ids, labels=labels).loss.item() for ids, labels in row_batches(model, data))
    assert adapted < base, f"the adapter does not lower transformers' model's loss: {adapted} vs {base}"
