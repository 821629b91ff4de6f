"""The interface every quantization backend implements, so loading, sharding and checks stay backend-agnostic.

A backend swaps `nn.Linear` layers of a meta-device skeleton for its `QuantizedLinear` subclass and quantizes weights
into them as they stream in. How the packed bytes are stored is not the backend's business: `storage_dtype`, chosen
by the FSDP version, decides it for every backend, and FSDP1's MixedPrecision ignores every `QuantizedLinear`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qlora_fsdp.config.options import QuantConfig
from qlora_fsdp.parallel.distributed import DistEnv


@dataclass
class QuantizedWeight:
    """What a backend's quantizer produced for one weight."""

    packed: torch.Tensor
    """The packed low-bit values as uint8 bytes."""
    state: dict[str, torch.Tensor]
    """Tensors needed to decode them (scales, zeros, codes), in their own dtypes."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Scalar metadata (bit width, packing, shapes) the backend's layer reads back."""

    def to(self, device: torch.device) -> QuantizedWeight:
        """The same bytes and state on `device` (moved, never converted)."""
        state = {name: t.to(device) for name, t in self.state.items()}
        return QuantizedWeight(self.packed.to(device), state, self.meta)


class QuantizedLinear(nn.Linear):
    """A frozen linear layer held as packed low-bit bytes plus the quantization state that decodes them.

    Every tensor is kept as flat bytes; the dtypes and shapes to read them back are plain attributes, so no cast
    can ever touch them. `storage_dtype` and `shard_state` pick the layout the FSDP version needs (decided in
    `qlora_fsdp.parallel.sharding.PackedLayout`):
    - uint8 (FSDP2 on torch 2.12+): the packed bytes and every state tensor are uint8 parameters of this module, so
      FSDP2 shards them all with the decoder layer and mixed precision, which skips non-floating parameters, never
      casts them.
    - a float dtype with `shard_state` (FSDP2 on older torch, which cannot shard integer parameters): the packed
      bytes and every state tensor are zero-padded to whole elements and viewed as that dtype, the one FSDP2
      gathers in, so its mixed precision has nothing to cast.
    - a float dtype without (FSDP1): the packed bytes are viewed as that dtype, because FSDP1 flattens one float
      dtype per unit; the state tensors stay plain attributes, replicated on every rank (their dtypes differ).

    Subclasses subclass `nn.Linear` so PEFT wraps them with its plain LoRA layer; they implement `_dequantize` and
    `_forward`. `W_q` aliases the packed weight because PEFT's DoRA dequantizes any module that has it through
    `module.dequantize()`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        storage_dtype: torch.dtype,
        compute_dtype: torch.dtype,
        shard_state: bool = False,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device="meta")
        self.storage_dtype = storage_dtype
        self.shard_state = shard_state
        # What the weight is dequantized to for the matmul; independent of storage.
        self.compute_dtype = compute_dtype
        self.weight = nn.Parameter(torch.empty(0, dtype=storage_dtype, device="meta"), requires_grad=False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.packed_nbytes = 0
        self.layouts: dict[str, tuple[torch.dtype, torch.Size]] = {}
        """name -> (dtype, shape) of each quantization-state tensor."""
        self.meta: dict[str, Any] = {}

    @property
    def W_q(self) -> torch.Tensor:
        return self.weight

    @property
    def state_as_parameters(self) -> bool:
        """State tensors are parameters (sharded by FSDP2) rather than plain tensors replicated on every rank."""
        return self.storage_dtype == torch.uint8 or self.shard_state

    def set_quantized(self, quantized: QuantizedWeight) -> None:
        """Hold the packed bytes and state tensors in this layer's storage layout: views, never casts."""
        if quantized.packed.dtype != torch.uint8:
            raise TypeError(f"packed bytes must be uint8, got {quantized.packed.dtype}")
        self.meta = dict(quantized.meta)
        flat = quantized.packed.detach().contiguous().flatten()
        self.packed_nbytes = flat.numel()
        self.weight = nn.Parameter(self._stored(flat), requires_grad=False)
        self.layouts = {}
        for name, tensor in quantized.state.items():
            self.layouts[name] = (tensor.dtype, tensor.shape)
            as_bytes = tensor.detach().contiguous().flatten().view(torch.uint8)
            if self.state_as_parameters:
                setattr(self, name, nn.Parameter(self._stored(as_bytes), requires_grad=False))
            else:
                object.__setattr__(self, name, as_bytes)

    def _stored(self, flat_bytes: torch.Tensor) -> torch.Tensor:
        """uint8 bytes viewed as the storage dtype; a float view needs whole elements, so zero bytes are appended,
        which `packed_bytes` and `state_tensor` cut off again."""
        item = torch.empty((), dtype=self.storage_dtype).element_size()
        return F.pad(flat_bytes, (0, -flat_bytes.numel() % item)).view(self.storage_dtype)

    def packed_bytes(self) -> torch.Tensor:
        """The packed weight as uint8 (whatever parameter FSDP put in `weight`: shard view or unsharded tensor)."""
        return self.weight.view(torch.uint8)[: self.packed_nbytes]

    def state_tensor(self, name: str) -> torch.Tensor:
        dtype, shape = self.layouts[name]
        nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
        return getattr(self, name).view(torch.uint8)[:nbytes].view(dtype).view(shape)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every quantization-state tensor in its own dtype and shape."""
        return {name: self.state_tensor(name) for name in self.layouts}

    def state_bytes(self) -> dict[str, torch.Tensor]:
        """The state tensors as this module stores them (flat bytes), for fingerprints and byte counts."""
        return {name: getattr(self, name) for name in self.layouts}

    @property
    def is_meta(self) -> bool:
        return self.weight.is_meta

    def dequantize(self) -> torch.Tensor:
        """The weight in compute dtype, shaped [out_features, in_features] (a meta tensor before loading)."""
        if self.is_meta:
            return torch.empty(self.out_features, self.in_features, dtype=self.compute_dtype, device="meta")
        return self._dequantize()

    def _dequantize(self) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.numel():
            # No rows (an expert that received no token): nothing to dequantize. The empty result still depends on
            # `x`, so backward reaches this layer on every rank alike, as FSDP1's per-layer units need.
            zero = torch.zeros((), dtype=x.dtype, device=x.device).expand(self.out_features, self.in_features)
            return x @ zero.t()
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def serialized(self) -> dict[str, Any]:
        """This layer as its library saves it (keys relative to the layer, bias included): the bytes training
        used, in the layout the library's own loader reads, for export. Raises ValueError where it has none."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        state = "parameters" if self.state_as_parameters else "replicated"
        return f"{super().extra_repr()}, storage={self.storage_dtype}, state={state}, compute={self.compute_dtype}"


