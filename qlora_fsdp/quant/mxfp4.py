"""MXFP4 experts kept as released (gpt-oss, and DeepSeek-V4's FP4 experts with E8M0 scales: the same bytes): the
frozen base of each routed expert is the checkpoint's own packed e2m1 values and power-of-two block scales, 4.25 bits
a weight, dequantized in torch when the expert runs. The decoding of e2m1 values and E8M0 scales lives here for every
checkpoint format that stores them.

Not a --quant backend: nothing here quantizes. A checkpoint in MXFP4 (qlora_fsdp/model/formats/mxfp4.py), or an FP8
one with FP4 experts (formats/fp8.py), fills these layers with its bytes when --mxfp4 keep (the default); every other
linear is quantized with --quant as usual.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from qlora_fsdp.quant.base import DequantizeMatmul, QuantizedLinear, QuantizedWeight

BLOCK = 32
"""Values sharing one scale, along the input dimension: 16 bytes of two e2m1 values each."""
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The value of each 4-bit code (OCP microscaling formats, e2m1)."""


@functools.cache
def _byte_values(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 2]: the two e2m1 values each byte holds, low nibble first, in `dtype` on `device`: made once per
    device and dtype (a table built on each call would be a host-to-device copy on a GPU every time)."""
    values = torch.tensor(E2M1, dtype=torch.float32)
    byte = torch.arange(256)
    return torch.stack([values[byte & 0x0F], values[byte >> 4]], dim=-1).to(device=device, dtype=dtype)


def e2m1_values(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Bytes of two e2m1 codes each, low nibble first (uint8, or DeepSeek-V4's int8: the same bytes), as values in
    `dtype` (every e2m1 value is exact in any float dtype): [..., n] bytes to [..., 2n] values. Each byte looks up
    its pair at once, indexed as int32: 2 bytes of index per value beside the result."""
    table = _byte_values(packed.device, dtype)
    return F.embedding(packed.view(torch.uint8).int(), table).flatten(-2)


def e8m0_values(exponents: torch.Tensor) -> torch.Tensor:
    """E8M0 scales (float8_e8m0fnu, or its bytes as uint8) as float32 powers of two, 2^(byte - 127): exact."""
    exponents = exponents.view(torch.uint8).to(torch.int32) - 127
    return torch.ldexp(torch.ones(exponents.shape, device=exponents.device), exponents)


EXACT_SCALING = (torch.float32, torch.bfloat16)
"""Dtypes that hold every E8M0 power of two (float32's exponent range): values are scaled in them directly."""


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., rows, groups, 16] codes (low nibble first) and [..., rows, groups] E8M0 exponents to
    [..., rows, groups x 32] values in `dtype`: each code's value times its power of two, exact in any float dtype
    wide enough for the exponent. Scaled in place in the result's dtype where it holds every power of two (float32,
    bfloat16), so the temporaries beside the result are the int32 index (half the result in bf16) and the scales;
    in float32 otherwise (float16 would overflow on a power of two the product fits)."""
    work = dtype if dtype in EXACT_SCALING else torch.float32
    values = e2m1_values(blocks, work).view(*blocks.shape[:-1], 2 * blocks.shape[-1])
    values.mul_(e8m0_values(scales).to(work).unsqueeze(-1))
    return values.flatten(-2).to(dtype)


class Mxfp4Linear(QuantizedLinear):
    """One expert's projection held as the checkpoint's MXFP4 blocks ([out, in/32, 16] bytes) and scales."""

    def _dequantize(self) -> torch.Tensor:
        groups = self.in_features // BLOCK
        blocks = self.packed_bytes().view(self.out_features, groups, BLOCK // 2)
        return dequantize_mxfp4(blocks, self.state_tensor("scales"), self.compute_dtype)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        out = DequantizeMatmul.apply(x.to(self.compute_dtype), self)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.to(x.dtype)

    def serialized(self) -> dict[str, torch.Tensor]:
        raise ValueError("an MXFP4 expert has no single-layer format of its own: export the merged model instead")


def planned_mxfp4(shape: torch.Size) -> QuantizedWeight:
    """What a kept expert of `shape` ([out, in]) holds, as meta tensors: half a byte a value and a byte of scale per
    32 values (scripts/plan.py sizes a model without its weights from this)."""
    out_features, in_features = shape
    packed = torch.empty(out_features * in_features // 2, dtype=torch.uint8, device="meta")
    scales = torch.empty(out_features, in_features // BLOCK, dtype=torch.uint8, device="meta")
    return QuantizedWeight(packed, {"scales": scales})


def mxfp4_layer(
    linear: nn.Linear, *, storage_dtype: torch.dtype, compute_dtype: torch.dtype, shard_state: bool = False
) -> Mxfp4Linear:
    """An empty (meta) kept-MXFP4 replacement for one expert's `linear`, in the FSDP version's packed layout."""
    if linear.in_features % BLOCK:
        raise ValueError(f"an MXFP4 weight's input dimension is whole blocks of {BLOCK}, not {linear.in_features}")
    return Mxfp4Linear(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        storage_dtype=storage_dtype,
        compute_dtype=compute_dtype,
        shard_state=shard_state,
    )
