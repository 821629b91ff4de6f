"""What every checkpoint format shares: the protocol loading calls, a weight stored quantized, and the grouping of
a weight's tensors that arrive one at a time."""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from qlora_fsdp.config.options import QuantConfig
from qlora_fsdp.model.formats.files import Lazy, tensor_names
from qlora_fsdp.model.hub import shard_files
from qlora_fsdp.quant.base import QuantizedLinear, QuantizedWeight


class Prequantized(ABC):
    """One weight as the checkpoint stores it quantized: its packed data and the state that decodes it."""

    shape: torch.Size
    """The weight's [out, in] shape."""

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The weight in float32, as its library decodes it."""

    def kept(self, module: nn.Module) -> QuantizedWeight | None:
        """The packed data as `module` holds it, bit for bit, where `module` quantizes the way the file did;
        None where it does not (the weight is then dequantized and quantized as --quant asks)."""
        return None

    def experts(self) -> list[Prequantized] | None:
        """For a fused experts tensor, one part per expert, each an [out, in] weight (the per-expert layers'
        layout); None where the format cannot split it (it is then dequantized whole)."""
        return None

    @classmethod
    def join(cls, parts: list[Prequantized]) -> Prequantized | str:
        """`parts` (of this class, with the same columns) stacked along their rows as one weight, still as the file
        stores it; or why this format cannot join them exactly (see Stacked)."""
        return f"{cls.__name__} weights cannot be joined as stored"


class Stacked(Prequantized):
    """One weight made of whole weights stacked along the output rows, each as the file stores it: an expert's
    gate and up projections, which transformers concatenates into its fused gate_up_proj. The layer keeps them as
    one packed weight where the format joins them exactly (`join`: row-wise blocks concatenate); otherwise they are
    dequantized, which is exactly what transformers' concatenation of the dequantized parts gives."""

    def __init__(self, parts: list[Prequantized]) -> None:
        self.parts = parts
        self.shape = torch.Size((sum(p.shape[0] for p in parts), parts[0].shape[1]))

    @functools.cached_property
    def joined(self) -> Prequantized | str:
        """The parts as one weight of their format, or why they cannot be (parts of different formats cannot)."""
        kind = type(self.parts[0])
        if any(type(p) is not kind for p in self.parts):
            return "its parts are stored in different formats"
        return kind.join(self.parts)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def kept(self, module: nn.Module) -> QuantizedWeight | None:
        return self.joined.kept(module) if isinstance(self.joined, Prequantized) else None


Stored = Lazy | torch.Tensor | Prequantized
"""What a format yields for one checkpoint name: a reference to plain values, read when (and as far as) loading
needs them, or a weight stored quantized; loading's conversions may turn references into tensors."""


class CheckpointFormat(Protocol):
    """What loading asks of a checkpoint format."""

    def __init__(self, config: dict[str, Any], path: Path) -> None:
        """The format of the checkpoint in `path`, whose config.json is `config` (its quantization settings, if
        any)."""
        ...

    @staticmethod
    def detect(config: dict[str, Any], path: Path) -> bool:
        """Whether a model whose config.json is `config` stores its weights this way (a quantized checkpoint names
        its method in `quantization_config.quant_method`)."""
        ...

    def files(self, path: Path, *, allow_pickle: bool) -> list[Path]:
        """The weight files of the model directory `path`, in the order they are read."""
        ...

    def names(self, files: list[Path]) -> list[str]:
        """The names `tensors` yields, without reading the tensors: loading checks them against the model before it
        reads any weight. A quantized weight's state tensors are not among them; a weight whose state is incomplete
        is refused here."""
        ...

    def tensors(self, files: list[Path]) -> Iterator[tuple[str, Stored]]:
        """(checkpoint name, reference or Prequantized) one at a time, in file order; a reference reads into fresh
        memory of its own when asked."""
        ...

    def kept_experts(self, quant: QuantConfig) -> Callable[..., QuantizedLinear] | None:
        """The layer each routed expert's projection is held in where the format keeps its own quantization for
        them (called as a backend's `make_module` is, with the packed layout's keywords); None: --quant's."""
        ...

    def quant_settings(self, quant: QuantConfig, given: frozenset[str]) -> QuantConfig:
        """--quant's settings for this checkpoint: a format that keeps its own quantization puts its settings in
        place of those not `given` on the command line or in YAML, and refuses a given one that contradicts it."""
        ...


def read_all(parts: dict[str, Lazy]) -> dict[str, torch.Tensor]:
    """Every reference of a group read (for a format whose grouped weight is made of all of them at once)."""
    return {name: ref.read() for name, ref in parts.items()}


def grouped(
    stream: Iterator[tuple[str, Lazy]], group_of: dict[str, str], combine: Callable[[str, dict], Stored]
) -> Iterator[tuple[str, Stored]]:
    """`stream` with each group's tensors (member name -> group name in `group_of`) held until the last of them has
    arrived, then yielded as one `combine(group, {member: tensor})` under the group's name; other tensors pass.

    A group's members may come in any order and from different files; only incomplete groups wait in memory.
    """
    size: dict[str, int] = {}
    for group in group_of.values():
        size[group] = size.get(group, 0) + 1
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in stream:
        group = group_of.get(name)
        if group is None:
            yield name, tensor
            continue
        parts = waiting.setdefault(group, {})
        parts[name] = tensor
        if len(parts) == size[group]:
            del waiting[group]
            yield group, combine(group, parts)


class ShardedFiles:
    """Weight files as transformers writes them: safetensors shards with their index (pickle only if allowed)."""

    def files(self, path: Path, *, allow_pickle: bool) -> list[Path]:
        return shard_files(path, allow_pickle=allow_pickle)


def weight_names(files: list[Path]) -> list[str]:
    """Every tensor name of `files`, without reading a tensor."""
    return [n for file in files for n in tensor_names(file)]
