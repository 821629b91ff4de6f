"""GRPO's policy loss on sampled completions, as TRL's GRPOTrainer computes it (its `_compute_loss`).

A batch holds completions (prompt then completion, the completion's tokens labelled), each with its advantage, and
optionally the per-token log-probs the completion was sampled under (`old_logps`, when --num_iterations reuses a
generation for several steps) and the reference's (`ref_logps`, computed once per generation; without them the
reference forward runs here, the model with its adapters off). With the ratio c = pi / pi_old per token:
- grpo, bnpo, dr_grpo, dapo: -min(c x A, clip(c, 1 - epsilon, 1 + epsilon_high) x A);
- cispo: -min(c, epsilon_high) x A x log pi, the clipped ratio without gradient;
plus beta x c x (exp(ref - log pi) - (ref - log pi) - 1) when beta > 0: the k3 estimate of the KL to the reference,
weighted by the ratio as TRL does by default (use_bias_correction_kl: the unbiased reverse-KL gradient; the ratio
is differentiable, so this changes the gradient even where it is 1).

How the per-token losses add up (TRL's, made exact across ranks): grpo averages each completion's tokens, then the
completions; dr_grpo sums tokens and divides by the completions x --max_completion_length; bnpo, dapo and cispo
divide the tokens' sum by the step's completion tokens over every rank (TRL's bnpo divides each rank's micro-batch by
its own; its dapo and cispo by the whole step's, as here). Each is a sum divided by a count of the whole step, so N
ranks x batch B equal 1 rank x batch N*B.
"""

from __future__ import annotations

import torch
from torch import nn

from qlora_fsdp.data import IGNORE_INDEX
from qlora_fsdp.objectives.base import Forward, Objective
from qlora_fsdp.objectives.reference import reference_logps

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
ADVANTAGES, OLD_LOGPS, REF_LOGPS = "advantages", "old_logps", "ref_logps"
"""A batch's keys: [rows] advantages; [rows, width - 1] per-token log-probs aligned with labels[:, 1:]."""
_SUMS = ("tokens", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


class GrpoObjective(Objective):
    """TRL's metrics, each a mean over the step's completion tokens: `kl` (when beta > 0) and the clip ratios
    (`clip_ratio/low_mean`, `/high_mean`, `/region_mean`; cispo's `cispo_clip_ratio`)."""

    metric_names = _SUMS

    def __init__(self, forward: Forward, *, loss_type: str, beta: float, epsilon: float, epsilon_high: float,
                 max_completion_length: int) -> None:  # fmt: skip
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown GRPO loss type {loss_type!r}")
        self.forward, self.loss_type, self.beta = forward, loss_type, beta
        self.epsilon, self.epsilon_high, self.max_completion_length = epsilon, epsilon_high, max_completion_length

    def weights(self, batch: dict[str, torch.Tensor]) -> tuple[int, ...]:
        if self.loss_type in ("grpo", "dr_grpo"):
            return (batch["input_ids"].shape[0],)
        return (int(_mask(batch).sum()),)

    def loss_sum(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.forward.device
        mask = _mask(batch).to(device)
        logps = -self.forward(model, batch, per_token=True)
        old = batch[OLD_LOGPS].to(device) if OLD_LOGPS in batch else logps.detach()
        advantages = batch[ADVANTAGES].to(device)[:, None]
        ratio = torch.exp(logps - old)
        if self.loss_type == "cispo":
            per_token = -torch.clamp(ratio, max=self.epsilon_high).detach() * advantages * logps
        else:
            clipped = torch.clamp(ratio, 1 - self.epsilon, 1 + self.epsilon_high)
            per_token = -torch.min(ratio * advantages, clipped * advantages)
        kl = torch.zeros_like(logps)
        if self.beta:
            reference = batch[REF_LOGPS].to(device) if REF_LOGPS in batch else reference_logps(
                model, batch, forward=self.forward, per_token=True)  # fmt: skip
            gap = reference - logps
            kl = (torch.exp(gap) - gap - 1) * ratio  # TRL's use_bias_correction_kl, its default
            per_token = per_token + self.beta * kl
        summed = (per_token * mask).sum(-1)
        if self.loss_type == "grpo":
            loss = (summed / mask.sum(-1).clamp(min=1)).sum()
        elif self.loss_type == "dr_grpo":
            loss = summed.sum() / self.max_completion_length
        else:
            loss = summed.sum()
        with torch.no_grad():
            if self.loss_type == "cispo":
                low = high = (ratio > self.epsilon_high) & (advantages > 0)
            else:
                low = (ratio < 1 - self.epsilon) & (advantages < 0)
                high = (ratio > 1 + self.epsilon_high) & (advantages > 0)
            columns = (torch.ones_like(kl), kl, low, high, low | high)
            metrics = torch.stack([(column.double() * mask).sum() for column in columns])
        return loss.reshape(1), metrics

    def logged(self, metric_sums: list[float], weights: list[float]) -> dict[str, float]:
        sums = dict(zip(_SUMS, metric_sums, strict=True))
        tokens = max(sums.pop("tokens"), 1.0)
        out = {name: total / tokens for name, total in sums.items()}
        if not self.beta:
            del out["kl"]
        if self.loss_type == "cispo":
            out = {"cispo_clip_ratio": out["clip_ratio/high_mean"], **({"kl": out["kl"]} if self.beta else {})}
        return out


def _mask(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Which label positions are completion tokens."""
    return batch["labels"][:, 1:] != IGNORE_INDEX
