"""The --objective flags: which objective, each one's own settings with TRL's defaults, and their ranges.

A section of the run's config (qlora_fsdp.config.options holds the others and checks how sections combine); the
objectives themselves are in qlora_fsdp/objectives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Kept in step with make_objective (qlora_fsdp/objectives) by a unit test.
OBJECTIVES = ("sft", "dpo", "ipo", "orpo", "simpo", "kto", "grpo")
REFERENCE_OBJECTIVES = ("dpo", "ipo", "kto")
"""Objectives whose loss compares the policy with a reference model (the base, adapters off)."""
# Each objective's own settings and the default of each (TRL's): a flag given to an objective it does not apply
# to is refused.
OBJECTIVE_SETTINGS: dict[str, dict[str, object]] = {
    "sft": {},
    "dpo": {"beta": 0.1, "label_smoothing": 0.0},
    "ipo": {"beta": 0.1},
    "orpo": {"orpo_lambda": 0.1},
    "simpo": {"beta": 0.1, "simpo_gamma": 0.5, "label_smoothing": 0.0},
    "kto": {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0},
    "grpo": {"reward_funcs": "", "reward_weights": "", "num_generations": 8, "max_completion_length": 512,
             "temperature": 1.0, "top_p": 1.0, "beta": 0.0, "epsilon": 0.2, "epsilon_high": None, "loss_type": "dapo",
             "scale_rewards": "group", "num_iterations": 1, "generation_mode": "sharded"},
}
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
SCALE_REWARDS = ("group", "batch", "none")
GENERATION_MODES = ("sharded", "gathered")
SETTING_FLAGS = tuple(sorted({flag for settings in OBJECTIVE_SETTINGS.values() for flag in settings}))
ROW_KINDS = {"sft": "sft", "kto": "unpaired", "grpo": "prompts"}
"""What rows an objective reads: supervised examples, unpaired completions with a label (KTO) or, for the others,
preference pairs; GRPO reads prompts and samples its completions."""


@dataclass
class ObjectiveConfig:
    objective: str = "sft"
    """What training minimises: sft (cross-entropy on the responses); on preference pairs dpo, ipo (against the
    base model, adapters off, as reference), orpo or simpo (reference-free); on completions labelled desirable or
    not, kto (against the reference); on completions it samples and scores with --reward_funcs, grpo."""
    beta: float | None = None
    """dpo, ipo, simpo, kto: the paper's beta (IPO's tau), how far the policy may move from the reference (default
    0.1); grpo: the weight of the KL divergence to the reference (default 0: no reference forward)."""
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
    reward_funcs: str | None = None
    """grpo (required): the reward functions, `module.path:function` (or `path/to/file.py:function`), comma-separated;
    each is called as TRL calls one: fn(prompts, completions, completion_ids, **the rows' other columns) ->
    one float (or None: not scored) per completion."""
    reward_weights: str | None = None
    """grpo: a weight per reward function, comma-separated (default: 1 each)."""
    num_generations: int | None = None
    """grpo: completions sampled per prompt, the group its advantages compare (default 8); --batch_size must be a
    multiple of it (each rank samples whole groups)."""
    max_completion_length: int | None = None
    """grpo: the most tokens a completion may have (default 512)."""
    temperature: float | None = None
    """grpo: the sampling temperature (default 1)."""
    top_p: float | None = None
    """grpo: sample from the smallest set of tokens whose probability reaches this (default 1: all)."""
    epsilon: float | None = None
    """grpo: the clipping range of the probability ratio below 1 (default 0.2)."""
    epsilon_high: float | None = None
    """grpo: the clipping range above 1 (default: --epsilon; cispo: the ratio's cap)."""
    loss_type: str | None = None
    """grpo: how per-token losses add up, as TRL's: grpo, bnpo, dr_grpo, dapo or cispo (default dapo)."""
    scale_rewards: str | None = None
    """grpo: divide advantages by the standard deviation of the rewards of the group, of the batch, or none (default
    group)."""
    num_iterations: int | None = None
    """grpo: optimizer steps each generation of completions serves (default 1): the steps after its first reuse its
    completions, clipped against the log-probs the policy gave them when sampled, and the loader repeats their
    prompts, so an epoch takes this many times the steps."""
    generation_mode: str | None = None
    """grpo: how completions are sampled: sharded (default), every decoded token gathers each layer's shards, ranks
    in lockstep, no more memory than training; gathered (--fsdp_version 2), every rank holds the whole packed model
    while it samples (a rank's shards x the ranks), gathered once per micro-batch, each rank decoding on its own."""
    precompute_reference: bool = False
    """dpo, ipo, kto: compute the reference log-probs of every training row once, before training, and keep them in
    --output_dir (a resume reuses them), instead of a reference forward in every step."""

    def setting(self, name: str) -> Any:
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


def with_defaults(settings: dict[str, Any]) -> dict[str, Any]:
    """Recorded flags with the chosen objective's defaults in place of its settings not given (None): a setting left
    at its default equals the same value given (what a resume compares)."""
    own = OBJECTIVE_SETTINGS.get(settings.get("objective") or "sft", {})
    return {flag: own[flag] if value is None and flag in own else value for flag, value in settings.items()}


def objective_ranges(cfg: ObjectiveConfig) -> list[str]:
    """The settings outside their ranges, each with its flag."""
    grpo = cfg.objective == "grpo"

    def bad(name: str, ok: Callable[[Any], bool]) -> bool:
        return getattr(cfg, name) is not None and not ok(getattr(cfg, name))

    checks = [
        (bad("beta", lambda v: v >= 0 if grpo else v > 0), f"--beta must be {'>= 0' if grpo else '> 0'}"),
        (bad("num_generations", lambda v: v >= 2), "--num_generations must be >= 2 (advantages compare a group)"),
        (bad("max_completion_length", lambda v: v >= 1), "--max_completion_length must be >= 1"),
        (bad("temperature", lambda v: v > 0), "--temperature must be > 0"),
        (bad("top_p", lambda v: 0 < v <= 1), "--top_p must be in (0, 1]"),
        (bad("epsilon", lambda v: v >= 0), "--epsilon must be >= 0"),
        (bad("epsilon_high", lambda v: v >= 0), "--epsilon_high must be >= 0"),
        (bad("loss_type", lambda v: v in GRPO_LOSS_TYPES), f"--loss_type must be one of {', '.join(GRPO_LOSS_TYPES)}"),
        (bad("scale_rewards", lambda v: v in SCALE_REWARDS),
         f"--scale_rewards must be one of {', '.join(SCALE_REWARDS)}"),
        (bad("num_iterations", lambda v: v >= 1), "--num_iterations must be >= 1"),
        (bad("generation_mode", lambda v: v in GENERATION_MODES),
         f"--generation_mode must be one of {', '.join(GENERATION_MODES)}"),
        (grpo and not cfg.reward_funcs, "--objective grpo needs --reward_funcs module.path:function[,...]"),
        (not 0 <= (cfg.label_smoothing or 0) < 0.5, "--label_smoothing must be in [0, 0.5)"),
        (cfg.simpo_gamma is not None and not cfg.simpo_gamma >= 0, "--simpo_gamma must be >= 0"),
        (cfg.orpo_lambda is not None and not cfg.orpo_lambda >= 0, "--orpo_lambda must be >= 0"),
        (cfg.desirable_weight is not None and not cfg.desirable_weight > 0, "--desirable_weight must be > 0"),
        (cfg.undesirable_weight is not None and not cfg.undesirable_weight > 0, "--undesirable_weight must be > 0"),
    ]
    return [message for bad, message in checks if bad]
