"""bitsandbytes 4-bit (NF4/FP4) backend."""

from __future__ import annotations

import bitsandbytes as bnb
import torch
from bitsandbytes.nn import Linear4bit, Params4bit
from torch import nn

from qlora_fsdp.config import QuantConfig
from qlora_fsdp.quant.base import QuantBackend

BLOCKSIZE = 64


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
    def module_classes(self) -> tuple[type[nn.Module], ...]:
        return (Linear4bit,)

    def make_module(self, linear: nn.Linear, *, device: torch.device) -> nn.Module:
        return Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            compute_dtype=self.compute_dtype,
            compress_statistics=self.double_quant,
            quant_type=self.quant_type,
            quant_storage=self.storage_dtype,
            device="meta",
        )

    def load_weight(self, module: nn.Module, weight: torch.Tensor, *, device: torch.device, keep: bool) -> None:
        # Quantize through the functional API: `Params4bit.to("meta")` would move the quant_state to meta too.
        packed, quant_state = bnb.functional.quantize_4bit(
            weight.to(device=device, dtype=self.compute_dtype).contiguous(),
            blocksize=BLOCKSIZE,
            compress_statistics=self.double_quant,
            quant_type=self.quant_type,
            quant_storage=self.storage_dtype,
        )
        data = packed.cpu() if keep else torch.empty_like(packed, device="meta")
        module.weight = Params4bit(
            data,
            requires_grad=False,
            quant_state=quant_state,
            blocksize=BLOCKSIZE,
            compress_statistics=self.double_quant,
            quant_type=self.quant_type,
            quant_storage=self.storage_dtype,
            module=module,
            bnb_quantized=True,
        )
        # FSDP replaces the parameter by a plain view; Linear4bit then recovers the state from the module.
        module.quant_state = quant_state

    def packed(self, module: nn.Module) -> torch.Tensor:
        return module.weight

    def dequantize(self, module: nn.Module) -> torch.Tensor:
        data = module.weight.data if isinstance(module.weight, nn.Parameter) else module.weight
        return bnb.functional.dequantize_4bit(data, module.quant_state).to(self.compute_dtype)

    def quant_state_tensors(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return {k: v for k, v in module.quant_state.as_dict(packed=True).items() if isinstance(v, torch.Tensor)}


BACKEND = BnbBackend
