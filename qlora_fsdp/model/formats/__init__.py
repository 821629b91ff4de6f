"""Checkpoint formats: how a checkpoint stores its tensors, kept apart from how loading quantizes them.

A format reads a model directory's weight files and yields its tensors by checkpoint name; loading
(qlora_fsdp/model/streaming.py) renames, places and quantizes them with --quant. A format of its own per storage
(plain tensors today; pre-quantized ones are to come) keeps the reading of each out of the loader: a new format is
one module here and one entry in FORMATS.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from qlora_fsdp.model.formats.dense import DenseFormat


class CheckpointFormat(Protocol):
    """What loading asks of a checkpoint format."""

    def detect(self, config: dict[str, Any]) -> bool:
        """Whether a model whose config.json is `config` stores its weights this way (a quantized checkpoint names
        its method in `quantization_config.quant_method`)."""
        ...

    def names(self, files: list[Path]) -> list[str]:
        """The names `tensors` yields, without reading the tensors: loading checks them against the model before it
        reads any weight."""
        ...

    def tensors(self, files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, dense tensor) one at a time, in file order, each in fresh memory of its own."""
        ...


FORMATS: tuple[CheckpointFormat, ...] = (DenseFormat(),)
"""Tried in order, the first whose `detect` holds reads the checkpoint; DenseFormat, the catch-all, stays last."""


def checkpoint_format(path: Path) -> CheckpointFormat:
    """The format of the model directory `path`, from its config.json."""
    config = json.loads((path / "config.json").read_text())
    return next(fmt for fmt in FORMATS if fmt.detect(config))
