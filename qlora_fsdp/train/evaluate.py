"""The evaluation loss: token-weighted over the whole evaluation set, the same whatever the number of ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from qlora_fsdp.objectives.base import Objective, combined_loss


@dataclass(frozen=True)
class EvalResult:
    loss: float
    """The objective's loss over the whole evaluation set (SFT: mean cross-entropy per label token)."""
    tokens: int
    """What it was weighed by (SFT: label tokens; preference objectives: pairs)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The objective's own metrics over the set (rewards/accuracies...)."""

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf  # exp overflows a float past ~709


def evaluate(model: nn.Module, loader: DataLoader, *, objective: Objective, device: torch.device) -> EvalResult:
    """Sum the objective's loss parts, weights (label tokens for SFT) and metrics over this rank's rows, add them
    over ranks, divide once.

    The loss is the training forward's. Each rank's shard holds every row once across ranks (data.loader.EvalShard),
    and one float64 all-reduce of (sum, weight) makes the mean exact: a mean of per-rank means would weight ranks,
    not tokens. `model.eval()` turns LoRA dropout off; no_grad keeps no activations. The quantized layers' forwards
    are the training ones and never rewrite their weights (unlike bitsandbytes' Linear4bit, which repacks its weight
    in place in eval mode on some CPUs), so the training that follows sees the same bytes.
    """
    was_training = model.training
    sums: torch.Tensor | None = None
    model.eval()
    try:
        with torch.no_grad():
            for batch in loader:
                parts, metrics = objective.loss_sum(model, batch)
                weights = torch.tensor(objective.weights(batch), dtype=torch.float64, device=device)
                these = torch.cat([weights, parts.double(), metrics.to(device)])
                sums = these if sums is None else sums + these
    finally:
        model.train(was_training)
    if sums is None:
        raise RuntimeError("evaluation got no batch on this rank: its shard is never empty")
    dist.all_reduce(sums)
    count = len(weights)
    weight, parts = sums[:count], sums[count : 2 * count]
    metrics = objective.logged(sums[2 * count :].tolist(), weight.tolist())
    return EvalResult(loss=combined_loss(parts, weight).item(), tokens=int(weight[0].item()), metrics=metrics)
