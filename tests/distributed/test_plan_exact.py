"""scripts/plan.py's parameter bytes per rank are what a real 2-rank run measures (`param_bytes_per_rank` in
metrics.jsonl), to the byte: bnb under FSDP2, HQQ under FSDP1 with its mixed precision (quantized layers in units
of their own), a mixture-of-experts model's per-expert quantized layers and expert adapters, and checkpoints that
keep their own quantization: a pre-quantized bitsandbytes release and gpt-oss's MXFP4 experts."""

from __future__ import annotations

from pathlib import Path

import pytest

from qlora_fsdp.config.options import build_config
from qlora_fsdp.tools.config import PlanConfig
from qlora_fsdp.tools.plan import plan_run
from qlora_fsdp.train.metrics import read_metrics
from tests.conftest import DATASET, train
from tests.moe_models import build_moe_model
from tests.quantized_checkpoints import bnb_4bit_checkpoint, mxfp4_checkpoint

pytestmark = pytest.mark.distributed

RUN = [
    "--device", "cpu", "--log_to", "stdout", "--dataset", str(DATASET), "--dataset_in_memory", "true",
    "--max_steps", "1", "--context_length", "64", "--lora_rank", "8", "--save_model", "false",
]  # fmt: skip


def checkpoint(model: str, tiny_model: Path, moe_models: dict[str, Path], root: Path) -> Path:
    """The model directory `model` names: the tiny Llama, a MoE fixture, or a release kept quantized."""
    if model == "tiny":
        return tiny_model
    if model == "tiny-bnb-4bit":
        return bnb_4bit_checkpoint(tiny_model, root / model)
    if model == "gpt_oss-mxfp4":
        return mxfp4_checkpoint(build_moe_model("gpt_oss", root / "gpt_oss", tokenizer_from=tiny_model), root / model)
    return moe_models[model]


@pytest.mark.parametrize(
    ("model", "flags"),
    [
        ("tiny", ["--quant", "bnb"]),
        ("tiny", ["--quant", "hqq", "--fsdp_version", "1", "--precision", "mp_bf16"]),
        ("mixtral", ["--quant", "hqq"]),
        ("tiny-bnb-4bit", ["--quant", "bnb"]),
        ("gpt_oss-mxfp4", ["--quant", "bnb", "--mxfp4", "keep"]),
    ],
    ids=["bnb-fsdp2", "hqq-fsdp1-mp_bf16", "mixtral-hqq-fsdp2", "bnb-4bit-kept", "mxfp4-kept"],
)
def test_planned_parameter_bytes_are_measured_ones(
    tiny_model: Path, moe_models: dict[str, Path], tmp_path: Path, model: str, flags: list[str]
) -> None:
    path = checkpoint(model, tiny_model, moe_models, tmp_path / "models")
    out = tmp_path / "out"
    train(["--model", str(path), *RUN, *flags, "--output_dir", str(out)], nproc=2)
    measured = read_metrics(out)[0]["param_bytes_per_rank"]
    values = dict(zip(RUN[::2], RUN[1::2], strict=True)) | dict(zip(flags[::2], flags[1::2], strict=True))
    cfg = build_config({k.removeprefix("--"): v for k, v in values.items()} | {"model": str(path)}).validate()
    planned = [rank.parameter_bytes for rank in plan_run(cfg, PlanConfig(nproc_per_node=2)).ranks]
    print(f"{model} {' '.join(flags)}: planned {planned}, measured {measured}")
    assert planned == measured
