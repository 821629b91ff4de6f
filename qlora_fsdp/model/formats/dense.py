"""The dense format: tensors stored as the model uses them (safetensors or, allowed, pickle), quantized on loading."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from qlora_fsdp.model.formats.files import read_tensors, tensor_names


class DenseFormat:
    """Every tensor read as it is stored; loading converts its dtype and quantizes it with --quant."""

    def detect(self, config: dict[str, Any]) -> bool:
        """Always: the last of FORMATS reads whatever no format before it claims."""
        return True

    def names(self, files: list[Path]) -> list[str]:
        return [n for file in files for n in tensor_names(file)]

    def tensors(self, files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            yield from read_tensors(file)
