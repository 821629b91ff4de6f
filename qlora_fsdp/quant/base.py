"""The interface every quantization backend implements, so loading, FSDP wrapping and checks stay backend-agnostic.

A backend turns `nn.Linear` layers of a meta-device skeleton into its quantized module, fills them as weights stream
in, and tells FSDP which module classes its MixedPrecision must leave alone. Its packed bytes always live in a float
tensor of the run's parameter dtype (`storage_dtype`), because FSDP flattens one dtype per unit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch import nn

from qlora_fsdp.config import QuantConfig


class QuantBackend(ABC):
    """One quantization library behind the four operations the rest of the program needs."""

    name: str

    def __init__(self, *, storage_dtype: torch.dtype, compute_dtype: torch.dtype) -> None:
        # FSDP flattens the packed tensor together with the unit's other parameters: same dtype as them.
        self.storage_dtype = storage_dtype
        # What the weight is dequantized to for the matmul; independent of storage.
        self.compute_dtype = compute_dtype

    @classmethod
    @abstractmethod
    def from_config(cls, cfg: QuantConfig, *, storage_dtype: torch.dtype, compute_dtype: torch.dtype) -> QuantBackend:
        """The backend with its own flags read from the quantization config."""

    @abstractmethod
    def make_module(self, linear: nn.Linear, *, device: torch.device) -> nn.Module:
        """An empty quantized replacement for a (meta) `nn.Linear`, ready for `load_weight`."""

    @abstractmethod
    def load_weight(self, module: nn.Module, weight: torch.Tensor, *, device: torch.device, keep: bool) -> None:
        """Quantize `weight` into `module` on `device`.

        With keep=False the packed tensor is left on the meta device (a low-memory rank), but the quantization
        state (scales, zeros, bnb quant_state) is real: FSDP's broadcast only covers parameters and buffers.
        """

    @abstractmethod
    def packed(self, module: nn.Module) -> torch.Tensor:
        """The module's packed-bytes tensor as FSDP sees it (a float view)."""

    @abstractmethod
    def dequantize(self, module: nn.Module) -> torch.Tensor:
        """The module's weight in compute dtype, shaped [out_features, in_features]."""

    @abstractmethod
    def quant_state_tensors(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Every tensor of the quantization state (not parameters), for cross-rank identity checks."""

    @property
    @abstractmethod
    def module_classes(self) -> tuple[type[nn.Module], ...]:
        """Quantized module classes: FSDP MixedPrecision ignores them so packed storage is never cast."""

    def is_quantized(self, module: nn.Module) -> bool:
        return isinstance(module, self.module_classes)

    def replace_linears(
        self, model: nn.Module, *, should_quantize: Callable[[str], bool], device: torch.device
    ) -> list[str]:
        """Swap every `nn.Linear` whose qualified name passes `should_quantize`; returns the swapped names."""
        swapped = []
        for name, module in list(model.named_modules()):
            if type(module) is nn.Linear and should_quantize(name):
                parent_name, _, child = name.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                setattr(parent, child, self.make_module(module, device=device))
                swapped.append(name)
        return swapped
