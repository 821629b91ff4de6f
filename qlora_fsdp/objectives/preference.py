"""Preference objectives on chosen/rejected pairs: DPO, IPO (against a reference), ORPO and SimPO (without one).

A batch of B pairs is 2B sequences, the chosen sides first (data.rows.collate), and one forward of the policy
gives every sequence's log-probability summed over its reply tokens. DPO and IPO compare it with the reference's:
the same network with its adapters off, run under no_grad inside the same FSDP units (no second model), or looked
up in log-probs computed once before training (--precompute_reference). The losses are the papers', as TRL
computes them: DPO (its sigmoid loss; with --label_smoothing the conservative form), IPO (its squared loss on
log-ratios averaged over each reply's tokens), ORPO (the chosen reply's cross-entropy minus lambda times the log
odds ratio of the average log-probs) and SimPO (the sigmoid loss on average log-probs, less the margin gamma).

Each loss is a sum over pairs divided by the step's pairs over every rank (ORPO's cross-entropy: by its chosen
tokens), so N ranks x batch B equal 1 rank x batch N*B. A pair without labels (the padding of an evaluation
shard) counts for nothing.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from qlora_fsdp.data import IGNORE_INDEX, target_mask
from qlora_fsdp.objectives.base import Forward, Objective
from qlora_fsdp.objectives.loss import PER_ROW, PER_TOKEN
from qlora_fsdp.objectives.reference import ReferenceLookup, reference_logps
from qlora_fsdp.objectives.setup import ObjectiveRun, ReferenceRun, Setting
from qlora_fsdp.parallel.sequence_parallel import ROW_LABEL_TOKENS

PairLosses = tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, list[torch.Tensor]]


class Policy(NamedTuple):
    """One forward of the policy over a batch's sequences (chosen sides first)."""

    logps: torch.Tensor
    """Each sequence's reply log-probability, summed or averaged over the reply's tokens."""
    tokens: torch.Tensor
    """Each sequence's reply tokens."""
    sequence_nll: torch.Tensor | None = None
    """Each sequence's cross-entropy summed over its prompt and reply tokens, where the objective learns the prompt
    too (ORPO's TRL form)."""


