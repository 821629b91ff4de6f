"""Training code on CUDA: 1-process FSDP2 runs (SFT and DPO) against the same runs on the CPU (fp32), verify_packed
on CUDA, and export after a CUDA run reproducing the packed bytes training used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from qlora_fsdp.config.options import QuantConfig, build_config
from qlora_fsdp.model.skeleton import build_skeleton
from qlora_fsdp.model.streaming import stream_weights
from qlora_fsdp.parallel.sharding import PackedWeightsChanged, packed_digest, verify_packed
from qlora_fsdp.quant import make_backend
from qlora_fsdp.quant.base import QuantizedLinear
from qlora_fsdp.train.metrics import read_metrics
from qlora_fsdp.train.trainer import run
from scripts import export_quantized

pytestmark = pytest.mark.gpu

DATASET = str(Path(__file__).resolve().parents[2] / "data" / "alpaca_tiny.jsonl")
PAIRS = str(Path(__file__).resolve().parents[2] / "data" / "preference_tiny.jsonl")
# SGD, not Adam: Adam's first step moves every weight by lr whatever the size of its gradient, so the sign of a
# gradient that is zero up to rounding would decide it; SGD's step is continuous in the gradient.
FLAGS = {
    "dataset": DATASET, "dataset_samples": 4, "batch_size": 2, "context_length": 64, "max_steps": 2,
    "optimizer": "sgd", "lr": 0.5, "lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.0, "log_to": "stdout",
    "precision": "fp32", "quant": "bnb", "fsdp_version": 2, "seed": 1,
}  # fmt: skip


def train(device: str, out: Path, **flags: object) -> list[dict]:
    """One process of train.py's code on `device`; its per-step metrics."""
    cfg = build_config({**FLAGS, **flags, "device": device, "output_dir": str(out)}).validate()
    with pytest.MonkeyPatch.context() as patch:
        # A fresh rendezvous port per run: the previous run tore its process group down with its store.
        patch.delenv("MASTER_ADDR", raising=False)
        patch.delenv("MASTER_PORT", raising=False)
        run(cfg)
    return [m for m in read_metrics(out) if "loss" in m]


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # no TF32: both runs are fp32
    try:
        return {
            device: train(device, tmp_path_factory.mktemp(f"run-{device}"), model=str(tiny_model))
            for device in ("cpu", "cuda")
        }
    finally:
        torch.set_float32_matmul_precision(previous)


def test_fsdp2_step_on_cuda_matches_the_cpu_in_fp32(runs: dict[str, list[dict]]) -> None:
    cpu, cuda = runs["cpu"], runs["cuda"]
    assert len(cpu) == len(cuda) == FLAGS["max_steps"]
    for step, (c, g) in enumerate(zip(cpu, cuda, strict=True), start=1):
        assert g["loss"] == pytest.approx(c["loss"], rel=1e-4), step
        assert g["grad_norm"] == pytest.approx(c["grad_norm"], rel=1e-3), step
        assert c["grad_norm"] > 0
    assert cuda[1]["loss"] != cuda[0]["loss"]  # the first step changed the adapters, on both devices alike


@pytest.fixture(scope="module")
def dpo_runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        flags = {"model": str(tiny_model), "dataset": PAIRS, "objective": "dpo", "optimizer": "adamw", "lr": 0.01}
        return {device: train(device, tmp_path_factory.mktemp(f"dpo-{device}"), **flags) for device in ("cpu", "cuda")}
    finally:
        torch.set_float32_matmul_precision(previous)


def test_dpo_step_on_cuda_matches_the_cpu_in_fp32(dpo_runs: dict[str, list[dict]]) -> None:
    """DPO's reference forward (adapters off, no_grad) and policy forward in one step on CUDA: the first loss is
    ln 2 and both steps equal the CPU's."""
    cpu, cuda = dpo_runs["cpu"], dpo_runs["cuda"]
    assert abs(cuda[0]["loss"] - 0.6931471805599453) < 1e-6
    for step, (c, g) in enumerate(zip(cpu, cuda, strict=True), start=1):
        for key in ("loss", "rewards/margins", "logps/chosen"):
            assert g[key] == pytest.approx(c[key], rel=1e-4, abs=1e-6), (step, key)
        assert g["grad_norm"] == pytest.approx(c["grad_norm"], rel=1e-3), step


