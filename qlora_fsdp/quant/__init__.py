"""Quantization backends, listed in `BACKENDS`: `--quant NAME` is the `BACKEND` of the module listed for NAME.

A new backend is one new file here, one entry below, its name in config/options.py's QuantName and its own flags;
each library is imported only when its backend is used. `experts.py` is not a backend: it quantizes
mixture-of-experts tensors with any of them.
"""

from __future__ import annotations

import importlib

import torch

from qlora_fsdp.config.options import QuantConfig, check_registry
from qlora_fsdp.quant.base import QuantBackend

BACKENDS = {"bnb": f"{__name__}.bnb", "hqq": f"{__name__}.hqq"}
"""--quant name -> the module whose `BACKEND` it is (imported only when chosen)."""
check_registry(BACKENDS, "quant", besides=("none",))


def backend_names() -> tuple[str, ...]:
    """Every backend's --quant name, without importing any quantization library."""
    return tuple(sorted(BACKENDS))


def make_backend(
    cfg: QuantConfig, *, storage_dtype: torch.dtype, compute_dtype: torch.dtype, shard_state: bool = False
) -> QuantBackend | None:
    """The backend for `--quant`, or None for `--quant none` (plain LoRA or full fine-tuning).

    `storage_dtype` and `shard_state` are the FSDP version's packed layout
    (`qlora_fsdp.parallel.sharding.PackedLayout`).
    """
    if cfg.quant == "none":
        return None
    cls = importlib.import_module(BACKENDS[cfg.quant]).BACKEND
    return cls.from_config(cfg, storage_dtype=storage_dtype, compute_dtype=compute_dtype, shard_state=shard_state)


__all__ = ["QuantBackend", "backend_names", "make_backend"]
