"""The --objective flags: which objective, each one's own settings with TRL's defaults, their ranges, and what the
chosen objective refuses of the rest of the config.

A section of the run's config (qlora_fsdp.config.options holds the others and checks how they combine); the
objectives themselves are in qlora_fsdp/objectives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from qlora_fsdp.errors import UserError
from qlora_fsdp.objectives.specs import OBJECTIVES, ObjectiveSpec, objective_spec

SETTING_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "beta": ((lambda v: v > 0), "--beta must be > 0"),
    "label_smoothing": ((lambda v: 0 <= v < 0.5), "--label_smoothing must be in [0, 0.5)"),
    "simpo_gamma": ((lambda v: v >= 0), "--simpo_gamma must be >= 0"),
    "orpo_lambda": ((lambda v: v >= 0), "--orpo_lambda must be >= 0"),
    "desirable_weight": ((lambda v: v > 0), "--desirable_weight must be > 0"),
    "undesirable_weight": ((lambda v: v > 0), "--undesirable_weight must be > 0"),
    "num_generations": ((lambda v: v >= 2), "--num_generations must be >= 2 (advantages compare a group)"),
    "max_completion_length": ((lambda v: v >= 1), "--max_completion_length must be >= 1"),
    "temperature": ((lambda v: v > 0), "--temperature must be > 0"),
    "top_p": ((lambda v: 0 < v <= 1), "--top_p must be in (0, 1]"),
    "epsilon": ((lambda v: v >= 0), "--epsilon must be >= 0"),
    "epsilon_high": ((lambda v: v >= 0), "--epsilon_high must be >= 0"),
    "num_iterations": ((lambda v: v >= 1), "--num_iterations must be >= 1"),
}
"""The valid values of the settings, where an objective's spec does not say otherwise (its `ranges`)."""


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
    orpo_nll: str | None = None
    """orpo: the tokens its cross-entropy averages over: reply (the chosen reply's, the paper's; default) or
    sequence (the chosen side's prompt and reply, as TRL's ORPOTrainer)."""
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
        return self.spec.settings[name] if value is None else value

    @property
    def spec(self) -> ObjectiveSpec:
        return objective_spec(self.objective)

    @property
    def pairs(self) -> bool:
        """Whether the objective's rows are not plain supervised examples (pairs, labelled completions, prompts)."""
        return self.spec.pairs

    @property
    def rows(self) -> str:
        """The kind of rows it reads (ObjectiveSpec.rows)."""
        return self.spec.rows


SETTING_FLAGS = tuple(f.name for f in fields(ObjectiveConfig) if f.name not in ("objective", "precompute_reference"))
"""The flags that are some objective's own settings."""


def with_defaults(settings: dict[str, Any]) -> dict[str, Any]:
    """Recorded flags with the chosen objective's defaults in place of its settings not given (None): a setting left
    at its default equals the same value given (what a resume compares)."""
    try:
        own = objective_spec(settings.get("objective") or ObjectiveConfig.objective).settings
    except UserError:  # an objective no longer found: its settings compare as recorded
        own = {}
    return {flag: own[flag] if value is None and flag in own else value for flag, value in settings.items()}


def objective_ranges(cfg: ObjectiveConfig) -> list[str]:
    """The settings given outside their ranges (the chosen objective's, else the shared ones), each with its flag."""
    ranges = {**SETTING_RANGES, **cfg.spec.ranges}
    return [message for name, (ok, message) in ranges.items()
            if getattr(cfg, name) is not None and not ok(getattr(cfg, name))]  # fmt: skip


def chosen_spec(cfg: ObjectiveConfig) -> ObjectiveSpec | None:
    """The spec --objective names; None where it names none (choice_problems reports it)."""
    try:
        return objective_spec(cfg.objective)
    except UserError:
        return None


def choice_problems(cfg: ObjectiveConfig) -> list[str]:
    """--objective naming no objective, as a line."""
    try:
        objective_spec(cfg.objective)
    except UserError as exc:
        return [str(exc)]
    return []


def objective_problems(cfg: Any) -> list[str]:
    """What the chosen objective refuses of the whole config (a TrainConfig, whose module imports this one): another
    objective's settings, what rows other than supervised examples cannot do, and the objective's own checks."""
    spec = chosen_spec(cfg.objective)
    if spec is None:
        return []
    name, own = spec.name, spec.settings
    problems = [
        f"--{flag} does not apply to --objective {name}" + (f" (its settings: {', '.join('--' + f for f in own)})"
                                                            if own else "")
        for flag in SETTING_FLAGS
        if getattr(cfg.objective, flag) is not None and flag not in own
    ]  # fmt: skip
    reference = spec.needs_reference(cfg.objective.setting)
    if cfg.objective.precompute_reference and not spec.reference:
        fixed = ", ".join(n for n, other in OBJECTIVES.items() if other.reference)
        problems.append(f"--precompute_reference applies to {fixed}, whose rows are fixed; {name} has none")
    if not spec.pairs:
        if cfg.data.max_prompt_length:
            problems.append(f"--max_prompt_length cuts preference pairs' prompts; --objective {name} has none")
        return problems + spec.problems(cfg)
    for bad, why in (
        (cfg.data.packing, "--packing (its rows are never packed): drop it"),
        (cfg.data.dataset_streaming, "--dataset_streaming (its rows are read whole before training): drop it"),
        (cfg.data.train_on_inputs, "--train_on_inputs (the losses compare replies only): drop it"),
        (
            bool(cfg.model.router_aux_loss_coef),
            "--router_aux_loss_coef (the load-balancing loss joins supervised losses only): drop it",
        ),
        (
            reference and cfg.lora.train_type not in ("lora", "dora"),
            f"--train_type {cfg.lora.train_type}: the reference is the model with its adapters off, so it needs "
            "--train_type lora or dora (orpo, simpo and grpo with --beta 0 need no reference)",
        ),
    ):
        if bad:
            problems.append(f"--objective {name} cannot take {why}")
    return problems + spec.problems(cfg)
