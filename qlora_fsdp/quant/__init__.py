"""Quantization backends, found by module name: `--quant NAME` is `qlora_fsdp/quant/NAME.py`'s `BACKEND`.

A new backend is one new file here (plus its own flags in config.py); each library is imported only when its
backend is used.
"""

from __future__ import annotations

import importlib
import pkgutil

import torch

from qlora_fsdp.config import QuantConfig
from qlora_fsdp.quant.base import QuantBackend

_NOT_BACKENDS = {"base", "experts"}


def backend_names() -> tuple[str, ...]:
    """Every backend module in this package, without importing any quantization library."""
    return tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in _NOT_BACKENDS))


def make_backend(
    cfg: QuantConfig, *, storage_dtype: torch.dtype, compute_dtype: torch.dtype, shard_state: bool = False
) -> QuantBackend | None:
    """The backend for `--quant`, or None for `--quant none` (plain LoRA or full fine-tuning).

    `storage_dtype` and `shard_state` are the FSDP version's packed layout (`qlora_fsdp.fsdp.PackedLayout`).
    """
    if cfg.quant == "none":
        return None
    cls = importlib.import_module(f"{__name__}.{cfg.quant}").BACKEND
    return cls.from_config(cfg, storage_dtype=storage_dtype, compute_dtype=compute_dtype, shard_state=shard_state)


__all__ = ["QuantBackend", "backend_names", "make_backend"]
