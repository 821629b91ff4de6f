"""HQQ backend (1/2/3/4/8 bits): HQQ's quantizer and unpacking, our own storage of their results."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from hqq.core.quantize import Quantizer
from torch import nn

from qlora_fsdp.config.options import QuantConfig
from qlora_fsdp.parallel.distributed import DistEnv
from qlora_fsdp.quant.base import DequantizeMatmul, QuantBackend, QuantizedLinear, QuantizedWeight

# Groups are packed along dim 0 of the [groups, group_size] matrix; these bit widths pack that many groups into
# one row, so the group count must be a multiple of it (3-bit packing pads by itself).
GROUPS_PER_PACKED_ROW = {8: 1, 4: 2, 3: 1, 2: 4, 1: 8}


class HqqLinear(QuantizedLinear):
    """A linear layer whose weight is HQQ groups (packed ints, per-group scale and zero in compute dtype).

    A layer whose size does not split into whole groups is padded with zero groups at the end, so every layer
    keeps the configured group size (and its memory savings); `dequantize` cuts the padding off again.
    """

    def _packed_ints(self) -> torch.Tensor:
        return self.packed_bytes().view(self.meta["packed_dtype"]).view(self.meta["packed_shape"])

    def _hqq_meta(self) -> dict[str, Any]:
        return {**self.meta, "scale": self.state_tensor("scale"), "zero": self.state_tensor("zero")}

    def _dequantize(self) -> torch.Tensor:
        return dequantize_hqq(self._packed_ints(), self._hqq_meta(), self.out_features, self.in_features)

    def serialized(self) -> dict[str, Any]:
        """What HQQ's own `HQQLinear.state_dict()` holds (unencoded), which `HQQLinear.load_state_dict` and
        `AutoHQQHFModel.from_quantized` read: W_q as HQQ packed it, in its integer dtype (never viewed as float)."""
        if tuple(self.meta["shape"]) != (self.out_features, self.in_features):
            raise ValueError(
                f"a {self.out_features}x{self.in_features} weight does not split into whole groups of "
                f"{self.meta['group_size']}: it was padded, which HQQ's format cannot hold"
            )
        meta = {k: v for k, v in self.meta.items() if k not in ("packed_dtype", "packed_shape")}
        state = {"W_q": self._packed_ints(), **meta, **self.state_tensors()}
        state |= {"quant_scale": False, "quant_zero": False, "offload_meta": False, "stores_quant_config": True}
        if self.bias is not None:
            state["bias"] = self.bias
        return state

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        out = DequantizeMatmul.apply(x.to(self.compute_dtype), self)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.to(x.dtype)


def dequantize_hqq(packed: torch.Tensor, meta: dict[str, Any], rows: int, cols: int) -> torch.Tensor:
    """HQQ's own dequantization of packed ints with their meta (scale and zero in it), cut to [rows, cols]."""
    weight = Quantizer.dequantize(packed, meta)
    if tuple(weight.shape) != (rows, cols):
        weight = weight.flatten()[: rows * cols].view(rows, cols)
    return weight


class HqqBackend(QuantBackend):
    name = "hqq"
    # HQQ's optimizer stops on an error summed over the whole weight: a part quantized alone would differ.
    whole_weights = True
    library = "hqq"

    def __init__(
        self,
        *,
        storage_dtype: torch.dtype,
        compute_dtype: torch.dtype,
        shard_state: bool = False,
        nbits: int = 4,
        group_size: int = 64,
    ) -> None:
        super().__init__(storage_dtype=storage_dtype, compute_dtype=compute_dtype, shard_state=shard_state)
        self.nbits = nbits
        self.group_size = group_size

    @classmethod
    def from_config(
        cls, cfg: QuantConfig, *, storage_dtype: torch.dtype, compute_dtype: torch.dtype, shard_state: bool = False
    ) -> HqqBackend:
        return cls(
            storage_dtype=storage_dtype,
            compute_dtype=compute_dtype,
            shard_state=shard_state,
            nbits=cfg.hqq_bits,
            group_size=cfg.hqq_group_size,
        )

    @property
    def module_class(self) -> type[QuantizedLinear]:
        return HqqLinear

    def make_module(self, linear: nn.Linear) -> HqqLinear:
        return HqqLinear(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            storage_dtype=self.storage_dtype,
            compute_dtype=self.compute_dtype,
            shard_state=self.shard_state,
        )

    def padded(self, numel: int) -> int:
        """Elements after padding a weight of `numel` to whole groups that pack into whole rows."""
        unit = self.group_size * GROUPS_PER_PACKED_ROW[self.nbits]
        return -(-numel // unit) * unit

    def planned(self, shape: torch.Size) -> QuantizedWeight:
        """The padded weight's groups packed along dim 0 (3 bits: ten to an int32, the rows padded to tens; else
        8 // bits to a byte) by group_size columns, and a scale and zero per group in compute dtype."""
        groups = self.padded(shape.numel()) // self.group_size
        if self.nbits == 3:
            packed = torch.empty(-(-groups // 10), self.group_size, dtype=torch.int32, device="meta")
        else:
            packed = torch.empty(groups * self.nbits // 8, self.group_size, dtype=torch.uint8, device="meta")
        scale = torch.empty(groups, 1, dtype=self.compute_dtype, device="meta")
        meta = {"packed_dtype": packed.dtype, "packed_shape": packed.shape}
        return QuantizedWeight(packed.flatten().view(torch.uint8), {"scale": scale, "zero": scale.clone()}, meta)

    def quantize(self, weight: torch.Tensor, *, env: DistEnv | None = None) -> QuantizedWeight:
        # Whole weights only (see whole_weights): `env` is not used.
        w = weight
        padded = self.padded(w.numel())
        if padded != w.numel():
            w = F.pad(w.flatten(), (0, padded - w.numel())).view(-1, self.group_size)
        # round_zero for 4 bits: HQQ's own default. Kept in the metadata too, as HQQ's saved layers record them.
        settings = {"channel_wise": True, "optimize": True, "round_zero": self.nbits == 4}
        packed, meta = Quantizer.quantize(
            w,
            nbits=self.nbits,
            group_size=self.group_size,
            axis=1,
            bitpack=True,
            compute_dtype=self.compute_dtype,
            view_as_float=False,
            device=str(w.device),
            **settings,
        )
        meta |= settings
        # As HQQLinear does after quantizing: scale and zero live in compute dtype.
        state = {"scale": meta.pop("scale").to(self.compute_dtype), "zero": meta.pop("zero").to(self.compute_dtype)}
        meta |= {"compute_dtype": self.compute_dtype, "packed_dtype": packed.dtype, "packed_shape": packed.shape}
        return QuantizedWeight(packed.contiguous().flatten().view(torch.uint8), state, meta)


BACKEND = HqqBackend
