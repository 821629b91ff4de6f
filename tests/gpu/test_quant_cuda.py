"""Each backend's quantized layer on CUDA against the CPU: the same packed bytes and state, quantized once on the
CPU, give the same dequantized weight, forward output and input gradient on both devices."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qlora_fsdp.checkpoint.manifest import layer_digests
from qlora_fsdp.config.options import QuantConfig
from qlora_fsdp.quant import make_backend
from qlora_fsdp.quant.base import QuantizedLinear, QuantizedWeight

pytestmark = pytest.mark.gpu

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
IN, OUT = 256, 128
# bf16 sums on the two devices in other orders; fp32 with TF32 off agrees to rounding.
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 2e-3}}


def _on(device: torch.device, quantized: QuantizedWeight) -> QuantizedWeight:
    state = {name: t.to(device) for name, t in quantized.state.items()}
    return QuantizedWeight(quantized.packed.to(device), state, dict(quantized.meta))


def pair(quant: str, compute: torch.dtype) -> tuple[QuantizedLinear, QuantizedLinear]:
    """(CPU layer, CUDA layer) holding the bytes the CPU quantized, and the same bias."""
    backend = make_backend(QuantConfig(quant=quant), storage_dtype=torch.uint8, compute_dtype=compute)
    assert backend is not None
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(OUT, IN, generator=gen) * 0.02
    bias = torch.randn(OUT, generator=gen) * 0.1
    quantized = backend.quantize(weight)
    layers = []
    for device in (CPU, CUDA):
        layer = backend.make_module(nn.Linear(IN, OUT, bias=True, device="meta"))
        layer.set_quantized(_on(device, quantized))
        layer.bias = nn.Parameter(bias.to(device), requires_grad=False)
        layers.append(layer)
    assert torch.equal(layers[1].packed_bytes().cpu(), layers[0].packed_bytes())
    return layers[0], layers[1]


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_quantized_layer_on_cuda_computes_what_the_cpu_does(quant: str, compute: torch.dtype, fp32_matmuls) -> None:
    cpu, cuda = pair(quant, compute)
    torch.testing.assert_close(cuda.dequantize().cpu(), cpu.dequantize())
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, IN, generator=gen, dtype=compute)
    grad_out = torch.randn(4, 3, OUT, generator=gen, dtype=compute)
    results = []
    for layer, device in ((cpu, CPU), (cuda, CUDA)):
        inputs = x.to(device).requires_grad_(True)
        out = layer(inputs)
        out.backward(grad_out.to(device))
        assert out.device.type == device.type and out.dtype == compute
        results.append((out.detach().cpu(), inputs.grad.cpu()))
    (out_cpu, grad_cpu), (out_cuda, grad_cuda) = results
    torch.testing.assert_close(out_cuda, out_cpu, **TOLERANCE[compute])
    torch.testing.assert_close(grad_cuda, grad_cpu, **TOLERANCE[compute])
    assert out_cpu.abs().mean() > 0.1 and grad_cpu.abs().mean() > 0.1  # figures worth comparing


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_digests_are_the_same_on_cuda(quant: str) -> None:
    """The manifest's layer digests hash bytes: a layer moved to CUDA digests as it does on the CPU."""
    cpu, cuda = pair(quant, torch.float32)
    assert layer_digests(cuda) == layer_digests(cpu)
