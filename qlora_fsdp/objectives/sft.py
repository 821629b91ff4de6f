"""Supervised fine-tuning: next-token cross-entropy summed over label tokens, divided by the step's label tokens."""

from __future__ import annotations

import torch
from torch import nn

from qlora_fsdp.data import target_mask
from qlora_fsdp.objectives.base import Forward, Objective
from qlora_fsdp.objectives.setup import ObjectiveRun, Setting


class SftObjective(Objective):
    reports_perplexity = True

    def __init__(self, forward: Forward) -> None:
        self.forward = forward

    def weights(self, batch: dict[str, torch.Tensor]) -> tuple[int, ...]:
        return (int(target_mask(batch["labels"]).sum()),)

    def loss_sum(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        loss = self.forward(model, batch)
        return loss.reshape(1), torch.zeros(0, dtype=torch.float64, device=loss.device)


class SftRun(ObjectiveRun):
    @classmethod
    def build(cls, setting: Setting, forward: Forward, **_: object) -> Objective:
        return SftObjective(forward)
