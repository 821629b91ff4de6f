"""Pre-quantized bitsandbytes 4-bit checkpoints (config.json `quant_method: bitsandbytes`, `load_in_4bit`): what
transformers' save_pretrained writes for a model loaded in 4-bit, the layout of the hub's `*-bnb-4bit` releases and
of scripts/export_quantized.py's bnb output.

Each quantized linear stores its packed bytes as `X.weight` (uint8, or any `quant_storage` dtype: the same bytes)
beside its QuantState taken apart (`X.weight.absmax`, `.quant_map`, with double quantization `.nested_absmax` and
`.nested_quant_map`, and the rest packed in `.quant_state.bitsandbytes__nf4|fp4`). With --quant bnb those bytes and
that state are what the layer holds, bit for bit: no dequantize-requantize. Any other --quant dequantizes them.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qlora_fsdp.config.options import QuantConfig
from qlora_fsdp.errors import UserError
from qlora_fsdp.model.formats.base import Prequantized, ShardedFiles, Stored, grouped, read_all, weight_names
from qlora_fsdp.model.formats.files import Lazy, tensor_refs
from qlora_fsdp.quant.base import QuantizedWeight

PACKED_STATE = re.compile(r"(.+)\.quant_state\.bitsandbytes__(nf4|fp4)$")
"""The tensor that names a quantized weight (group 1) and its 4-bit type."""
REQUIRED = ("absmax", "quant_map")
NESTED = ("nested_absmax", "nested_quant_map")
FLAGS = {"bnb_quant_type": "bnb_4bit_quant_type", "bnb_double_quant": "bnb_4bit_use_double_quant"}
"""Our flag -> the quantization_config key that decides it for a pre-quantized checkpoint."""


class Bnb4bitWeight(Prequantized):
    """One layer's packed bytes and bitsandbytes QuantState, as the file holds them."""

    def __init__(self, packed: torch.Tensor, state: Any) -> None:
        self.packed, self.state = packed, state
        self.shape = state.shape

    @classmethod
    def from_file(cls, name: str, refs: dict[str, Lazy]) -> Bnb4bitWeight:
        """The weight `name` from its tensors in the file: the packed bytes and the QuantState taken apart."""
        import bitsandbytes.functional as bnbf

        parts = read_all(refs)
        packed = parts.pop(name).contiguous().view(torch.uint8).flatten()
        return cls(packed, bnbf.QuantState.from_dict({k[len(name) + 1 :]: v for k, v in parts.items()}, device="cpu"))

    @classmethod
    def join(cls, parts: list[Prequantized]) -> Prequantized | str:
        """Exact where each part but the last is whole blocks and the blocks' scales are plain: the values are packed
        row by row, two a byte, each block of `blocksize` with its own absmax, so the parts' bytes and absmax
        concatenate. Double quantization shifts each weight's absmax by an offset of its own, which one state cannot
        hold for two weights."""
        import bitsandbytes.functional as bnbf

        states = [p.state for p in parts]  # type: ignore[attr-defined]
        first = states[0]
        if any(s.state2 is not None for s in states):
            return "bitsandbytes double quantization gives each stored weight an absmax offset of its own"
        if any((s.quant_type, s.blocksize, s.dtype) != (first.quant_type, first.blocksize, first.dtype)
               or not torch.equal(s.code, first.code) for s in states):  # fmt: skip
            return "the parts differ in 4-bit type, block size or dtype"
        if any(s.shape.numel() % s.blocksize for s in states[:-1]):
            return f"blocks of {first.blocksize} values straddle the parts"
        packed = torch.cat([p.packed[: -(-p.shape.numel() // 2)] for p in parts])  # type: ignore[attr-defined]
        shape = torch.Size((sum(s.shape[0] for s in states), first.shape[1]))
        absmax = torch.cat([s.absmax for s in states])
        state = bnbf.QuantState(absmax, shape, first.code, first.blocksize, first.quant_type, first.dtype)
        return cls(packed, state)

    def dequantize(self) -> torch.Tensor:
        import bitsandbytes.functional as bnbf

        state = copy.copy(self.state)
        state.dtype = torch.float32  # the exact values: NF4/FP4 codes times fp32 scales
        return bnbf.dequantize_4bit(self.packed.view(-1, 1), state).float()

    def kept(self, module: nn.Module) -> QuantizedWeight | None:
        from qlora_fsdp.quant.bnb import Bnb4bitLinear

        nested = self.state.state2
        same = isinstance(module, Bnb4bitLinear) and module.quant_type == self.state.quant_type
        if not same or module.double_quant != (nested is not None):
            return None
        state = {"absmax": self.state.absmax, "code": self.state.code}
        meta: dict[str, Any] = {"blocksize": self.state.blocksize}
        if nested is not None:
            state |= {"nested_absmax": nested.absmax, "nested_code": nested.code, "offset": self.state.offset}
            meta["nested_blocksize"] = nested.blocksize
        return QuantizedWeight(self.packed, state, meta)


class Bnb4bitFormat(ShardedFiles):
    """Plain tensors and pre-quantized 4-bit weights, each grouped with its state before it is yielded."""

    def __init__(self, config: dict[str, Any], path: Path) -> None:
        self.file_config = config["quantization_config"]

    @staticmethod
    def detect(config: dict[str, Any], path: Path) -> bool:
        quant = config.get("quantization_config") or {}
        return quant.get("quant_method") == "bitsandbytes" and bool(quant.get("load_in_4bit"))

    def names(self, files: list[Path]) -> list[str]:
        names = weight_names(files)
        group_of = _groups(files, names)
        return [n for n in names if n not in group_of or group_of[n] == n]

    def tensors(self, files: list[Path]) -> Iterator[tuple[str, Stored]]:
        group_of = _groups(files, weight_names(files))
        stream = (item for file in files for item in tensor_refs(file))
        yield from grouped(stream, group_of, Bnb4bitWeight.from_file)

    def kept_experts(self, quant: QuantConfig) -> None:
        return None

    def quant_settings(self, quant: QuantConfig, given: frozenset[str]) -> QuantConfig:
        """With --quant bnb the file's type and double quantization are the run's; a flag given against them is
        refused. Other backends dequantize, so their flags stand."""
        if quant.quant != "bnb":
            return quant
        settings = {}
        for flag, key in FLAGS.items():
            value = self.file_config.get(key, getattr(quant, flag))
            if flag in given and getattr(quant, flag) != value:
                raise UserError(
                    f"--{flag} {getattr(quant, flag)} contradicts the checkpoint, whose 4-bit weights are "
                    f"{key}={value} (config.json): with --quant bnb they are trained on as they are; drop --{flag}, "
                    "or pass --quant hqq or none to dequantize them"
                )
            settings[flag] = value
        return dataclasses.replace(quant, **settings)


def _groups(files: list[Path], names: list[str]) -> dict[str, str]:
    """Each pre-quantized weight's tensors -> the weight's name; refuses a weight whose state is incomplete."""
    present = set(names)
    group_of = {}
    for name in names:
        match = PACKED_STATE.match(name)
        if match is None:
            continue
        weight = match.group(1)
        parts = [weight, *(f"{weight}.{p}" for p in REQUIRED)]
        nested = [f"{weight}.{p}" for p in NESTED]
        if any(n in present for n in nested):
            parts += nested
        missing = [n for n in parts if n not in present]
        if missing:
            raise UserError(
                f"--model {files[0].parent}: the bitsandbytes 4-bit checkpoint is incomplete: {missing[0]} is "
                "missing; re-download it or save it again with transformers' save_pretrained"
            )
        group_of |= dict.fromkeys([*parts, name], weight)
    strays = sorted(n for n in present - group_of.keys() if n.endswith(tuple(f".{p}" for p in REQUIRED + NESTED)))
    if strays:
        raise UserError(
            f"--model {files[0].parent}: the bitsandbytes 4-bit checkpoint is incomplete: {strays[0]} has no "
            "quant_state tensor beside it; re-download it or save it again with transformers' save_pretrained"
        )
    return group_of
