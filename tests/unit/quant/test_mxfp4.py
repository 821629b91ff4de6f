"""qlora_fsdp/quant/mxfp4.py: the decoding every MXFP4 and FP4 reader shares, against transformers' own."""

from __future__ import annotations

import pytest
import torch

from qlora_fsdp.quant.mxfp4 import dequantize_mxfp4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_dequantize_mxfp4_is_transformers_bit_for_bit(dtype: torch.dtype) -> None:
    """Every byte (both nibbles, both signs of zero) under scales from the smallest to the largest power of two a
    row can hold, against transformers' `convert_moe_packed_tensors` (which returns [experts, in, out]): the same
    bits in each dtype, float16's range included (its scaling runs in float32)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 16, 8, 16), dtype=torch.uint8, generator=generator)
    blocks[0, 0] = torch.arange(128, dtype=torch.uint8).view(8, 16)  # every byte value, twice over the rows
    blocks[0, 1] = torch.arange(128, 256, dtype=torch.uint8).view(8, 16)
    low = {torch.float16: 112, torch.bfloat16: 1, torch.float32: 1}[dtype]  # the smallest power the dtype holds
    scales = torch.randint(low, 140, (2, 16, 8), dtype=torch.uint8, generator=generator)
    ours = dequantize_mxfp4(blocks, scales, dtype)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
    assert ours.dtype == dtype and ours.shape == theirs.shape == (2, 16, 256)
    assert torch.equal(ours, theirs)
    assert torch.equal(torch.signbit(ours), torch.signbit(theirs))  # -0.0 stays negative