class DequantizeMatmul(torch.autograd.Function):
    """x @ W.T with W dequantized in forward and again in backward, so no dequantized weight is kept for backward.

    Nothing is saved for backward: the layer itself is kept, and its packed weights are read again when backward
    runs, by which time FSDP has gathered them back. Saving them would hand the whole packed layer to saved-tensor
    hooks such as --activation_offload's, which would copy it to host memory at every step.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:  # type: ignore[override]
        ctx.layer = layer
        return x @ layer.dequantize().t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        return grad @ ctx.layer.dequantize().to(grad.dtype), None


class QuantBackend(ABC):
    """One quantization library behind the operations the rest of the program needs."""

    name: str
    whole_weights: bool = False
    """True where the quantizer needs each weight whole, so `quantize` cannot split one weight between ranks: the
    loader then gives each rank whole weights of a decoder layer and exchanges the results (see model.py)."""
    library: str
    """Its distribution name, whose version the manifest records beside the bytes it quantized."""

    def __init__(self, *, storage_dtype: torch.dtype, compute_dtype: torch.dtype, shard_state: bool = False) -> None:
        self.storage_dtype = storage_dtype
        self.compute_dtype = compute_dtype
        self.shard_state = shard_state

    @classmethod
    @abstractmethod
    def from_config(
        cls, cfg: QuantConfig, *, storage_dtype: torch.dtype, compute_dtype: torch.dtype, shard_state: bool = False
    ) -> QuantBackend:
        """The backend with its own flags read from the quantization config."""

    @property
    @abstractmethod
    def module_class(self) -> type[QuantizedLinear]:
        """This backend's quantized layer class."""

    @abstractmethod
    def make_module(self, linear: nn.Linear) -> QuantizedLinear:
        """An empty (meta) quantized replacement for `linear`, filled later by `load_weight`."""

    @abstractmethod
    def quantize(self, weight: torch.Tensor, *, env: DistEnv | None = None) -> QuantizedWeight:
        """Quantize a [out, in] weight on its device.

        With `env`, every rank of the job calls this with the same weight at the same time: a backend may have
        each rank quantize a part and share the results, as long as every rank ends with bytes identical to one
        process quantizing the whole weight. A backend that cannot split its work ignores `env`.
        """

    @abstractmethod
    def planned(self, shape: torch.Size) -> QuantizedWeight:
        """What `quantize` returns for an [out, in] weight of `shape`, as meta tensors of the same shapes and dtypes:
        scripts/plan.py sizes a model without its weights from this (the tests hold it to `quantize`)."""

    def is_quantized(self, module: nn.Module) -> bool:
        return isinstance(module, self.module_class)

    def load_weight(
        self, module: QuantizedLinear, weight: torch.Tensor, *, device: torch.device, env: DistEnv | None = None
    ) -> None:
        """Quantize `weight` on `device` into `module` (see `quantize` for `env`)."""
        module.set_quantized(self.quantize(weight.to(device), env=env))

    def replace_linears(self, model: nn.Module, *, should_quantize: Callable[[str], bool]) -> list[str]:
        """Swap every `nn.Linear` whose qualified name passes `should_quantize`; returns the swapped names."""
        swapped = []
        for name, module in list(model.named_modules()):
            if type(module) is nn.Linear and should_quantize(name):
                parent_name, _, child = name.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                setattr(parent, child, self.make_module(module))
                swapped.append(name)
        return swapped
