"""HQQ's own layout, as scripts/export_quantized.py --quant hqq writes it for HQQ's `AutoHQQHFModel.from_quantized`:
one `qmodel.pt` of {module name: its state dict}, each quantized layer's as HQQ's `HQQLinear.state_dict()` (integer
`W_q`, `scale`, `zero` and the quantizer's settings), every other module's parameters as they are.

With --quant hqq the layers keep those bytes (the file's bit width and group size are the run's; a flag given
against them is refused). Any other --quant dequantizes them with HQQ's own dequantization.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qlora_fsdp.config.options import QuantConfig
from qlora_fsdp.errors import UserError
from qlora_fsdp.model.formats.base import Prequantized, Stored
from qlora_fsdp.quant.base import QuantizedWeight

WEIGHTS = "qmodel.pt"
FLAGS = {"hqq_bits": "nbits", "hqq_group_size": "group_size"}
"""Our flag -> the setting of HQQ's that decides it for an exported base."""
FILE_ONLY = ("W_q", "scale", "zero", "bias", "quant_scale", "quant_zero", "offload_meta", "stores_quant_config")
"""What a layer's entry holds besides the quantizer's settings."""


class HqqWeight(Prequantized):
    """One layer's HQQ entry: packed ints, scale and zero, and the settings that decode them."""

    def __init__(self, entry: dict[str, Any]) -> None:
        self.packed, self.scale, self.zero = entry["W_q"], entry["scale"], entry["zero"]
        self.settings = {k: v for k, v in entry.items() if k not in FILE_ONLY}
        self.shape = torch.Size(self.settings["shape"])

    def dequantize(self) -> torch.Tensor:
        from qlora_fsdp.quant.hqq import dequantize_hqq

        meta = {**self.settings, "scale": self.scale, "zero": self.zero}
        return dequantize_hqq(self.packed, meta, *self.shape).float()

    def kept(self, module: nn.Module) -> QuantizedWeight | None:
        from qlora_fsdp.quant.hqq import HqqLinear

        if not isinstance(module, HqqLinear) or (module.out_features, module.in_features) != tuple(self.shape):
            return None
        # Scale and zero in the layer's compute dtype, as HQQLinear holds them; the packed ints are kept as bytes.
        state = {"scale": self.scale.to(module.compute_dtype), "zero": self.zero.to(module.compute_dtype)}
        meta = {**self.settings, "compute_dtype": module.compute_dtype, "packed_dtype": self.packed.dtype,
                "packed_shape": self.packed.shape}  # fmt: skip
        return QuantizedWeight(self.packed.contiguous().flatten().view(torch.uint8), state, meta)


class HqqExportFormat:
    """qmodel.pt read entry by entry (memory-mapped): plain tensors, and each quantized layer as an HqqWeight."""

    def __init__(self, config: dict[str, Any], path: Path) -> None:
        self.path = path

    @staticmethod
    def detect(config: dict[str, Any], path: Path) -> bool:
        return (path / WEIGHTS).is_file()

    def files(self, path: Path, *, allow_pickle: bool) -> list[Path]:
        return [path / WEIGHTS]

    def names(self, files: list[Path]) -> list[str]:
        return [name for name, _ in _entries(files)]

    def tensors(self, files: list[Path]) -> Iterator[tuple[str, Stored]]:
        for module, entry in _load(files).items():
            if "W_q" in entry:
                yield f"{module}.weight", HqqWeight(entry)
                if "bias" in entry:
                    yield f"{module}.bias", entry["bias"]
            else:
                yield from ((f"{module}.{attr}", tensor) for attr, tensor in entry.items())

    def kept_experts(self, quant: QuantConfig) -> None:
        return None

    def quant_settings(self, quant: QuantConfig, given: frozenset[str]) -> QuantConfig:
        """With --quant hqq the file's bit width and group size are the run's; a flag given against them is
        refused."""
        if quant.quant != "hqq":
            return quant
        layer = next((e for e in _load([self.path / WEIGHTS]).values() if "W_q" in e), None)
        if layer is None:
            return quant
        settings = {}
        for flag, key in FLAGS.items():
            if flag in given and getattr(quant, flag) != layer[key]:
                raise UserError(
                    f"--{flag} {getattr(quant, flag)} contradicts the checkpoint, whose HQQ layers have {key}="
                    f"{layer[key]} ({WEIGHTS}): with --quant hqq they are trained on as they are; drop --{flag}, or "
                    "pass --quant bnb or none to dequantize them"
                )
            settings[flag] = layer[key]
        return dataclasses.replace(quant, **settings)


def _load(files: list[Path]) -> dict[str, dict[str, Any]]:
    try:
        return torch.load(files[0], map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # an unpickling error names the problem in its first line
        raise UserError(f"--model: {files[0]} is not HQQ's saved model ({str(exc).splitlines()[0]})") from None


def _entries(files: list[Path]) -> list[tuple[str, Any]]:
    out = []
    for module, entry in _load(files).items():
        if "W_q" in entry:
            out += [(f"{module}.weight", None)] + ([(f"{module}.bias", None)] if "bias" in entry else [])
        else:
            out += [(f"{module}.{attr}", None) for attr in entry]
    return out
