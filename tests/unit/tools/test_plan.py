"""scripts/plan.py without launching anything: the backends' planned shapes against their quantizer, the command
line's errors (one line, status 2) and its table. tests/distributed/test_plan_exact.py holds the planned bytes to
a real run's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from qlora_fsdp.config.options import QuantConfig
from qlora_fsdp.quant import make_backend
from scripts.plan import main
from tests.conftest import without_weights

QUANTS = [
    QuantConfig(quant="bnb"),
    QuantConfig(quant="bnb", bnb_double_quant=False, bnb_quant_type="fp4"),
    *(QuantConfig(quant="hqq", hqq_bits=bits, hqq_group_size=group) for bits in (1, 2, 3, 4, 8) for group in (8, 64)),
]


@pytest.mark.parametrize(
    "quant", QUANTS, ids=lambda q: f"{q.quant}-{q.hqq_bits if q.quant == 'hqq' else q.bnb_quant_type}"
)
def test_planned_is_what_quantize_makes(quant: QuantConfig) -> None:
    """Shapes, dtypes and packing metadata of every tensor, for weights that split into blocks or groups and not."""
    backend = make_backend(quant, storage_dtype=torch.uint8, compute_dtype=torch.bfloat16)
    for shape in [(96, 40), (300, 77), (17, 1000), (1, 3)]:
        real = backend.quantize(torch.randn(*shape))
        planned = backend.planned(torch.Size(shape))
        assert planned.packed.is_meta and all(t.is_meta for t in planned.state.values())
        assert (planned.packed.shape, planned.packed.dtype) == (real.packed.shape, real.packed.dtype), shape
        assert {k: (t.shape, t.dtype) for k, t in planned.state.items()} == {
            k: (t.shape, t.dtype) for k, t in real.state.items()
        }, shape
        packing = {k: v for k, v in real.meta.items() if k.startswith("packed_")}
        assert {k: v for k, v in planned.meta.items() if k.startswith("packed_")} == packing


def _plan(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = main(args)
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc_per_node", "2"], "--model is required"),
        (["--model", "{model}", "--nproc_per_node", "0", "--nnodes", "0"], "--nproc_per_node must be >= 1"),
        (["--model", "{model}", "--gpu_memory_gib", "-1"], "--gpu_memory_gib must be >= 0"),
        (["--model", "{model}", "--lora_rnk", "8"], "unrecognized arguments: --lora_rnk"),
        (
            ["--model", "{model}", "--train_type", "full"],
            "--train_type full trains every weight",
        ),
        (["--model", "{model}", "--nproc_per_node", "2", "--world_size", "4"], "--world_size 4 but --nnodes 1"),
        (["--model", "{model}", "--nproc_per_node", "3", "--sequence_parallel_size", "2"], "does not divide"),
        (["--model", "{model}/missing"], "no such model directory"),
    ],
    ids=["no-model", "bad-ranks", "bad-memory", "unknown-flag", "train-combination", "world-size", "mesh", "path"],
)
def test_bad_input_is_one_line(
    tiny_model: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    status, out, err = _plan([a.format(model=tiny_model) for a in args], capsys)
    assert status == 2 and not out
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_table_without_weights(tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The config alone plans what the whole checkpoint does; the table labels itself planned, lists each part per
    rank, the exact bytes, and the verdict against --gpu_memory_gib."""
    args = ["--nproc_per_node", "2", "--lora_rank", "8", "--gpu_memory_gib", "0.001"]
    status, with_weights, _ = _plan(["--model", str(tiny_model), *args], capsys)
    assert status == 0
    status, out, _ = _plan(["--model", str(without_weights(tiny_model, tmp_path / "config-only")), *args], capsys)
    assert status == 0
    exact = re.search(r"^parameter bytes per rank: \[(\d+), (\d+)\]$", out, re.M)
    assert exact is not None and exact.group(0) in with_weights
    assert out.startswith("PLANNED, not measured: ")
    header = next(line for line in out.splitlines() if line.startswith("MiB"))
    assert header.split()[1:] == ["rank", "0", "rank", "1"]
    for label in ("quantized weights (packed)", "quantization state", "adapters (trainable)", "optimizer state",
                  "activations (estimate)", "= on each GPU"):  # fmt: skip
        assert re.search(rf"^{re.escape(label)}\s+\d+\.\d\d\s+\d+\.\d\d$", out, re.M), label
    assert re.search(r"^does not fit: the fullest rank needs \d+\.\d\d GiB of 0\.001 GiB \(short by", out, re.M)
