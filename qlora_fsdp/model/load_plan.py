"""Who reads, dequantizes and quantizes which weight while loading, so every rank does its share of the work.

Every rank streams the checkpoint's names in the same order and follows the same plan, made from the skeleton's
shapes alone, without communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from qlora_fsdp.parallel.distributed import DistEnv
from qlora_fsdp.quant import QuantBackend
from qlora_fsdp.quant.base import QuantizedLinear, QuantizedWeight


class WeightShares:
    """Which rank quantizes which whole weight of each decoder layer, for a backend that needs weights whole (HQQ).

    A rank quantizes the weights it owns as they arrive and drops the others; when a layer is complete, each
    owner broadcasts its results, so every rank ends with the bytes one process quantizing everything produces.
    Owners are fixed up front from the skeleton's shapes, the same on every rank without communication: largest
    weight first, each to the rank with the least work so far (carried across layers), so the ranks finish a
    layer's shares at about the same time.
    """

    def __init__(
        self,
        by_unit: dict[str, list[QuantizedLinear]],
        *,
        backend: QuantBackend,
        env: DistEnv,
        device: torch.device,
    ) -> None:
        self.by_unit = by_unit
        self.backend = backend
        self.env = env
        self.device = device
        self.owner: dict[int, int] = {}
        self.results: dict[int, QuantizedWeight] = {}
        work = [0] * env.world_size
        for modules in by_unit.values():
            for module in sorted(modules, key=lambda m: -m.in_features * m.out_features):
                rank = min(range(env.world_size), key=lambda r: (work[r], r))
                self.owner[id(module)] = rank
                work[rank] += module.in_features * module.out_features

    def covers(self, module: nn.Module) -> bool:
        return id(module) in self.owner

    def drop(self, module: nn.Module) -> None:
        """`module` was filled on every rank alike (kept from the checkpoint): its layer's exchange skips it."""
        if self.owner.pop(id(module), None) is not None:
            for modules in self.by_unit.values():
                if module in modules:
                    modules.remove(module)

    def arrive(self, module: QuantizedLinear, weight: torch.Tensor) -> None:
        """Quantize `weight` now if this rank owns it; another rank's is dropped, its result comes in exchange."""
        if self.owner[id(module)] == self.env.rank:
            self.results[id(module)] = self.backend.quantize(weight.to(self.device))

    def exchange(self, unit: str) -> None:
        """Every weight of a complete `unit` into its layer on every rank, each sent from its owner.

        One object collective carries the layer's small metadata (scalar meta, dtypes and shapes); each weight's
        bytes then go in one broadcast of a flat uint8 tensor on the weights' device (gloo or NCCL alike).
        """
        modules = self.by_unit.pop(unit, [])
        if not modules:
            return
        mine = {i: self.results.pop(id(m)) for i, m in enumerate(modules) if self.owner[id(m)] == self.env.rank}
        layouts: list[dict[int, tuple]] = [{} for _ in range(self.env.world_size)]
        dist.all_gather_object(layouts, {i: _layout(q) for i, q in mine.items()})
        for i, module in enumerate(modules):
            owner = self.owner[id(module)]
            module.set_quantized(_broadcast(mine.get(i), layouts[owner][i], src=owner, device=self.device))


def _layout(quantized: QuantizedWeight) -> tuple[int, list[tuple[str, torch.dtype, torch.Size]], dict]:
    """What a receiver needs to rebuild `quantized` from its bytes: packed size, state dtypes and shapes, meta."""
    states = [(name, t.dtype, t.shape) for name, t in quantized.state.items()]
    return quantized.packed.numel(), states, quantized.meta


def _broadcast(quantized: QuantizedWeight | None, layout: tuple, *, src: int, device: torch.device) -> QuantizedWeight:
    """Rank `src`'s `quantized` on every rank (None elsewhere): packed bytes and state sent as one flat buffer."""
    packed_numel, states, meta = layout
    sizes = [packed_numel, *(shape.numel() * dtype.itemsize for _, dtype, shape in states)]
    if quantized is not None:
        state_bytes = [t.contiguous().flatten().view(torch.uint8) for t in quantized.state.values()]
        dist.broadcast(torch.cat([quantized.packed.flatten(), *state_bytes]), src=src)
        return quantized
    buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=src)
    packed, *parts = buffer.split(sizes)
    state = {name: t.clone().view(dtype).view(shape) for (name, dtype, shape), t in zip(states, parts, strict=True)}
    return QuantizedWeight(packed.clone(), state, meta)