def guarded(quant: str, storage: torch.dtype, *, shard_state: bool = False) -> nn.Sequential:
    """One layer quantized on CUDA, with verify_packed's check armed for its first forward."""
    backend = make_backend(
        QuantConfig(quant=quant), storage_dtype=storage, compute_dtype=torch.float32, shard_state=shard_state
    )
    layer = backend.make_module(nn.Linear(128, 64, bias=False, device="meta"))
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 0.02
    backend.load_weight(layer, weight, device=torch.device("cuda"))
    assert layer.weight.is_cuda
    model = nn.Sequential(layer)
    verify_packed(model, {id(layer): ("model.q_proj", packed_digest(layer))})
    return model


# The packed layouts: FSDP2 on torch 2.12+, FSDP2 before 2.12 (bytes and state viewed as bf16), FSDP1.
LAYOUTS = [(torch.uint8, False), (torch.bfloat16, True), (torch.bfloat16, False)]


@pytest.mark.parametrize(("storage", "shard_state"), LAYOUTS, ids=["uint8", "bf16-view", "bf16-fsdp1"])
@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_verify_packed_on_cuda(quant: str, storage: torch.dtype, shard_state: bool) -> None:
    x = torch.randn(2, 128, device="cuda")
    guarded(quant, storage, shard_state=shard_state)(x)  # untouched bytes pass
    model = guarded(quant, storage, shard_state=shard_state)
    model[0].weight.data.view(torch.uint8)[3] ^= 0x01  # one flipped bit: same dtype, same size
    with pytest.raises(PackedWeightsChanged, match=r"of model\.q_proj .*\(bytes differ\)"):
        model(x)
    model = guarded(quant, storage, shard_state=shard_state)
    packed = model[0].weight.data.view(torch.uint8)
    other = int((packed != packed[0]).nonzero()[0])
    packed[[0, other]] = packed[[other, 0]].clone()  # the same bytes in another order
    with pytest.raises(PackedWeightsChanged, match="bytes differ"):
        model(x)


def test_verify_packed_on_cuda_sees_a_change_in_the_quantization_state() -> None:
    model = guarded("bnb", torch.uint8)
    model[0].absmax.data[0] ^= 0x01
    with pytest.raises(PackedWeightsChanged, match="bytes differ"):
        model(torch.randn(2, 128, device="cuda"))


def cuda_packed(model_dir: Path, quant: str) -> dict[str, torch.Tensor]:
    """Each quantized layer's packed bytes as loading on CUDA makes them for training (fp32, one process)."""
    cfg = build_config({"model": str(model_dir), "quant": quant, "precision": "fp32"}).validate()
    backend = make_backend(cfg.quant, storage_dtype=torch.uint8, compute_dtype=torch.float32)
    skeleton = build_skeleton(cfg.model, backend=backend, param_dtype=torch.float32)
    stream_weights(skeleton, backend=backend, device=torch.device("cuda"))
    return {
        name: module.packed_bytes().cpu()
        for name, module in skeleton.model.named_modules()
        if isinstance(module, QuantizedLinear)
    }


@pytest.mark.parametrize(
    "quant",
    [
        "bnb",
        pytest.param(
            "hqq",
            marks=pytest.mark.xfail(
                reason="export quantizes on the CPU, and HQQ's optimizer runs in fp16 on CUDA but fp32 on the CPU "
                "(issue 16, item 5: the training manifest)"
            ),
        ),
    ],
)
def test_export_after_a_cuda_run_reproduces_the_packed_bytes(
    runs: dict[str, list[dict]], tiny_model: Path, tmp_path: Path, quant: str
) -> None:
    assert runs["cuda"], "the CUDA run trained"
    expected = cuda_packed(tiny_model, quant)
    assert expected
    out = tmp_path / "export"
    args = ["--model", str(tiny_model), "--quant", quant, "--precision", "fp32", "--output", str(out)]
    assert export_quantized.main(args) == 0
    if quant == "bnb":
        files = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        stored = {}
        for name in expected:
            with safe_open(str(out / files[f"{name}.weight"]), framework="pt") as f:
                stored[name] = f.get_tensor(f"{name}.weight").flatten().view(torch.uint8)
    else:
        saved = torch.load(out / "qmodel.pt", weights_only=True)
        stored = {name: saved[name]["W_q"].flatten().view(torch.uint8) for name in expected}
    differ = [name for name, packed in expected.items() if not torch.equal(stored[name], packed)]
    assert not differ, f"{len(differ)} of {len(expected)} layers hold other bytes than training, e.g. {differ[0]}"
