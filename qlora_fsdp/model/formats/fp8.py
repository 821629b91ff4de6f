"""FP8 checkpoints (config.json `quant_method: fp8`): how DeepSeek-V3/R1/V4, Kimi K2, MiniMax-M2 and the -FP8
releases ship. Each quantized weight is float8 (e4m3) with its scales beside it (`X.weight_scale_inv`, or `X.scale`
as DeepSeek-V4 names them): one per block of `weight_block_size` (the last blocks cut short where the weight does not
divide: DeepSeek-V3's 576 x 7168 weights have 5 x 56 scales at 128) or one per tensor, float32 or, as DeepSeek-V4
stores them (`scale_fmt: ue8m0`), E8M0 powers of two. With `expert_dtype: fp4` (DeepSeek-V4) the routed experts are
FP4 instead: int8 bytes of two e2m1 values each, low nibble first, with one E8M0 scale per 32 values of a row.

Dense FP8 weights are dequantized as they arrive, to the checkpoint's own dtype, then quantized with --quant like any
dense weight: no backend here computes in FP8, and a rank holds one dequantized weight (or one layer's experts,
waiting to be fused) at a time, as it would reading the bf16 release. FP4 experts with E8M0 scales are gpt-oss's
MXFP4 row for row, so --mxfp4 keep (the default) holds them as the frozen base, bit for bit
(qlora_fsdp/quant/mxfp4.py), and --mxfp4 dequantize decodes them exactly.

Every scaled weight's dtype and scale grid are checked against config.json before any weight is read: a weight
stored otherwise is refused in one line rather than multiplied as whatever its bytes would mean.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qlora_fsdp.config.options import QuantConfig
from qlora_fsdp.errors import UserError
from qlora_fsdp.model.formats.base import ShardedFiles, Stored, grouped, weight_names
from qlora_fsdp.model.formats.files import FP8_DTYPES, SAFETENSORS_DTYPES, Lazy, safetensors_header, tensor_refs
from qlora_fsdp.model.formats.mxfp4 import Mxfp4Weight
from qlora_fsdp.quant.base import QuantizedLinear
from qlora_fsdp.quant.mxfp4 import BLOCK, e2m1_values, e8m0_values, mxfp4_layer

SCALE = "_scale_inv"
"""A quantized tensor `X`'s scales are `X_scale_inv` (`X.weight_scale_inv` for `X.weight`)."""
RENAMED_SCALES = ("scale", "qscale_weight")
"""Other names of `X.weight`'s scales, `X.scale` (DeepSeek-V4) and `X.qscale_weight` (Mistral), which transformers'
FP8 loading renames to `X.weight_scale_inv`."""
DROPPED = ("input_scale", "activation_scale")
"""Static activation scales: for FP8 matmuls at inference; a dequantized model has no use for them."""
DEFAULT_BLOCK = [128, 128]
"""transformers' `weight_block_size` where config.json names none (FineGrainedFP8Config's default)."""
E8M0 = (torch.float8_e8m0fnu, torch.uint8)
"""E8M0 scales as torch stores them, or as their bytes (read so only where config.json says `scale_fmt: ue8m0`)."""
FP8 = tuple(dtype for dtype in FP8_DTYPES.values() if dtype not in E8M0)
FLOAT_SCALES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class _Scaled:
    """How one quantized tensor is stored, checked against config.json."""

    scale: str
    """The name its scales are stored under."""
    block: tuple[int, int] | None
    """Values per scale, rows x columns (None: one scale for the whole tensor)."""
    fp4: bool
    """int8 bytes of two e2m1 values each (expert_dtype fp4), rather than float8."""


