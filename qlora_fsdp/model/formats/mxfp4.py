"""MXFP4 checkpoints (config.json `quant_method: mxfp4`): how gpt-oss ships its routed experts, each fused projection
as `X_blocks` ([experts, out, in/32, 16] bytes, two e2m1 codes each) and `X_scales` ([experts, out, in/32]
exponents); everything else is plain.

With --mxfp4 keep (the default) the experts' frozen base is those bytes, bit for bit (qlora_fsdp/quant/mxfp4.py):
the release's own weights, at 4.25 bits each, with no second rounding. With --mxfp4 dequantize they are decoded as
they arrive (exactly; e2m1 values times powers of two) and quantized with --quant like any dense weight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qlora_fsdp.config.options import QuantConfig
from qlora_fsdp.errors import UserError
from qlora_fsdp.model.formats.base import Prequantized, ShardedFiles, Stored, grouped, read_all, weight_names
from qlora_fsdp.model.formats.files import Lazy, tensor_refs
from qlora_fsdp.quant.base import QuantizedLinear, QuantizedWeight
from qlora_fsdp.quant.mxfp4 import Mxfp4Linear, dequantize_mxfp4, mxfp4_layer

PARTS = ("_blocks", "_scales")
"""A packed tensor `X` is stored as `X_blocks` and `X_scales`."""


class Mxfp4Weight(Prequantized):
    """One expert's projection as the file holds it: [out, in/32, 16] codes and [out, in/32] exponents (gpt-oss's
    experts, and DeepSeek-V4's FP4 experts with E8M0 scales, qlora_fsdp/model/formats/fp8.py: the same layout)."""

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        self.blocks, self.scales = blocks, scales
        self.shape = torch.Size((blocks.shape[0], blocks.shape[1] * blocks.shape[2] * 2))

    def dequantize(self) -> torch.Tensor:
        return dequantize_mxfp4(self.blocks, self.scales, torch.float32)

    def kept(self, module: nn.Module) -> QuantizedWeight | None:
        if not isinstance(module, Mxfp4Linear) or (module.out_features, module.in_features) != tuple(self.shape):
            return None
        return QuantizedWeight(self.blocks.contiguous().flatten(), {"scales": self.scales.contiguous()})

    @classmethod
    def join(cls, parts: list[Prequantized]) -> Prequantized | str:
        """Exact: every row has its own scales, so rows of several weights stack as they are."""
        return cls(torch.cat([p.blocks for p in parts]), torch.cat([p.scales for p in parts]))  # type: ignore[attr-defined]


class Mxfp4Experts(Prequantized):
    """A layer's fused experts projection: dequantized, transformers' [experts, in, out] parameter; or one
    Mxfp4Weight per expert."""

    def __init__(self, name: str, refs: dict[str, Lazy]) -> None:
        parts = read_all(refs)
        self.blocks, self.scales = parts[name + "_blocks"], parts[name + "_scales"]
        count, out_features, groups, half = self.blocks.shape
        if tuple(self.scales.shape) != (count, out_features, groups):
            raise UserError(f"--model: {name}_scales {tuple(self.scales.shape)} does not fit {name}_blocks "
                            f"{tuple(self.blocks.shape)}; re-download the checkpoint")  # fmt: skip
        self.shape = torch.Size((count, groups * half * 2, out_features))

    def dequantize(self) -> torch.Tensor:
        return dequantize_mxfp4(self.blocks, self.scales, torch.float32).transpose(1, 2)

    def experts(self) -> list[Prequantized] | None:
        return [Mxfp4Weight(b, s) for b, s in zip(self.blocks.unbind(0), self.scales.unbind(0), strict=True)]


class Mxfp4Format(ShardedFiles):
    """Plain tensors, and each MXFP4 pair grouped into one Mxfp4Experts under the fused projection's name."""

    def __init__(self, config: dict[str, Any], path: Path) -> None:
        pass

    @staticmethod
    def detect(config: dict[str, Any], path: Path) -> bool:
        return (config.get("quantization_config") or {}).get("quant_method") == "mxfp4"

    def names(self, files: list[Path]) -> list[str]:
        names = weight_names(files)
        return list(dict.fromkeys(_groups(files, names).get(n, n) for n in names))

    def tensors(self, files: list[Path]) -> Iterator[tuple[str, Stored]]:
        group_of = _groups(files, weight_names(files))
        stream = (item for file in files for item in tensor_refs(file))
        yield from grouped(stream, group_of, Mxfp4Experts)

    def quant_settings(self, quant: QuantConfig, given: frozenset[str]) -> QuantConfig:
        return quant

    def kept_experts(self, quant: QuantConfig) -> Callable[..., QuantizedLinear] | None:
        return mxfp4_layer if quant.mxfp4 == "keep" else None


def _groups(files: list[Path], names: list[str]) -> dict[str, str]:
    """Each `X_blocks` and `X_scales` -> `X`; refuses a half without the other."""
    present = set(names)
    group_of = {}
    for name in names:
        for part in PARTS:
            if name.endswith(part):
                base = name.removesuffix(part)
                other = base + next(p for p in PARTS if p != part)
                if other not in present:
                    raise UserError(f"--model {files[0].parent}: the MXFP4 checkpoint is incomplete: {name} has no "
                                    f"{other}; re-download it")  # fmt: skip
                group_of[name] = base
    return group_of
