"""HQQ backend (1/2/3/4/8 bits), packed with integer ops and `.view()`ed as the FSDP parameter dtype."""

from __future__ import annotations

import torch
from hqq.core.quantize import HQQBackend, HQQLinear, Quantizer, hqq_base_quant_config
from torch import nn

from qlora_fsdp.config import QuantConfig
from qlora_fsdp.quant.base import QuantBackend

# The pure-PyTorch backend dequantizes with autograd-friendly ops and runs on CPU and GPU alike.
HQQLinear.set_backend(HQQBackend.PYTORCH)


class HqqBackend(QuantBackend):
    name = "hqq"

    def __init__(
        self, *, storage_dtype: torch.dtype, compute_dtype: torch.dtype, nbits: int = 4, group_size: int = 64
    ) -> None:
        super().__init__(storage_dtype=storage_dtype, compute_dtype=compute_dtype)
        self.nbits = nbits
        self.group_size = group_size

    @classmethod
    def from_config(cls, cfg: QuantConfig, *, storage_dtype: torch.dtype, compute_dtype: torch.dtype) -> HqqBackend:
        return cls(
            storage_dtype=storage_dtype, compute_dtype=compute_dtype, nbits=cfg.hqq_bits, group_size=cfg.hqq_group_size
        )

    @property
    def module_classes(self) -> tuple[type[nn.Module], ...]:
        return (HQQLinear,)

    def make_module(self, linear: nn.Linear, *, device: torch.device) -> nn.Module:
        # view_as_float lives in the quant meta: dequantize() views W_q back to its integer dtype before unpacking.
        config = hqq_base_quant_config(nbits=self.nbits, group_size=self.group_size, view_as_float=True)
        module = HQQLinear(None, config, compute_dtype=self.compute_dtype, device=str(device), initialize=False)
        module.in_features, module.out_features = linear.in_features, linear.out_features
        if linear.bias is not None:
            module.bias = nn.Parameter(torch.empty(linear.out_features, device="meta"), requires_grad=False)
        return module

    def load_weight(self, module: nn.Module, weight: torch.Tensor, *, device: torch.device, keep: bool) -> None:
        config = module.quant_config
        # HQQ moves the bias along with the weight; the bias is loaded separately as a plain parameter.
        bias, module.bias = module.bias, None
        module.quantize(
            weight.to(device),
            weight_quant_params=config["weight_quant_params"],
            scale_quant_params=config["scale_quant_params"],
            zero_quant_params=config["zero_quant_params"],
        )
        # HQQ viewed the packed ints as compute_dtype; FSDP needs them in the storage dtype. Re-view, never cast.
        ints = module.W_q.data.view(module.meta["unpack_view_dtype"])
        packed = ints.view(self.storage_dtype)
        data = packed.cpu() if keep else torch.empty_like(packed, device="meta")
        module.W_q = nn.Parameter(data, requires_grad=False)
        module.bias = bias

    def packed(self, module: nn.Module) -> torch.Tensor:
        return module.W_q

    def dequantize(self, module: nn.Module) -> torch.Tensor:
        return Quantizer.dequantize(module.W_q.data, module.meta).to(self.compute_dtype)

    def quant_state_tensors(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return {k: v for k, v in module.meta.items() if isinstance(v, torch.Tensor)}


BACKEND = HqqBackend
