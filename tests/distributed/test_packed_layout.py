"""FSDP2's two packed layouts train the same model: uint8 parameters (torch 2.12+) and the float view that older
torch gets, forced here with --packed_layout float; and the default command on another torch (the GPU machine's
2.11, say) reproduces this one's losses."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from qlora_fsdp.train.metrics import read_metrics
from tests.conftest import DATASET, REPO_ROOT, UINT8_FSDP2, train, worker_env

pytestmark = pytest.mark.distributed

# Set by .ci/run in the torch 2.11 venv: the CPU suite's python, whose run is the reference.
REFERENCE_PYTHON = os.environ.get("QLORA_REFERENCE_PYTHON", "")
STEPS = 8
COMMON = [
    "--dataset", str(DATASET), "--precision", "fp32", "--context_length", "96", "--lr", "0.01",
    "--lora_rank", "16", "--lora_alpha", "32", "--lora_dropout", "0", "--device", "cpu", "--log_to", "stdout",
    "--seed", "7", "--max_steps", str(STEPS), "--save_model", "false",
]  # fmt: skip


def run(tiny_model: Path, out: Path, quant: str, *extra: str) -> list[dict]:
    train(["--model", str(tiny_model), "--quant", quant, *COMMON, *extra, "--output_dir", str(out)], nproc=2)
    return read_metrics(out)


@pytest.mark.skipif(not UINT8_FSDP2, reason="this torch's FSDP2 cannot shard uint8 parameters")
@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_float_view_trains_like_uint8(quant: str, tiny_model: Path, tmp_path: Path) -> None:
    as_uint8 = run(tiny_model, tmp_path / "uint8", quant, "--packed_layout", "uint8")
    as_float = run(tiny_model, tmp_path / "float", quant, "--packed_layout", "float")
    for a, b in zip(as_uint8, as_float, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4, (a, b)
    # The same bytes in both layouts: the state is sharded too, so the resident bytes differ only by padding.
    assert abs(as_uint8[0]["param_bytes_per_rank"][0] / as_float[0]["param_bytes_per_rank"][0] - 1) < 0.01


@pytest.mark.skipif(not REFERENCE_PYTHON, reason="QLORA_REFERENCE_PYTHON names no other torch to compare with")
@pytest.mark.parametrize("quant", ["bnb", "hqq", "none"])
def test_default_command_reproduces_the_reference_torch(quant: str, tiny_model: Path, tmp_path: Path) -> None:
    """Default flags (FSDP2, auto layout) here and under the reference python: the same per-step losses."""
    here = run(tiny_model, tmp_path / "here", quant)
    torchrun = Path(REFERENCE_PYTHON).with_name("torchrun")
    args = ["--model", str(tiny_model), "--quant", quant, *COMMON, "--output_dir", str(tmp_path / "reference")]
    cmd = [str(torchrun), "--standalone", "--nproc_per_node=2", str(REPO_ROOT / "train.py"), *args]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    reference = read_metrics(tmp_path / "reference")
    assert len(here) == len(reference) == STEPS
    for a, b in zip(here, reference, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4, (torch.__version__, a["loss"], b["loss"])
