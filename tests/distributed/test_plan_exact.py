"""scripts/plan.py's parameter bytes per rank are what a real 2-rank run measures (`param_bytes_per_rank` in
metrics.jsonl), to the byte: bnb under FSDP2, HQQ under FSDP1 with its mixed precision (quantized layers in units
of their own), and a mixture-of-experts model's per-expert quantized layers and expert adapters."""

from __future__ import annotations

from pathlib import Path

import pytest

from qlora_fsdp.config.options import build_config
from qlora_fsdp.tools.config import PlanConfig
from qlora_fsdp.tools.plan import plan_run
from qlora_fsdp.train.metrics import read_metrics
from tests.conftest import DATASET, train

pytestmark = pytest.mark.distributed

RUN = [
    "--device", "cpu", "--log_to", "stdout", "--dataset", str(DATASET), "--dataset_in_memory", "true",
    "--max_steps", "1", "--context_length", "64", "--lora_rank", "8", "--save_model", "false",
]  # fmt: skip


@pytest.mark.parametrize(
    ("model", "flags"),
    [
        ("tiny", ["--quant", "bnb"]),
        ("tiny", ["--quant", "hqq", "--fsdp_version", "1", "--precision", "mp_bf16"]),
        ("mixtral", ["--quant", "hqq"]),
    ],
    ids=["bnb-fsdp2", "hqq-fsdp1-mp_bf16", "mixtral-hqq-fsdp2"],
)
def test_planned_parameter_bytes_are_measured_ones(
    tiny_model: Path, moe_models: dict[str, Path], tmp_path: Path, model: str, flags: list[str]
) -> None:
    path = tiny_model if model == "tiny" else moe_models[model]
    train(["--model", str(path), *RUN, *flags, "--output_dir", str(tmp_path)], nproc=2)
    measured = read_metrics(tmp_path)[0]["param_bytes_per_rank"]
    values = dict(zip(RUN[::2], RUN[1::2], strict=True)) | dict(zip(flags[::2], flags[1::2], strict=True))
    cfg = build_config({k.removeprefix("--"): v for k, v in values.items()} | {"model": str(path)}).validate()
    planned = [rank.parameter_bytes for rank in plan_run(cfg, PlanConfig(nproc_per_node=2)).ranks]
    print(f"{model} {' '.join(flags)}: planned {planned}, measured {measured}")
    assert planned == measured
