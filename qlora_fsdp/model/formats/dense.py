"""The dense format: tensors stored as the model uses them (safetensors or, allowed, pickle), quantized on loading."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from qlora_fsdp.config.options import QuantConfig
from qlora_fsdp.model.formats.base import ShardedFiles, weight_names
from qlora_fsdp.model.formats.files import Lazy, tensor_refs


class DenseFormat(ShardedFiles):
    """Every tensor read as it is stored; loading converts its dtype and quantizes it with --quant."""

    def __init__(self, config: dict[str, Any], path: Path) -> None:
        pass

    @staticmethod
    def detect(config: dict[str, Any], path: Path) -> bool:
        """A checkpoint that names no quantization of its own."""
        return not config.get("quantization_config")

    def names(self, files: list[Path]) -> list[str]:
        return weight_names(files)

    def tensors(self, files: list[Path]) -> Iterator[tuple[str, Lazy]]:
        for file in files:
            yield from tensor_refs(file)

    def kept_experts(self, quant: QuantConfig) -> None:
        return None

    def quant_settings(self, quant: QuantConfig, given: frozenset[str]) -> QuantConfig:
        return quant
