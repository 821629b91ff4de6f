"""qlora_fsdp.parallel.sharding without a process group: precision modes and verify_packed's verdicts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qlora_fsdp.config.options import QuantConfig
from qlora_fsdp.parallel.precision import PRECISIONS
from qlora_fsdp.parallel.sharding import PackedWeightsChanged, packed_digest, verify_packed
from qlora_fsdp.quant import make_backend


def test_mp_bf16_is_fp32_storage_cast_to_bf16_with_fp32_reduction() -> None:
    mode = PRECISIONS["mp_bf16"]
    assert mode.param_dtype == torch.float32 and mode.mixed_precision == (torch.bfloat16, torch.float32, torch.float32)
    assert mode.compute_dtype == torch.bfloat16 and mode.autocast_dtype is None
    # The other modes never cast a stored parameter: only mp_bf16 makes the quantized-layer exclusion necessary.
    casting = [name for name, m in PRECISIONS.items() if m.mixed_precision and m.mixed_precision[0] != m.param_dtype]
    assert casting == ["mp_bf16"]


def guarded(quant: str, storage: torch.dtype) -> nn.Sequential:
    backend = make_backend(QuantConfig(quant=quant), storage_dtype=storage, compute_dtype=torch.float32)
    layer = backend.make_module(nn.Linear(64, 32, bias=False, device="meta"))
    backend.load_weight(layer, torch.randn(32, 64) * 0.02, device=torch.device("cpu"))
    model = nn.Sequential(layer)
    verify_packed(model, {id(layer): ("model.q_proj", packed_digest(layer))})
    return model


@pytest.mark.parametrize("storage", [torch.uint8, torch.bfloat16], ids=["uint8", "bf16"])
@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_verify_packed_passes_untouched_bytes_once(quant: str, storage: torch.dtype) -> None:
    model = guarded(quant, storage)
    model(torch.randn(2, 64))
    # The check ran once and removed itself: a later change is not its business (nor worth a digest per step).
    model[0].weight.data.view(torch.uint8)[0] ^= 0xFF
    model(torch.randn(2, 64))


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_verify_packed_names_the_layer_whose_bytes_changed(quant: str) -> None:
    model = guarded(quant, torch.uint8)
    model[0].weight.data[3] ^= 0x01  # one flipped bit: same dtype, same size
    with pytest.raises(PackedWeightsChanged, match=r"of model\.q_proj .*\(bytes differ\)"):
        model(torch.randn(2, 64))


def test_verify_packed_sees_a_change_in_the_quantization_state() -> None:
    model = guarded("bnb", torch.uint8)
    model[0].absmax.data[0] ^= 0x01
    with pytest.raises(PackedWeightsChanged, match="bytes differ"):
        model(torch.randn(2, 64))


def test_verify_packed_names_a_cast_by_its_dtypes() -> None:
    model = guarded("hqq", torch.float32)
    layer = model[0]
    layer.weight = nn.Parameter(layer.weight.data.to(torch.bfloat16), requires_grad=False)  # what a policy does
    with pytest.raises(PackedWeightsChanged, match=r"packed dtype torch\.bfloat16, was torch\.float32"):
        model(torch.randn(2, 64))
