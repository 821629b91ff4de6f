"""Training objectives: what a batch's loss is, what it is divided by, and what the step logs besides the loss.

The training loop and evaluation call an Objective and nothing else about it (`base.py`); supervised fine-tuning's
token-level cross-entropy is one of them (`sft.py`); the preference objectives on pairs (`preference.py`), KTO on
unpaired completions (`kto.py`) and GRPO on the completions it samples (`grpo.py`) are the others.
"""

from __future__ import annotations

from qlora_fsdp.config.objectives import ObjectiveConfig
from qlora_fsdp.objectives.base import Forward, Objective, combined_loss
from qlora_fsdp.objectives.grpo import GrpoObjective, Rollout
from qlora_fsdp.objectives.kto import KtoObjective
from qlora_fsdp.objectives.preference import (
    DpoObjective,
    IpoObjective,
    OrpoObjective,
    PreferenceObjective,
    SimpoObjective,
)
from qlora_fsdp.objectives.reference import ReferenceLookup
from qlora_fsdp.objectives.sft import SftObjective

__all__ = ["Forward", "Objective", "PreferenceObjective", "SftObjective", "combined_loss", "make_objective"]


def make_objective(cfg: ObjectiveConfig, forward: Forward, *, reference: ReferenceLookup | None = None,
                   rollout: Rollout | None = None) -> Objective:  # fmt: skip
    """The objective --objective names, with its settings; `reference`: precomputed reference log-probs; `rollout`:
    GRPO's sampling and scoring."""
    name = cfg.objective
    if name == "sft":
        return SftObjective(forward)
    if name == "dpo":
        return DpoObjective(forward, beta=cfg.setting("beta"), label_smoothing=cfg.setting("label_smoothing"),
                            reference=reference)  # fmt: skip
    if name == "ipo":
        return IpoObjective(forward, beta=cfg.setting("beta"), reference=reference)
    if name == "orpo":
        return OrpoObjective(forward, lam=cfg.setting("orpo_lambda"))
    if name == "simpo":
        return SimpoObjective(forward, beta=cfg.setting("beta"), gamma=cfg.setting("simpo_gamma"),
                              label_smoothing=cfg.setting("label_smoothing"))  # fmt: skip
    if name == "kto":
        return KtoObjective(forward, beta=cfg.setting("beta"), desirable_weight=cfg.setting("desirable_weight"),
                            undesirable_weight=cfg.setting("undesirable_weight"), reference=reference)  # fmt: skip
    if name == "grpo":
        epsilon = cfg.setting("epsilon")
        high = cfg.setting("epsilon_high")
        return GrpoObjective(forward, loss_type=cfg.setting("loss_type"), beta=cfg.setting("beta"), epsilon=epsilon,
                             epsilon_high=epsilon if high is None else high,
                             max_completion_length=cfg.setting("max_completion_length"),
                             temperature=cfg.setting("temperature"), rollout=rollout)  # fmt: skip
    raise ValueError(f"unknown objective {name!r}")
