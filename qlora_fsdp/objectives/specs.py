"""The objectives --objective can name: what rows each reads, its settings with their defaults (TRL's), what it
refuses, and where its run class is (imported only when a run starts, so validating flags imports no torch).

An objective is one place: its spec here (or in a file of its own, named as `--objective path/to/file.py:NAME` or
`module.path:NAME`), its run class and loss beside it. The trainer and the config reach an objective only through
its spec and its run's hooks (`objectives/setup.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from qlora_fsdp.errors import UserError
from qlora_fsdp.objectives.user_code import load_object


def _no_problems(cfg: Any) -> list[str]:
    return []


@dataclass(frozen=True)
class ObjectiveSpec:
    """An objective as the config and the trainer see it."""

    name: str
    run: str | Callable[..., Any]
    """Its ObjectiveRun subclass, or "module.path:Class" naming it (imported when a run starts)."""
    rows: str = "preference"
    """The rows it reads (data.formats): "sft" examples, "preference" pairs, "unpaired" labelled completions, or
    "prompts" it samples completions for."""
    settings: Mapping[str, object] = field(default_factory=dict)
    """Its own settings (ObjectiveConfig's fields) and the default of each; any other setting given is refused."""
    reference: bool = False
    """Whether its loss always compares with the reference (the model with its adapters off): needs adapters, and
    --precompute_reference applies."""
    uses_reference: Callable[[Callable[[str], Any]], bool] | None = None
    """Whether it compares with the reference under the given settings, where that depends on them."""
    unit: str = "pairs"
    """What its evaluation counts (metrics.jsonl's `eval_<unit>`) when its loss is not per token."""
    problems: Callable[[Any], list[str]] = _no_problems
    """Its own checks of a whole TrainConfig (what it needs, combinations it cannot train), a line each."""
    ranges: Mapping[str, tuple[Callable[[Any], bool], str]] = field(default_factory=dict)
    """Its settings' valid values where they differ from the shared ones (SETTING_RANGES): setting -> (ok, line)."""

    @property
    def pairs(self) -> bool:
        """Whether its rows are not plain supervised examples (two sequences each, or sampled completions)."""
        return self.rows != "sft"

    def needs_reference(self, setting: Callable[[str], Any]) -> bool:
        return self.reference or (self.uses_reference is not None and self.uses_reference(setting))

    def run_class(self) -> type:
        return load_object(self.run, flag="--objective") if isinstance(self.run, str) else self.run  # type: ignore[return-value]


GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
SCALE_REWARDS = ("group", "batch", "none")
GENERATION_MODES = ("sharded", "gathered")
ORPO_NLL = ("reply", "sequence")


def _grpo_problems(cfg: Any) -> list[str]:
    setting = cfg.objective.setting
    cannot = [
        (cfg.dist.sequence_parallel_size > 1, "--sequence_parallel_size above 1 (not yet): drop it"),
        (cfg.data.group_by_length, "--group_by_length (prompts are sampled from, not grouped): drop it"),
        (
            setting("generation_mode") == "gathered" and cfg.fsdp.fsdp_version == 1,
            "--generation_mode gathered with --fsdp_version 1 (FSDP1 cannot run a forward on gathered weights): use "
            "--fsdp_version 2 or --generation_mode sharded",
        ),
        (cfg.compute.compile, "--compile (sampling decodes one token at a time; not yet): drop it"),
        (
            setting("scale_rewards") == "batch" and cfg.optim.gradient_accumulation_steps > 1,
            "--scale_rewards batch with --gradient_accumulation_steps above 1 (each micro-batch is its own "
            "generation here, TRL's spans the step): use group or none, or one micro-batch a step",
        ),
        (
            cfg.data.context_length <= setting("max_completion_length"),
            f"--context_length {cfg.data.context_length}: a prompt and its completion share it, so it must exceed "
            "--max_completion_length",
        ),
        (
            bool(cfg.eval.eval_dataset or cfg.eval.eval_split),
            "--eval_dataset or --eval_split (evaluating by sampling is not built yet): drop it",
        ),
    ]
    needs = [] if cfg.objective.reward_funcs else ["--objective grpo needs --reward_funcs module.path:function[,...]"]
    return needs + [f"--objective grpo cannot take {why}" for bad, why in cannot if bad]  # fmt: skip


def _orpo_problems(cfg: Any) -> list[str]:
    if cfg.objective.setting("orpo_nll") == "sequence" and cfg.dist.sequence_parallel_size > 1:
        return [
            "--orpo_nll sequence cannot take --sequence_parallel_size above 1 (each rank would see part of a "
            "prompt): use --orpo_nll reply or one rank per sequence"
        ]
    return []


def _one_of(choices: tuple[str, ...], flag: str) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v in choices), f"--{flag} must be one of {', '.join(choices)}"