class Fp8Format(ShardedFiles):
    """FP8 weights with their scales, dequantized to the checkpoint's own dtype as each pair completes; FP4 experts
    with E8M0 scales yielded as MXFP4 weights, kept or decoded where they land."""

    def __init__(self, config: dict[str, Any], path: Path) -> None:
        quant = config["quantization_config"]
        self.block = quant.get("weight_block_size", DEFAULT_BLOCK)
        self.ue8m0 = quant.get("scale_fmt") == "ue8m0"
        # DeepSeek-V4 declares it beside the quantization config, V4.1 inside it (transformers moves it there).
        self.fp4_experts = (quant.get("expert_dtype") or config.get("expert_dtype")) == "fp4"
        self.dtype = getattr(torch, config.get("dtype") or config.get("torch_dtype") or "bfloat16")

    @staticmethod
    def detect(config: dict[str, Any], path: Path) -> bool:
        return (config.get("quantization_config") or {}).get("quant_method") == "fp8"

    def names(self, files: list[Path]) -> list[str]:
        scales = {how.scale for how in self._scaled(files).values()}
        return [n for n in weight_names(files) if n not in scales and not n.endswith(DROPPED)]

    def tensors(self, files: list[Path]) -> Iterator[tuple[str, Stored]]:
        scaled = self._scaled(files)
        group_of = {}
        for weight, how in scaled.items():
            group_of[weight] = group_of[how.scale] = weight

        def combine(weight: str, refs: dict[str, Lazy]) -> Stored:
            how = scaled[weight]
            values, scales = refs[weight], refs[how.scale]
            if how.fp4 and len(values.shape) == 2 and scales.dtype in E8M0:  # MXFP4: kept or decoded where it lands
                blocks = values.read().view(torch.uint8).view(values.shape[0], -1, BLOCK // 2)
                return Mxfp4Weight(blocks, scales.read().view(torch.uint8))
            return Fp8Values(values, scales, how.block, self.dtype)

        stream = (
            (n, t) for file in files for n, t in tensor_refs(file, SAFETENSORS_DTYPES | FP8_DTYPES)
            if not n.endswith(DROPPED)
        )  # fmt: skip
        yield from grouped(stream, group_of, combine)

    def kept_experts(self, quant: QuantConfig) -> Callable[..., QuantizedLinear] | None:
        """FP4 experts kept as MXFP4 with --mxfp4 keep: each arrives so where its scales are E8M0; one with other
        scales is refused where it lands (a plain tensor for a kept layer), pointing to --mxfp4 dequantize."""
        return mxfp4_layer if self.fp4_experts and quant.mxfp4 == "keep" else None

    def quant_settings(self, quant: QuantConfig, given: frozenset[str]) -> QuantConfig:
        return quant

    def _scaled(self, files: list[Path]) -> dict[str, _Scaled]:
        """Each tensor stored quantized -> how; refuses a checkpoint where one lacks its scales or they lack their
        tensor, or where a tensor or its scales are not stored as config.json declares."""
        where = files[0].parent
        layouts = _layouts(files)
        scaled = {}
        for name, (dtype, _) in layouts.items():
            scale = next((s for s in _scale_names(name) if s in layouts), None)
            if scale is not None:
                scaled[name] = self._check(where, name, scale, layouts)
            elif dtype in FP8:
                raise UserError(f"--model {where}: the FP8 checkpoint is incomplete: {name} has no scales; "
                                "re-download it")  # fmt: skip
        orphan = next((n for n in layouts if n.endswith(SCALE) and n.removesuffix(SCALE) not in layouts), None)
        if orphan is not None:
            raise UserError(f"--model {where}: the FP8 checkpoint is incomplete: {orphan} has no weight; "
                            "re-download it")  # fmt: skip
        return scaled

    def _check(self, where: Path, name: str, scale: str, layouts: dict[str, tuple]) -> _Scaled:
        """How `name` is stored with its scales `scale`, or a one-line refusal naming what was expected and found."""
        (dtype, shape), (scale_dtype, grid) = layouts[name], layouts[scale]
        fp4 = dtype == torch.int8 and self.fp4_experts
        if (dtype not in FP8 and not fp4) or len(shape) < 2:
            also = ", or int8 holding FP4 (expert_dtype fp4)" if self.fp4_experts else ""
            raise UserError(
                f"--model {where}: {name} has scales ({scale}) but is stored as {_dtype_name(dtype)} "
                f"{list(shape)}: expected a float8 matrix (e4m3 or e5m2){also}, as config.json's quantization_config "
                "declares; the checkpoint does not match its config.json"
            )
        if scale_dtype not in FLOAT_SCALES + E8M0 or (scale_dtype == torch.uint8 and not self.ue8m0):
            raise UserError(
                f"--model {where}: {scale}, the scales of {name}, is stored as {_dtype_name(scale_dtype)}: expected "
                "float32, bfloat16 or float16 scales, or E8M0 ones (float8_e8m0fnu, or uint8 bytes where "
                "quantization_config says scale_fmt ue8m0)"
            )
        rows, cols = shape[-2], shape[-1] * (2 if fp4 else 1)
        # One scale can only mean one per tensor, whatever the block; a grid must be the declared block's. Without a
        # declared block, a grid of whole parts is one scale per part: transformers' fused FP8 experts hold one per
        # expert ([E, 1, 1]), or per expert and gate or up half ([E, 2, 1]).
        if fp4:
            block, declared = (1, BLOCK), "FP4's 1 x 32"
        elif torch.Size(grid).numel() == 1:
            block, declared = None, "one scale per tensor"
        elif self.block is None:
            parts = grid[-2:] if len(grid) == len(shape) and rows % grid[-2] == 0 and cols % grid[-1] == 0 else (1, 1)
            block, declared = (rows // parts[0], cols // parts[1]), "weight_block_size null: one scale per part"
        else:
            block, declared = (self.block[0], self.block[1]), "weight_block_size"
        if block is None:
            expected, fits = [1], torch.Size(grid).numel() == 1
        else:
            expected = [*shape[:-2], -(-rows // block[0]), -(-cols // block[1])]
            fits = list(grid) == expected and (not fp4 or cols % BLOCK == 0)
        if not fits:
            raise UserError(
                f"--model {where}: {scale} holds {list(grid)} scales, but {name} {list(shape)} ({rows} x {cols} "
                f"values) in blocks of {list(block or [rows, cols])} ({declared}) needs {expected}; the checkpoint "
                "does not match its config.json"
            )
        return _Scaled(scale, block, fp4)


def _scale_names(name: str) -> list[str]:
    """Where the scales of a quantized tensor `name` may be stored, in the order they are looked for."""
    names = [name + SCALE]
    if name.endswith(".weight"):
        names += [name.removesuffix("weight") + other for other in RENAMED_SCALES]
    return names


def _layouts(files: list[Path]) -> dict[str, tuple[torch.dtype | None, tuple[int, ...]]]:
    """Each tensor's dtype (None: one no reader here knows) and shape, from the files' headers (a pickle's from its
    memory-mapped index), without reading a tensor."""
    dtypes = SAFETENSORS_DTYPES | FP8_DTYPES
    out = {}
    for file in files:
        if file.suffix == ".safetensors":
            header = safetensors_header(file)[1]
            out |= {n: (dtypes.get(info["dtype"]), tuple(info["shape"])) for n, info in header.items()}
        else:
            index = torch.load(file, map_location="meta", weights_only=True, mmap=True)
            out |= {n: (t.dtype, tuple(t.shape)) for n, t in index.items()}
    return out


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "a dtype this loader does not read" if dtype is None else str(dtype).removeprefix("torch.")


class Fp8Values(Lazy):
    """An FP8 (or FP4) weight's dequantized values, computed when read: whole, or a run of rows with just the
    scale rows they need (the first dimension, leading dimensions of fused experts aside, holds whole blocks'
    rows only where the run starts and ends on a block edge: the values are the same either way)."""

    def __init__(self, values: Lazy, scales: Lazy, block: tuple[int, int] | None, dtype: torch.dtype) -> None:
        self.values, self.scales, self.block, self.dtype = values, scales, block, dtype
        fp4 = values.dtype == torch.int8
        self.shape = torch.Size((*values.shape[:-1], values.shape[-1] * (2 if fp4 else 1)))

    def read(self) -> torch.Tensor:
        return dequantize_fp8(self.values.read(), self.scales.read(), self.block, self.dtype)

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        if len(self.shape) != 2 or self.block is None:  # fused experts, or one scale for all: read it whole
            return self.read()[start:stop]
        rows = self.block[0]
        first, last = start // rows * rows, -(-stop // rows) * rows
        part = dequantize_fp8(self.values.read_rows(first, min(last, self.shape[0])),
                              self.scales.read_rows(first // rows, -(-min(last, self.shape[0]) // rows)),
                              self.block, self.dtype)  # fmt: skip
        return part[start - first : stop - first]


CHUNK_VALUES = 1 << 24
"""Values dequantized at a time (64 MiB in float32): a weight's float32 copy would be 4 bytes a value at once."""


def dequantize_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: list[int] | tuple[int, int] | None, dtype: torch.dtype
) -> torch.Tensor:
    """`weight` in `dtype`: each value times its block's scale (`block` None: one scale for the whole tensor),
    computed in float32 as transformers does, a few blocks of rows at a time. Blocks are `block` rows x columns of
    values, the last ones cut short where the weight does not divide. An int8 weight is FP4, two e2m1 values a byte
    (its values twice its bytes); scales stored as E8M0 (or its bytes) are powers of two."""
    scales = e8m0_values(scale_inv) if scale_inv.dtype in E8M0 else scale_inv.float()
    fp4 = weight.dtype == torch.int8
    rows, cols = weight.shape[-2], weight.shape[-1] * (2 if fp4 else 1)
    if block is None:
        scales, block = scales.reshape(1, 1), (rows, cols)
    per_row = weight[..., :1, :].numel() // weight.shape[-1] * cols  # a row of every leading index (each expert's)
    step = max(1, CHUNK_VALUES // (per_row * block[0])) * block[0]
    out = torch.empty((*weight.shape[:-1], cols), dtype=dtype)
    for start in range(0, rows, step):
        chunk = weight[..., start : start + step, :]
        part = e2m1_values(chunk) if fp4 else chunk.float()
        grid = scales[..., start // block[0] : -(-(start + part.shape[-2]) // block[0]), :]
        grid = grid.repeat_interleave(block[0], dim=-2)[..., : part.shape[-2], :]
        out[..., start : start + step, :] = part.mul_(grid.repeat_interleave(block[1], dim=-1)[..., :cols])
    return out
