"""A toy objective registered from this one file (`--objective tests/plugins/toy_objective.py:TOY`): each supervised
row's mean token cross-entropy, averaged over the step's rows, so that a short row counts as much as a long one.
It logs `tokens_per_row`. Nothing else in the project names it."""

from __future__ import annotations

import torch
from torch import nn

from qlora_fsdp.data import target_mask
from qlora_fsdp.objectives.base import Forward, Objective
from qlora_fsdp.objectives.loss import PER_ROW
from qlora_fsdp.objectives.setup import ObjectiveRun, Setting
from qlora_fsdp.objectives.specs import ObjectiveSpec


class RowMeanObjective(Objective):
    metric_names = ("tokens_per_row",)

    def __init__(self, forward: Forward) -> None:
        self.forward = forward

    def weights(self, batch: dict[str, torch.Tensor]) -> tuple[int, ...]:
        return (int(target_mask(batch["labels"]).any(dim=1).sum()),)

    def loss_sum(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        per_row = self.forward(model, batch, PER_ROW)  # each row's summed token cross-entropy
        tokens = target_mask(batch["labels"]).sum(dim=1).to(per_row.device)
        loss = (per_row / tokens.clamp(min=1)).sum()
        return loss.reshape(1), tokens.sum().double().reshape(1)


class RowMeanRun(ObjectiveRun):
    @classmethod
    def build(cls, setting: Setting, forward: Forward, **_: object) -> Objective:
        return RowMeanObjective(forward)


TOY = ObjectiveSpec("row_mean", RowMeanRun, rows="sft", unit="rows")