# fmt: off
_SPECS = (
    ObjectiveSpec("sft", "qlora_fsdp.objectives.sft:SftRun", rows="sft"),
    ObjectiveSpec("dpo", "qlora_fsdp.objectives.preference:DpoRun", settings={"beta": 0.1, "label_smoothing": 0.0},
                  reference=True),
    ObjectiveSpec("ipo", "qlora_fsdp.objectives.preference:IpoRun", settings={"beta": 0.1}, reference=True),
    ObjectiveSpec("orpo", "qlora_fsdp.objectives.preference:OrpoRun",
                  settings={"orpo_lambda": 0.1, "orpo_nll": "reply"},
                  ranges={"orpo_nll": _one_of(ORPO_NLL, "orpo_nll")}, problems=_orpo_problems),
    ObjectiveSpec("simpo", "qlora_fsdp.objectives.preference:SimpoRun",
                  settings={"beta": 0.1, "simpo_gamma": 0.5, "label_smoothing": 0.0}),
    ObjectiveSpec("kto", "qlora_fsdp.objectives.kto:KtoRun", rows="unpaired", unit="rows", reference=True,
                  settings={"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0}),
    ObjectiveSpec(
        "grpo", "qlora_fsdp.objectives.grpo:GrpoRun", rows="prompts",
        settings={"reward_funcs": "", "reward_weights": "", "num_generations": 8, "max_completion_length": 512,
                  "temperature": 1.0, "top_p": 1.0, "beta": 0.0, "epsilon": 0.2, "epsilon_high": None,
                  "loss_type": "dapo", "scale_rewards": "group", "num_iterations": 1, "generation_mode": "sharded"},
        uses_reference=lambda setting: bool(setting("beta")),
        problems=_grpo_problems,
        ranges={"beta": ((lambda v: v >= 0), "--beta must be >= 0"),
                "loss_type": _one_of(GRPO_LOSS_TYPES, "loss_type"),
                "scale_rewards": _one_of(SCALE_REWARDS, "scale_rewards"),
                "generation_mode": _one_of(GENERATION_MODES, "generation_mode")},
    ),
)
# fmt: on
OBJECTIVES: dict[str, ObjectiveSpec] = {spec.name: spec for spec in _SPECS}
"""The objectives built in, by name: what --objective accepts besides `module.path:NAME` or `file.py:NAME`."""


@functools.cache
def objective_spec(name: str) -> ObjectiveSpec:
    """The spec --objective names: a built-in one, or an ObjectiveSpec named as `module.path:NAME` / `file.py:NAME`."""
    if name in OBJECTIVES:
        return OBJECTIVES[name]
    if ":" not in name:
        raise UserError(f"--objective {name!r} is not one of {', '.join(OBJECTIVES)} (or module.path:NAME, "
                        "file.py:NAME of an ObjectiveSpec of your own)")  # fmt: skip
    spec = load_object(name, flag="--objective")
    if not isinstance(spec, ObjectiveSpec):
        raise UserError(f"--objective {name}: {type(spec).__name__} is not an ObjectiveSpec "
                        "(qlora_fsdp.objectives.specs)")  # fmt: skip
    return spec
