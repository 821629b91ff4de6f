"""What each `--precision` mode means for parameters, FSDP mixed precision and autocast.

Below both the sharding code (`fsdp*.py`) and the objectives, which read a mode's dtypes; of ours it imports only the
config, which lists the modes' names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qlora_fsdp.config.options import check_registry

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Precision:
    """What `--precision` means for parameters, FSDP mixed precision and autocast."""

    param_dtype: torch.dtype
    """Dtype of every unquantized parameter (and, under FSDP1, of the float view of the packed bytes)."""
    autocast_dtype: torch.dtype | None = None
    """Forward/backward run under torch.autocast in this dtype (None: no autocast)."""
    mixed_precision: tuple[torch.dtype, torch.dtype, torch.dtype] | None = None
    """FSDP mixed-precision (param, reduce, buffer) dtypes; None: no policy. FSDP2 never casts buffers."""
    grad_scaler: bool = False
    """fp16 needs loss scaling."""

    @property
    def compute_dtype(self) -> torch.dtype:
        if self.autocast_dtype is not None:
            return self.autocast_dtype
        return self.mixed_precision[0] if self.mixed_precision else self.param_dtype


_FP32, _BF16, _FP16 = torch.float32, torch.bfloat16, torch.float16
PRECISIONS = {
    "fp32": Precision(_FP32),
    "bf16": Precision(_BF16),
    "fp16_autocast": Precision(_FP32, _FP16, (_FP32, _FP32, _FP32), grad_scaler=True),
    "bf16_autocast": Precision(_FP32, _BF16, (_FP32, _FP32, _FP32)),
    "bf16_buffers_autocast": Precision(_BF16, _BF16, (_BF16, _BF16, _FP32)),
    # fsdp_qlora's "true mixed precision": fp32 master weights, bf16 compute, fp32 gradient reduction.
    "mp_bf16": Precision(_FP32, None, (_BF16, _FP32, _FP32)),
}
check_registry(PRECISIONS, "precision")


def quant_compute_dtype(precision: Precision, requested: str) -> torch.dtype:
    """What `--compute_dtype` means under a precision mode: auto follows the mode's compute dtype."""
    return precision.compute_dtype if requested == "auto" else DTYPES[requested]
