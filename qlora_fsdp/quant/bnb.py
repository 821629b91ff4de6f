"""bitsandbytes 4-bit (NF4/FP4) backend: bitsandbytes' quantizer and kernels, our own storage of their results."""

from __future__ import annotations

import bitsandbytes as bnb
import bitsandbytes.functional as bnbf
import torch
from torch import nn

from qlora_fsdp.config import QuantConfig
from qlora_fsdp.quant.base import QuantBackend, QuantizedLinear, QuantizedWeight

BLOCKSIZE = 64
NESTED_BLOCKSIZE = 256  # bitsandbytes' fixed block size for double-quantized absmax


class Bnb4bitLinear(QuantizedLinear):
    """A linear layer whose weight is bitsandbytes 4-bit blocks.

    The state tensors are bitsandbytes' `QuantState` taken apart (absmax, code and, with double quantization, the
    nested absmax, nested code and offset), rebuilt at each forward from whatever tensors FSDP put back in place.
    The forward never runs `bnb.nn.Linear4bit.forward`, which on CPU repacks `weight.data` in place in eval mode.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        storage_dtype: torch.dtype,
        compute_dtype: torch.dtype,
        quant_type: str,
        double_quant: bool,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, storage_dtype=storage_dtype, compute_dtype=compute_dtype)
        self.quant_type = quant_type
        self.double_quant = double_quant

    def quant_state(self) -> bnbf.QuantState:
        nested = None
        offset = None
        if self.double_quant:
            nested = bnbf.QuantState(
                absmax=self.state_tensor("nested_absmax"),
                code=self.state_tensor("nested_code"),
                blocksize=NESTED_BLOCKSIZE,
                dtype=torch.float32,
            )
            offset = self.state_tensor("offset")
        return bnbf.QuantState(
            absmax=self.state_tensor("absmax"),
            shape=torch.Size((self.out_features, self.in_features)),
            code=self.state_tensor("code"),
            blocksize=BLOCKSIZE,
            quant_type=self.quant_type,
            dtype=self.compute_dtype,
            offset=offset,
            state2=nested,
        )

    def _dequantize(self) -> torch.Tensor:
        return bnbf.dequantize_4bit(self.packed_bytes().view(-1, 1), self.quant_state()).to(self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        out = bnb.matmul_4bit(x.to(self.compute_dtype), self.packed_bytes().view(-1, 1), self.quant_state(), bias=bias)
        return out.to(x.dtype)


class BnbBackend(QuantBackend):
    name = "bnb"

    def __init__(
        self,
        *,
        storage_dtype: torch.dtype,
        compute_dtype: torch.dtype,
        quant_type: str = "nf4",
        double_quant: bool = True,
    ) -> None:
        super().__init__(storage_dtype=storage_dtype, compute_dtype=compute_dtype)
        self.quant_type = quant_type
        self.double_quant = double_quant

    @classmethod
    def from_config(cls, cfg: QuantConfig, *, storage_dtype: torch.dtype, compute_dtype: torch.dtype) -> BnbBackend:
        return cls(
            storage_dtype=storage_dtype,
            compute_dtype=compute_dtype,
            quant_type=cfg.bnb_quant_type,
            double_quant=cfg.bnb_double_quant,
        )

    @property
    def module_class(self) -> type[QuantizedLinear]:
        return Bnb4bitLinear

    def make_module(self, linear: nn.Linear) -> Bnb4bitLinear:
        return Bnb4bitLinear(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            storage_dtype=self.storage_dtype,
            compute_dtype=self.compute_dtype,
            quant_type=self.quant_type,
            double_quant=self.double_quant,
        )

    def quantize(self, weight: torch.Tensor) -> QuantizedWeight:
        # The weight is quantized from compute dtype, as Hugging Face's 4-bit loading does.
        packed, qs = bnbf.quantize_4bit(
            weight.to(self.compute_dtype).contiguous(),
            blocksize=BLOCKSIZE,
            compress_statistics=self.double_quant,
            quant_type=self.quant_type,
        )
        state = {"absmax": qs.absmax, "code": qs.code}
        if self.double_quant:
            state |= {"nested_absmax": qs.state2.absmax, "nested_code": qs.state2.code, "offset": qs.offset}
        return QuantizedWeight(packed, state)


BACKEND = BnbBackend
