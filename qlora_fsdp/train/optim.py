"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from fractions import Fraction

import torch
from torch.optim.lr_scheduler import LambdaLR

from qlora_fsdp.config.options import OptimConfig, check_registry

# name -> (class, whether torch has a fused CUDA kernel for it)
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], bool]] = {
    "adamw": (torch.optim.AdamW, True),
    "adam": (torch.optim.Adam, True),
    "sgd": (torch.optim.SGD, True),
    "adadelta": (torch.optim.Adadelta, False),
}
check_registry(OPTIMIZERS, "optimizer")


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """The chosen optimizer over the trainable parameters only (frozen quantized storage has no state).

    Fused kernels are used where torch has one and the parameters are on CUDA.
    """
    trainable = [p for p in params if p.requires_grad]
    cls, has_fused = OPTIMIZERS[cfg.optimizer]
    extra = {"fused": True} if has_fused and trainable and all(p.is_cuda for p in trainable) else {}
    return cls(trainable, lr=cfg.lr, weight_decay=cfg.wd, **extra)


# Decay after warmup: progress in [0, 1] and the cosine floor -> multiplier of --lr.
DECAYS: dict[str, Callable[[float, float], float]] = {
    "constant": lambda progress, floor: 1.0,
    "linear": lambda progress, floor: 1.0 - progress,
    "cosine": lambda progress, floor: floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)),
}
check_registry(DECAYS, "lr_scheduler")


def lr_factor(cfg: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """Multiplier of --lr at optimizer step `step` (0-based): linear warmup, then the chosen decay."""
    # Exact decimal arithmetic: in binary 0.07 * 100 is 7.000000000000001, which would round up to 8.
    warmup = math.ceil(Fraction(str(cfg.warmup_ratio)) * total_steps)
    decay = DECAYS[cfg.lr_scheduler]

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return decay(progress, cfg.cosine_min_lr_ratio)

    return factor


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int, *, start_step: int = 0
) -> LambdaLR:
    """The schedule from --lr and the schedule flags, positioned at `start_step` optimizer steps done.

    A resumed run rebuilds it rather than restoring it, so the flags it was given (a new --lr, say) hold from the
    resumed step on, exactly as if the run had always used them; unchanged flags give the uninterrupted run's rates.
    """
    for group in optimizer.param_groups:
        # A restored optimizer carries the saved run's values; the schedule starts from this run's flags.
        group["initial_lr"] = cfg.lr
        group["weight_decay"] = cfg.wd
    return LambdaLR(optimizer, lr_factor(cfg, total_steps), last_epoch=start_step - 1)
