"""FP8 checkpoints (config.json `quant_method: fp8`): how DeepSeek-V3/R1, Kimi K2, MiniMax-M2 and the -FP8 releases
ship. Each quantized weight is float8 (e4m3) with a float32 `weight_scale_inv` per block of `weight_block_size`
(or one per tensor); it is dequantized as it arrives, then quantized with --quant like any dense weight.

Dequantized, not kept: no backend here computes in FP8, and a rank holds one dequantized weight (or one layer's
experts, waiting to be fused) at a time, as it would reading the bf16 release.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from qlora_fsdp.config.options import QuantConfig
from qlora_fsdp.errors import UserError
from qlora_fsdp.model.formats.base import ShardedFiles, Stored, grouped, weight_names
from qlora_fsdp.model.formats.files import FP8_DTYPES, SAFETENSORS_DTYPES, read_tensors, safetensors_header

SCALE = "_scale_inv"
"""A quantized weight `X.weight`'s scales are `X.weight_scale_inv`."""
DROPPED = ("input_scale", "activation_scale")
"""Static activation scales: for FP8 matmuls at inference; a dequantized model has no use for them."""


class Fp8Format(ShardedFiles):
    """FP8 weights with their scales, dequantized to the checkpoint's own dtype as each pair completes."""

    def __init__(self, config: dict[str, Any], path: Path) -> None:
        self.block = config["quantization_config"].get("weight_block_size")
        self.dtype = getattr(torch, config.get("dtype") or config.get("torch_dtype") or "bfloat16")

    @staticmethod
    def detect(config: dict[str, Any], path: Path) -> bool:
        return (config.get("quantization_config") or {}).get("quant_method") == "fp8"

    def names(self, files: list[Path]) -> list[str]:
        names = weight_names(files)
        _scaled(files, names)
        return [n for n in names if not n.endswith(SCALE) and not n.endswith(DROPPED)]

    def tensors(self, files: list[Path]) -> Iterator[tuple[str, Stored]]:
        group_of = {}
        for weight in _scaled(files, weight_names(files)):
            group_of[weight] = group_of[weight + SCALE] = weight

        def dequantized(weight: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
            return dequantize_fp8(parts[weight], parts[weight + SCALE], self.block, self.dtype)

        stream = (
            (n, t) for file in files for n, t in read_tensors(file, SAFETENSORS_DTYPES | FP8_DTYPES)
            if not n.endswith(DROPPED)
        )  # fmt: skip
        yield from grouped(stream, group_of, dequantized)

    def kept_experts(self, quant: QuantConfig) -> None:
        return None

    def quant_settings(self, quant: QuantConfig, given: frozenset[str]) -> QuantConfig:
        return quant


def _scaled(files: list[Path], names: list[str]) -> list[str]:
    """The weights stored in FP8, each with its scales; refuses a checkpoint where one lacks the other."""
    present = set(names)
    scaled = [n.removesuffix(SCALE) for n in names if n.endswith(SCALE)]
    fp8 = {n for f in files if f.suffix == ".safetensors" for n, info in safetensors_header(f)[1].items()
           if info["dtype"] in FP8_DTYPES}  # fmt: skip
    lacking = sorted((fp8 - set(scaled)) | {n + SCALE for n in scaled if n not in present})
    if lacking:
        what = "scales" if lacking[0] in fp8 else "weight"
        raise UserError(
            f"--model {files[0].parent}: the FP8 checkpoint is incomplete: {lacking[0]} has no {what} "
            f"({len(lacking)} such); re-download it"
        )
    return scaled


CHUNK_VALUES = 1 << 24
"""Values dequantized at a time (64 MiB in float32): a weight's float32 copy would be 4 bytes a value at once."""


def dequantize_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: list[int] | None, dtype: torch.dtype
) -> torch.Tensor:
    """`weight` in `dtype`: each fp8 value times its block's scale (one scale: the whole tensor's), computed in
    float32 as transformers does, a few blocks of rows at a time. Blocks are `block` rows x columns, the last ones
    cut short where the weight does not divide; scales stored as bytes are E8M0 powers of two."""
    scales = (scale_inv.float() - 127).exp2() if scale_inv.dtype == torch.uint8 else scale_inv.float()
    rows, cols = weight.shape[-2:]
    if scales.numel() == 1:
        scales, block = scales.reshape(1, 1), [rows, cols]
    elif block is None:
        block = [-(-rows // scales.shape[-2]), -(-cols // scales.shape[-1])]
    per_row = weight[..., :1, :].numel()  # a row of every leading index (each expert's, for fused experts)
    step = max(1, CHUNK_VALUES // (per_row * block[0])) * block[0]
    out = torch.empty(weight.shape, dtype=dtype)
    for start in range(0, rows, step):
        part = weight[..., start : start + step, :].float()
        grid = scales[..., start // block[0] : -(-(start + part.shape[-2]) // block[0]), :]
        grid = grid.repeat_interleave(block[0], dim=-2)[..., : part.shape[-2], :]
        out[..., start : start + step, :] = part.mul_(grid.repeat_interleave(block[1], dim=-1)[..., :cols])
    return out
