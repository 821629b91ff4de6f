"""KTO (Kahneman-Tversky optimisation) on unpaired completions, each labelled desirable or not, as TRL's
KTOTrainer computes it.

A row is a prompt x with a completion y and its label; its reward is r = beta x (log pi(y|x) - log ref(y|x)), the
reference being the model with its adapters off (or a precomputed table), as for DPO. The loss of a desirable row
is w_d x (1 - sigmoid(r - z)), of an undesirable one w_u x (1 - sigmoid(z - r)), where z, the reference point, is
beta x the KL divergence of the policy from the reference, estimated on mismatched pairs: each row's prompt with
another row's completion (its KL sequence, data.rows.UnpairedRows), z = beta x max(0, mean over the micro-batch's
rows on every rank of log pi - log ref), with no gradient.

A batch of B rows is 2B sequences, the completions first and their KL sequences after (the layout of a pair), so
one forward of the policy and one of the reference give both. The loss is a sum over rows divided by the step's
rows over every rank, and z is a mean over the micro-batch's rows over every rank, so N ranks x batch B equal 1 rank
x batch N*B.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from qlora_fsdp.data.rows import DESIRABLE
from qlora_fsdp.objectives.base import Forward, Objective
from qlora_fsdp.objectives.loss import PER_ROW
from qlora_fsdp.objectives.preference import reply_tokens
from qlora_fsdp.objectives.reference import ReferenceLookup, reference_logps
from qlora_fsdp.objectives.setup import ReferenceRun, Setting

_SUMS = ("rewards/chosen", "logps/chosen", "rows/chosen", "rewards/rejected", "logps/rejected", "rows/rejected", "kl")


class KtoObjective(Objective):
    """TRL's metrics: rewards and log-probs of the desirable (chosen) and undesirable (rejected) rows, averaged over
    each, their margin, and the KL estimate max(0, mean log-ratio), before beta, as TRL logs it."""

    metric_names = _SUMS

    def __init__(self, forward: Forward, *, beta: float, desirable_weight: float = 1.0,
                 undesirable_weight: float = 1.0, reference: ReferenceLookup | None = None) -> None:  # fmt: skip
        self.forward, self.beta, self.reference = forward, beta, reference
        self.desirable_weight, self.undesirable_weight = desirable_weight, undesirable_weight

    def weights(self, batch: dict[str, torch.Tensor]) -> tuple[int, ...]:
        return (int(_rows_present(batch).sum()),)

    def loss_sum(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.forward.device
        logps = -self.forward(model, batch, PER_ROW)
        ratios = logps - reference_logps(model, batch, forward=self.forward, table=self.reference)
        ratio, kl_ratio = ratios.chunk(2)
        present = _rows_present(batch).to(device)
        kl = self.kl(kl_ratio.detach(), present)
        desirable = batch[DESIRABLE].to(device).bool()
        losses = torch.where(desirable, self.desirable_weight * (1 - torch.sigmoid(self.beta * (ratio - kl))),
                             self.undesirable_weight * (1 - torch.sigmoid(self.beta * (kl - ratio))))  # fmt: skip
        loss = torch.where(present, losses, 0.0).sum()
        with torch.no_grad():
            rewards, logp = (self.beta * ratio).double(), logps.chunk(2)[0].double()
            chosen, rejected = present & desirable, present & ~desirable
            sums = [(rewards * side).sum() for side in (chosen, rejected)]
            logp_sums = [(logp * side).sum() for side in (chosen, rejected)]
            metrics = torch.stack([sums[0], logp_sums[0], chosen.sum().double(), sums[1], logp_sums[1],
                                   rejected.sum().double(), kl.double() * present.sum()])  # fmt: skip
        return loss.reshape(1), metrics

    def kl(self, kl_ratios: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
        """max(0, the mean log-ratio of the KL sequences of the rows present, over every rank's micro-batch)."""
        total = torch.stack([torch.where(present, kl_ratios.double(), 0.0).sum(), present.sum().double()])
        if dist.is_initialized():
            dist.all_reduce(total)
        return (total[0] / total[1].clamp(min=1)).clamp(min=0).to(kl_ratios.dtype)

    def logged(self, metric_sums: list[float], weights: list[float]) -> dict[str, float]:
        sums = dict(zip(_SUMS, metric_sums, strict=True))
        out = {"kl": sums["kl"] / max(weights[0], 1.0)}
        for side in ("chosen", "rejected"):
            if sums[f"rows/{side}"]:
                out[f"rewards/{side}"] = sums[f"rewards/{side}"] / sums[f"rows/{side}"]
                out[f"logps/{side}"] = sums[f"logps/{side}"] / sums[f"rows/{side}"]
        if "rewards/chosen" in out and "rewards/rejected" in out:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out


def _rows_present(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Which rows have a completion to learn: an evaluation shard's padding row has none."""
    return reply_tokens(batch).chunk(2)[0] > 0


class KtoRun(ReferenceRun):
    @classmethod
    def build(cls, setting: Setting, forward: Forward, *, reference: ReferenceLookup | None = None,
              **_: object) -> Objective:  # fmt: skip
        return KtoObjective(forward, beta=setting("beta"), desirable_weight=setting("desirable_weight"),
                            undesirable_weight=setting("undesirable_weight"), reference=reference)  # fmt: skip
