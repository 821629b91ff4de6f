"""The interface between the training loop and an objective."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qlora_fsdp.data.rows import model_inputs
from qlora_fsdp.objectives.loss import SUMMED, LossRequest, Reduction
from qlora_fsdp.parallel.precision import Precision
from qlora_fsdp.parallel.sequence_parallel import SequenceParallel


@dataclass
class Forward:
    """How a batch reaches the FSDP root (CausalLMLoss): on `device`, under the precision's autocast, with packed
    rows laid end to end for flash attention (`varlen`). With sequence parallelism (`sequence`) a batch holds this
    rank's slices of its rows: their attention runs over the whole rows, and per-row sums add up over the group."""

    device: torch.device
    precision: Precision
    varlen: bool = False
    sequence: SequenceParallel | None = None

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor], request: LossRequest = SUMMED) -> torch.Tensor:
        inputs = model_inputs(batch, self.device, varlen=self.varlen)
        if inputs["attention_mask"] is None:  # packed: which positions are padding, for the router's loss alone
            inputs["token_mask"] = batch["attention_mask"].to(self.device).reshape(inputs["input_ids"].shape)
        if self.sequence is not None:
            self.sequence.begin(batch, self.device)
        with self.autocast():
            out = model(**inputs, request=request)
        if self.sequence is not None and request.reduction is Reduction.ROWS:
            out = self.sequence.row_sums(out)
        return out

    def autocast(self) -> contextlib.AbstractContextManager:
        """The precision's autocast, or nothing."""
        if self.precision.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.precision.autocast_dtype)


class Objective(ABC):
    """One training objective, as the loop and evaluation see it.

    A loss is a sum of parts, each summed over the step's micro-batches and ranks and divided by its own weight
    summed the same way (SFT: one part, over label tokens; DPO: one, over pairs; ORPO: its odds-ratio term over
    pairs and its cross-entropy over chosen tokens), so N ranks x batch B equal 1 rank x batch N*B exactly.
    `loss_sum` also returns sums of the objective's own metrics (`metric_names`, in order), which are divided by
    the first weight when the step is logged.
    """

    metric_names: tuple[str, ...] = ()
    reports_perplexity = False
    """Whether exp(eval_loss) means something (a per-token cross-entropy)."""

    def prepare(self, model: nn.Module, batch: dict[str, torch.Tensor], *, step: int,
                index: int = 0) -> dict[str, torch.Tensor]:  # fmt: skip
        """What the loader's batch, the step's `index`-th micro-batch, becomes before its forward (GRPO samples
        completions for its prompts); every rank calls it for each micro-batch, in step."""
        return batch

    def state_dict(self) -> dict[str, Any]:
        """This rank's state that a resumed run needs and the model and data position do not hold (for the
        checkpoint's per-rank file; tensors, numbers, strings, lists and dicts only)."""
        return {}

    def load_state_dict(self, state: dict[str, Any], *, step: int) -> None:
        """Take back `state_dict`'s ({} where the checkpoint had none for this rank) before resuming after `step`."""
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, yet the checkpoint holds {sorted(state)}")

    @abstractmethod
    def weights(self, batch: dict[str, torch.Tensor]) -> tuple[int, ...]:
        """What this batch counts toward each part's denominator (label tokens, pairs...)."""

    @abstractmethod
    def loss_sum(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the batch's summed loss parts, one per weight; a float64 vector of its summed metrics) from `model`."""

    def logged(self, metric_sums: list[float], weights: list[float]) -> dict[str, float]:
        """The step's own metrics, from the sums over its micro-batches and ranks."""
        return {name: total / max(weights[0], 1.0) for name, total in zip(self.metric_names, metric_sums, strict=True)}


def combined_loss(part_sums: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The loss from its parts' sums and their weights over the whole step (or evaluation set)."""
    return (part_sums / weights.clamp(min=1.0)).sum()
