"""Checkpoint formats: how a checkpoint stores its tensors, kept apart from how loading quantizes them.

A format reads a model directory's weight files and yields its tensors by checkpoint name: dense tensors, which
loading (qlora_fsdp/model/streaming.py) renames, places and quantizes with --quant, or weights the file holds
already quantized (`Prequantized`), which loading keeps as they are where the layer's quantization is the file's
and dequantizes otherwise. A new format is one module here and one entry in FORMATS.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from qlora_fsdp.config.options import QuantConfig
from qlora_fsdp.errors import UserError
from qlora_fsdp.model.formats.base import CheckpointFormat, Prequantized, Stored
from qlora_fsdp.model.formats.bnb4bit import Bnb4bitFormat
from qlora_fsdp.model.formats.dense import DenseFormat
from qlora_fsdp.model.formats.fp8 import Fp8Format
from qlora_fsdp.model.formats.hqq_export import HqqExportFormat
from qlora_fsdp.model.formats.mxfp4 import Mxfp4Format

FORMATS: tuple[type[CheckpointFormat], ...] = (HqqExportFormat, Bnb4bitFormat, Fp8Format, Mxfp4Format, DenseFormat)
"""Tried in order; the first whose `detect` holds reads the checkpoint, made from its config.json."""
SUPPORTED = (
    "plain weights, bitsandbytes 4-bit (quant_method bitsandbytes), FP8 (quant_method fp8), MXFP4 (quant_method "
    "mxfp4) and HQQ's qmodel.pt"
)
"""What FORMATS reads, for the refusal of anything else."""


def checkpoint_format(path: Path) -> CheckpointFormat:
    """The format of the model directory `path`, from its config.json; a quantization no format reads is refused
    in one line naming it."""
    config = json.loads((path / "config.json").read_text())
    quant = config.get("quantization_config") or {}
    method = "bitsandbytes 8-bit" if quant.get("load_in_8bit") else quant.get("quant_method")
    for fmt in FORMATS:
        if fmt.detect(config, path):
            return fmt(config, path)
    raise UserError(
        f"--model {path}: the checkpoint is quantized with {method!r} (config.json quantization_config), which "
        f"this loader cannot read; it reads {SUPPORTED}. Use the model's unquantized release, or dequantize it with "
        "transformers (from_pretrained, then save_pretrained with the quantization removed)"
    )


def kept_experts_layer(
    path: Path, quant: QuantConfig, *, storage_dtype: torch.dtype, compute_dtype: torch.dtype
) -> Callable[[nn.Linear], nn.Linear] | None:
    """The layer the checkpoint at `path` keeps its routed experts in with these flags (`--mxfp4 keep`), bound to
    one process's packed layout (tools, tests); None where --quant's backend holds them."""
    make = checkpoint_format(path).kept_experts(quant)
    return None if make is None else functools.partial(make, storage_dtype=storage_dtype, compute_dtype=compute_dtype)


__all__ = ["FORMATS", "CheckpointFormat", "Prequantized", "Stored", "checkpoint_format", "kept_experts_layer"]
