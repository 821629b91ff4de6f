"""Checkpoint names to model names through transformers' own weight-conversion mapping.

transformers 5 renames some checkpoint tensors when it loads them and fuses others: a Mixtral checkpoint's
`block_sparse_moe.experts.N.w1/w3` become one `mlp.experts.gate_up_proj` per layer. The loader streams tensors one
at a time, so this keeps transformers' transforms but applies them as tensors arrive: a renamed tensor goes on at
once, and a fused target is converted (by transformers' own operations, in its expert order) as soon as the last
of its sources has been read, so no more than one layer's experts wait in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from qlora_fsdp.compat import convert_fused, converter_patterns, rename_source_key, weight_transforms
from qlora_fsdp.model.formats.base import Prequantized, Stacked
from qlora_fsdp.model.formats.files import Lazy


@dataclass
class _Fused:
    converter: object
    """transformers' WeightConverter that makes this target (a prototype: each target converts with a copy)."""
    patterns: dict[str, str]
    """checkpoint name -> the converter's source pattern it matched."""
    arrived: dict[str, Any] = field(default_factory=dict)
    """checkpoint name -> its tensor (or pre-quantized weight), held until every source has arrived."""


class CheckpointNames:
    """Where each checkpoint tensor goes, decided from the names alone, before any tensor is read."""

    def __init__(self, model: nn.Module, checkpoint_names: Iterable[str], model_names: Iterable[str]) -> None:
        renamings, converters = weight_transforms(model)
        present = dict.fromkeys(model_names, True)
        prefix = getattr(model, "base_model_prefix", None)
        self.model = model
        self.direct: dict[str, str] = {}
        """checkpoint name -> model name, for tensors that are only renamed (most are kept as they are)."""
        self.fused: dict[str, _Fused] = {}
        self.fused_of: dict[str, str] = {}
        """checkpoint name -> the fused target it is one source of."""
        for name in checkpoint_names:
            for converter in converters:
                target, pattern = rename_source_key(name, renamings, [converter], prefix, present)
                if pattern is not None:
                    self.fused.setdefault(target, _Fused(converter, {})).patterns[name] = pattern
                    self.fused_of[name] = target
                    break
            else:
                renamed = rename_source_key(name, renamings, [], prefix, present)[0]
                as_is = rename_source_key(name, [], [], prefix, present)[0]
                # A renaming meant for other tensors (DeepSeek-V4's `.norm.` -> `.kv_norm.` also catches the final
                # `model.norm`): where it names no parameter and the name itself does, transformers keeps the name.
                self.direct[name] = as_is if renamed not in present and as_is in present else renamed

    def targets(self) -> set[str]:
        """Every model name the checkpoint will fill (a one-to-many conversion fills each of its targets)."""
        names = set(self.direct.values())
        for target, fused in self.fused.items():
            patterns = converter_patterns(fused.converter)[1]
            names |= {target} | {target.replace(patterns[0], other) for other in patterns[1:] if patterns[0] in target}
        return names

    def incomplete(self, count: Callable[[str], int | None]) -> list[str]:
        """Fused targets short of sources, as 'target: n of N matching pattern', where `count(target)` says how
        many a per-expert source pattern needs (a layer's expert count; None: any number); a pattern without the
        expert wildcard (`*`) names one tensor holding them all (Inkling2's `w13_weight`)."""
        short = []
        for target, fused in self.fused.items():
            experts = count(target)
            for pattern in converter_patterns(fused.converter)[0]:
                needed = experts if "*" in pattern else 1
                found = sum(1 for p in fused.patterns.values() if p == pattern)
                if needed is not None and found != needed:
                    short.append(f"{target}: {found} of {needed} tensors matching {pattern}")
        return short

    def fused_target(self, name: str) -> str | None:
        """The fused target `name` is one source of, if any."""
        return self.fused_of.get(name)

    def arrive(self, name: str, tensor: Any) -> dict[str, Any]:
        """{model name: tensor} that `name`'s arrival completes: itself renamed (whatever it is: a pre-quantized
        weight goes on as it came), a whole fused target, or nothing.

        A fused target whose sources all arrived pre-quantized, and which transformers makes by stacking whole
        sources along their rows, comes as a list with one weight per expert, each still as the file stores it
        (gate and up joined as a `Stacked`): the caller splits it into per-expert layers without a dequantization.
        Otherwise pre-quantized sources are dequantized and transformers' conversion fuses them."""
        target = self.fused_of.get(name)
        if target is None:
            return {self.direct.get(name, name): tensor}
        fused = self.fused[target]
        fused.arrived[name] = tensor
        if len(fused.arrived) < len(fused.patterns):
            return {}
        del self.fused[target]
        if all(isinstance(t, Prequantized) for t in fused.arrived.values()):
            stacks = self._row_stacks(target, fused)
            if stacks is not None:
                return {target: [parts[0] if len(parts) == 1 else Stacked(parts) for parts in stacks]}
        sources = {name: (fused.patterns[name], _values(t)) for name, t in fused.arrived.items()}
        return convert_fused(fused.converter, target, sources, self.model)

    def _row_stacks(self, target: str, fused: _Fused) -> list[list[Any]] | None:
        """Each expert's sources, top to bottom, where transformers' conversion of `target` only stacks whole
        sources along their rows, expert after expert (MergeModulelist, then Concatenate of gate and up); None where
        it does anything else (transposes, interleaves, splits). Asked of transformers' own conversion run on index
        tensors, two rows per source, so its expert order (dot_natural_key) and source order are its own."""
        names = list(fused.arrived)
        probes = {n: (fused.patterns[n], torch.tensor([[2.0 * i], [2.0 * i + 1]])) for i, n in enumerate(names)}
        try:
            converted = convert_fused(fused.converter, target, probes, self.model)
        except (RuntimeError, ValueError):  # an operation sized from the model (a split) does not take the probes
            return None
        rows = converted.get(target)
        if len(converted) != 1 or rows is None or rows.dim() != 3 or rows.shape[-1] != 1 or rows.shape[1] % 2:
            return None
        first, second = rows[..., 0::2, 0].long(), rows[..., 1::2, 0].long()
        if (first % 2).any() or not torch.equal(second, first + 1):  # each source's two rows whole and in order
            return None
        order = (first // 2).tolist()
        if sorted(i for expert in order for i in expert) != list(range(len(names))):
            return None
        return [[fused.arrived[names[i]] for i in expert] for expert in order]


def _values(stored: Any) -> torch.Tensor:
    """A source's values for transformers' conversion ops: a reference read, a pre-quantized weight dequantized."""
    if isinstance(stored, Prequantized):
        return stored.dequantize()
    return stored.read() if isinstance(stored, Lazy) else stored