class PreferenceObjective(Objective):
    """What the four share: the policy's reply log-probs, the masking of empty pairs and TRL's metrics."""

    metric_names: tuple[str, ...] = (
        "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected",
    )  # fmt: skip
    average = False
    """Log-probs are averaged over each reply's tokens (ORPO, SimPO) rather than summed."""

    def __init__(self, forward: Forward, *, beta: float) -> None:
        self.forward, self.beta = forward, beta

    def weights(self, batch: dict[str, torch.Tensor]) -> tuple[int, ...]:
        return (int(_pairs_present(batch).sum()),)

    def loss_sum(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = reply_tokens(batch).to(self.forward.device)
        policy = self.policy(model, batch, tokens)
        logps = policy.logps
        present = _pairs_present(batch).to(self.forward.device)
        parts, chosen_rewards, rejected_rewards, extra = self.pair_losses(model, batch, policy)
        parts = [torch.where(present, part, 0.0).sum() if part.dim() else part for part in parts]
        chosen, rejected = logps.detach().chunk(2)
        with torch.no_grad():
            columns = [chosen_rewards, rejected_rewards, (chosen_rewards > rejected_rewards).float(),
                       chosen_rewards - rejected_rewards, chosen, rejected, *extra]  # fmt: skip
            metrics = torch.stack([torch.where(present, c.double(), 0.0).sum() for c in columns])
        return torch.stack(parts), metrics

    def policy(self, model: nn.Module, batch: dict[str, torch.Tensor], tokens: torch.Tensor) -> Policy:
        """Every sequence's log-probability of its reply, summed (or averaged) over the reply's tokens."""
        logps = -self.forward(model, batch, PER_ROW)
        return Policy(logps / tokens.clamp(min=1) if self.average else logps, tokens)

    @abstractmethod
    def pair_losses(self, model: nn.Module, batch: dict[str, torch.Tensor], policy: Policy) -> PairLosses:
        """([each part: a per-pair loss, or an already summed one], chosen rewards, rejected rewards, extra metric
        columns), from the policy's view of the sequences (chosen sides first)."""


class _ReferenceObjective(PreferenceObjective):
    """DPO and IPO: log-ratios against the reference model."""

    def __init__(self, forward: Forward, *, beta: float, reference: ReferenceLookup | None = None) -> None:
        super().__init__(forward, beta=beta)
        self.reference = reference

    def reference_logps(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The reference's summed reply log-probs of every sequence (chosen sides first)."""
        return reference_logps(model, batch, forward=self.forward, table=self.reference)

    def pair_losses(self, model: nn.Module, batch: dict[str, torch.Tensor], policy: Policy) -> PairLosses:
        ratios = policy.logps - self.reference_logps(model, batch)
        chosen, rejected = ratios.chunk(2)
        rewards = self.beta * chosen.detach(), self.beta * rejected.detach()
        return [self.loss(chosen, rejected, policy.tokens)], *rewards, []

    @abstractmethod
    def loss(self, chosen: torch.Tensor, rejected: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Per-pair loss from the chosen and rejected log-ratios."""


class DpoObjective(_ReferenceObjective):
    """-log sigmoid(beta x (chosen log-ratio - rejected log-ratio)); conservative DPO with label smoothing e:
    (1 - e) x that + e x the same for the flipped pair."""

    def __init__(self, forward: Forward, *, beta: float, label_smoothing: float = 0.0,
                 reference: ReferenceLookup | None = None) -> None:  # fmt: skip
        super().__init__(forward, beta=beta, reference=reference)
        self.label_smoothing = label_smoothing

    def loss(self, chosen: torch.Tensor, rejected: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return smoothed_sigmoid_loss(self.beta * (chosen - rejected), self.label_smoothing)


class IpoObjective(_ReferenceObjective):
    """(chosen log-ratio / its tokens - rejected log-ratio / its tokens - 1 / (2 beta))^2, beta being IPO's tau."""

    def loss(self, chosen: torch.Tensor, rejected: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        chosen_tokens, rejected_tokens = tokens.clamp(min=1).chunk(2)
        return (chosen / chosen_tokens - rejected / rejected_tokens - 1 / (2 * self.beta)) ** 2


class SimpoObjective(PreferenceObjective):
    """-log sigmoid(beta x (average chosen log-prob - average rejected log-prob) - gamma), smoothed as DPO."""

    average = True

    def __init__(self, forward: Forward, *, beta: float, gamma: float, label_smoothing: float = 0.0) -> None:
        super().__init__(forward, beta=beta)
        self.gamma, self.label_smoothing = gamma, label_smoothing

    def pair_losses(self, model: nn.Module, batch: dict[str, torch.Tensor], policy: Policy) -> PairLosses:
        chosen, rejected = policy.logps.chunk(2)
        loss = smoothed_sigmoid_loss(self.beta * (chosen - rejected) - self.gamma, self.label_smoothing)
        return [loss], self.beta * chosen.detach(), self.beta * rejected.detach(), []


class OrpoObjective(PreferenceObjective):
    """The chosen side's cross-entropy (per token) - lambda x log sigmoid(log odds(chosen) - log odds(rejected)),
    the odds of an average reply log-prob p being exp(p) / (1 - exp(p)). The cross-entropy is the chosen reply's
    (the paper's) or, with `sequence_nll`, the chosen prompt's and reply's (TRL's). Logs TRL's log_odds_ratio and
    log_odds_chosen."""

    average = True
    metric_names = (*PreferenceObjective.metric_names, "log_odds_ratio", "log_odds_chosen")

    def __init__(self, forward: Forward, *, lam: float, sequence_nll: bool = False) -> None:
        super().__init__(forward, beta=lam)
        self.sequence_nll = sequence_nll

    def weights(self, batch: dict[str, torch.Tensor]) -> tuple[int, ...]:
        chosen_tokens = int(_nll_tokens(batch, sequence=self.sequence_nll).chunk(2)[0].sum())
        return (*super().weights(batch), chosen_tokens)

    def policy(self, model: nn.Module, batch: dict[str, torch.Tensor], tokens: torch.Tensor) -> Policy:
        """One forward over every real token: the replies' average log-probs and each sequence's whole
        cross-entropy (the prompt's first token predicts nothing, as in TRL's shifted labels)."""
        if not self.sequence_nll:
            return super().policy(model, batch, tokens)
        every_token = torch.where(batch["attention_mask"].bool(), batch["input_ids"], IGNORE_INDEX)
        per_token = self.forward(model, batch | {"labels": every_token}, PER_TOKEN)
        reply = target_mask(batch["labels"]).to(per_token.device)
        logps = -(per_token * reply).sum(1) / tokens.clamp(min=1)
        return Policy(logps, tokens, per_token.sum(1))

    def pair_losses(self, model: nn.Module, batch: dict[str, torch.Tensor], policy: Policy) -> PairLosses:
        chosen, rejected = policy.logps.chunk(2)
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        ratio = F.logsigmoid(log_odds)
        whole = policy.sequence_nll
        nll = -chosen * policy.tokens.chunk(2)[0] if whole is None else whole.chunk(2)[0]  # each chosen side's NLL
        rewards = self.beta * chosen.detach(), self.beta * rejected.detach()
        return [-self.beta * ratio, nll], *rewards, [ratio.detach(), log_odds.detach()]


def smoothed_sigmoid_loss(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    return -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate near 0 and far below it. Each branch sees only the inputs it is exact
    for (the other branch's backward would make 0/0 of them), and x stops short of 0, where the odds are infinite
    (a reply certain to the last digit)."""
    x = x.clamp(max=-1e-7)
    near = x > -math.log(2)
    return torch.where(near, torch.log(-torch.expm1(torch.where(near, x, -1.0))),
                       torch.log1p(-torch.exp(torch.where(near, -1.0, x))))  # fmt: skip


def reply_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each sequence's label tokens (chosen sides first): the whole sequence's where a batch holds slices of its
    rows (sequence parallelism)."""
    if ROW_LABEL_TOKENS in batch:
        return batch[ROW_LABEL_TOKENS]
    return target_mask(batch["labels"]).sum(1)


def _nll_tokens(batch: dict[str, torch.Tensor], *, sequence: bool) -> torch.Tensor:
    """The tokens each sequence's cross-entropy counts: its reply's, or (`sequence`) every real token after the first,
    for the pairs present."""
    if not sequence:
        return reply_tokens(batch)
    present = reply_tokens(batch) > 0
    return torch.where(present, (batch["attention_mask"].sum(1) - 1).clamp(min=0), 0)


def _pairs_present(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Which pairs have labels: an evaluation shard's padding pair has none."""
    return reply_tokens(batch).chunk(2)[0] > 0


class DpoRun(ReferenceRun):
    @classmethod
    def build(cls, setting: Setting, forward: Forward, *, reference: ReferenceLookup | None = None,
              **_: object) -> Objective:  # fmt: skip
        return DpoObjective(forward, beta=setting("beta"), label_smoothing=setting("label_smoothing"),
                            reference=reference)  # fmt: skip


class IpoRun(ReferenceRun):
    @classmethod
    def build(cls, setting: Setting, forward: Forward, *, reference: ReferenceLookup | None = None,
              **_: object) -> Objective:  # fmt: skip
        return IpoObjective(forward, beta=setting("beta"), reference=reference)


class OrpoRun(ObjectiveRun):
    @classmethod
    def build(cls, setting: Setting, forward: Forward, **_: object) -> Objective:
        return OrpoObjective(forward, lam=setting("orpo_lambda"), sequence_nll=setting("orpo_nll") == "sequence")


class SimpoRun(ObjectiveRun):
    @classmethod
    def build(cls, setting: Setting, forward: Forward, **_: object) -> Objective:
        return SimpoObjective(forward, beta=setting("beta"), gamma=setting("simpo_gamma"),
                              label_smoothing=setting("label_smoothing"))  # fmt: skip
