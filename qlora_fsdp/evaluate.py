"""The evaluation loss: token-weighted over the whole evaluation set, the same whatever the number of ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from qlora_fsdp.objectives import Objective


@dataclass(frozen=True)
class EvalResult:
    loss: float
    """Mean cross-entropy per label token of the whole evaluation set."""
    tokens: int
    """Label tokens it was computed on."""

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf  # exp overflows a float past ~709


def evaluate(model: nn.Module, loader: DataLoader, *, objective: Objective, device: torch.device) -> EvalResult:
    """Sum the objective's loss and weight (label tokens for SFT) over this rank's rows, add both over ranks,
    divide once.

    The loss is the training forward's. Each rank's shard holds every row once across ranks (data.loader.EvalShard),
    and one float64 all-reduce of (sum, weight) makes the mean exact: a mean of per-rank means would weight ranks,
    not tokens. `model.eval()` turns LoRA dropout off; no_grad keeps no activations. The quantized layers' forwards
    are the training ones and never rewrite their weights (unlike bitsandbytes' Linear4bit, which repacks its weight
    in place in eval mode on some CPUs), so the training that follows sees the same bytes.
    """
    was_training = model.training
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    model.eval()
    try:
        with torch.no_grad():
            for batch in loader:
                totals[0] += objective.loss_sum(model, batch)[0].double()
                totals[1] += objective.weight(batch)
    finally:
        model.train(was_training)
    dist.all_reduce(totals)
    loss_total, tokens = totals.tolist()
    return EvalResult(loss=loss_total / max(tokens, 1.0), tokens=int(tokens))
