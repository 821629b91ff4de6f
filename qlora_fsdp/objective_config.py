"""The --objective flags: which objective, each one's own settings with TRL's defaults, and their ranges.

A section of the run's config (qlora_fsdp.config holds the others and checks how sections combine); the objectives
themselves are in qlora_fsdp/objectives.
"""

from __future__ import annotations

from dataclasses import dataclass

OBJECTIVES = ("sft", "dpo", "ipo", "orpo", "simpo", "kto")  # kept in step with qlora_fsdp/objectives by a unit test
REFERENCE_OBJECTIVES = ("dpo", "ipo", "kto")
"""Objectives whose loss compares the policy with a reference model (the base, adapters off)."""
# Each objective's own settings and the default of each (TRL's): a flag given to an objective it does not apply
# to is refused.
OBJECTIVE_SETTINGS: dict[str, dict[str, float]] = {
    "sft": {},
    "dpo": {"beta": 0.1, "label_smoothing": 0.0},
    "ipo": {"beta": 0.1},
    "orpo": {"orpo_lambda": 0.1},
    "simpo": {"beta": 0.1, "simpo_gamma": 0.5, "label_smoothing": 0.0},
    "kto": {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0},
}
SETTING_FLAGS = tuple(sorted({flag for settings in OBJECTIVE_SETTINGS.values() for flag in settings}))
ROW_KINDS = {"sft": "sft", "kto": "unpaired"}
"""What rows an objective reads: supervised examples, unpaired completions with a label (KTO) or, for the others,
preference pairs."""


@dataclass
class ObjectiveConfig:
    objective: str = "sft"
    """What training minimises: sft (cross-entropy on the responses); on preference pairs dpo, ipo (against the
    base model, adapters off, as reference), orpo or simpo (reference-free); on completions labelled desirable or
    not, kto (against the reference)."""
    beta: float | None = None
    """dpo, ipo, simpo, kto: the paper's beta (IPO's tau), how far the policy may move from the reference (default
    0.1)."""
    label_smoothing: float | None = None
    """dpo, simpo: the probability that a pair's preference is flipped, for conservative DPO (default 0)."""
    simpo_gamma: float | None = None
    """simpo: the target reward margin gamma (default 0.5)."""
    orpo_lambda: float | None = None
    """orpo: lambda, the weight of the odds-ratio term against the chosen reply's cross-entropy (default 0.1)."""
    desirable_weight: float | None = None
    """kto: the weight of a desirable completion's loss (default 1; raise it when desirable rows are scarce)."""
    undesirable_weight: float | None = None
    """kto: the weight of an undesirable completion's loss (default 1)."""
    precompute_reference: bool = False
    """dpo, ipo, kto: compute the reference log-probs of every training row once, before training, and keep them in
    --output_dir (a resume reuses them), instead of a reference forward in every step."""

    def setting(self, name: str) -> float:
        """A setting of the chosen objective: the flag's value, or its default."""
        value = getattr(self, name)
        return OBJECTIVE_SETTINGS[self.objective][name] if value is None else value

    @property
    def pairs(self) -> bool:
        """Whether the objective's rows are two sequences each (a pair; KTO: a completion and its KL sequence)."""
        return self.objective != "sft"

    @property
    def rows(self) -> str:
        """The kind of rows it reads: "sft", "preference" or "unpaired"."""
        return ROW_KINDS.get(self.objective, "preference")


def objective_ranges(cfg: ObjectiveConfig) -> list[str]:
    """The settings outside their ranges, each with its flag."""
    checks = [
        (cfg.beta is not None and not cfg.beta > 0, "--beta must be > 0"),
        (not 0 <= (cfg.label_smoothing or 0) < 0.5, "--label_smoothing must be in [0, 0.5)"),
        (cfg.simpo_gamma is not None and not cfg.simpo_gamma >= 0, "--simpo_gamma must be >= 0"),
        (cfg.orpo_lambda is not None and not cfg.orpo_lambda >= 0, "--orpo_lambda must be >= 0"),
        (cfg.desirable_weight is not None and not cfg.desirable_weight > 0, "--desirable_weight must be > 0"),
        (cfg.undesirable_weight is not None and not cfg.undesirable_weight > 0, "--undesirable_weight must be > 0"),
    ]
    return [message for bad, message in checks if bad]
