"""GRPO's reward functions: found by name before the model loads, called as TRL calls them, checked on every rank.

`--reward_funcs module.path:function` imports a module (the working directory first, as `python -m` would find it)
or, for `path/to/file.py:function`, a file. A function is called once per batch of completions as TRL 1.16 calls
one: fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., log_extra=..., log_metric=...,
**columns), `columns` being each prompt's other dataset fields, `trainer_state` an object with the `global_step`
being trained, `log_extra` and `log_metric` accepted and ignored (TRL's completions table and extra metrics are not
kept here); it returns one reward per completion, None for a completion it does not score. `async def` functions
and two functions of the same name are refused when they are loaded. A function that raises,
returns another number of rewards or something that is not a number stops every rank with one line naming it: a
rank that stopped alone would leave the others waiting in the next collective.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from qlora_fsdp.errors import UserError
from qlora_fsdp.objectives.user_code import load_object
from qlora_fsdp.parallel.distributed import DistEnv

RewardFunc = Callable[..., list[float | None]]


@dataclass(frozen=True)
class Reward:
    name: str
    """The function's name, as metrics name it (rewards/NAME/mean)."""
    func: RewardFunc
    weight: float


def load_rewards(spec: str, weights: str = "") -> list[Reward]:
    """The functions --reward_funcs names, with --reward_weights (default 1 each)."""
    entries = [entry.strip() for entry in spec.split(",") if entry.strip()]
    funcs = [_load(entry) for entry in entries]
    values = [1.0] * len(funcs)
    if weights.strip():
        try:
            values = [float(w) for w in weights.split(",")]
        except ValueError:
            raise UserError(f"--reward_weights {weights!r}: expected numbers separated by commas") from None
        if len(values) != len(funcs):
            raise UserError(f"--reward_weights gives {len(values)} weight(s) for {len(funcs)} reward function(s)")
    names = [func.__name__ for func in funcs]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise UserError(f"--reward_funcs names two functions {twice[0]!r}: their metrics (rewards/NAME/mean) would "
                        "mix; rename one")  # fmt: skip
    return [Reward(name, func, weight) for name, func, weight in zip(names, funcs, values, strict=True)]


def _load(entry: str) -> RewardFunc:
    func = load_object(entry, flag="--reward_funcs", kind="function")
    where, _, name = entry.rpartition(":")
    if not callable(func):
        raise UserError(f"--reward_funcs {entry}: {where}.{name} is a {type(func).__name__}, not a function")
    if inspect.iscoroutinefunction(func):
        raise UserError(f"--reward_funcs {entry}: an async function; rewards are computed synchronously here, so "
                        "make it a plain function")  # fmt: skip
    return func


@dataclass(frozen=True)
class TrainerState:
    """What a reward function gets as `trainer_state`: the step being trained (TRL's TrainerState.global_step)."""

    global_step: int


RESERVED = ("prompt", "prompts", "completion", "completions", "completion_ids")
"""Dataset fields not passed on as columns: the call's own arguments (TRL leaves them out too)."""


def score(rewards: list[Reward], *, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
          columns: dict[str, list[Any]], step: int, env: DistEnv) -> torch.Tensor:  # fmt: skip
    """[completions, functions] float64 rewards, NaN where a function returned None; every rank calls it once per
    batch, and all stop with the first problem any rank met."""
    out = torch.full((len(completions), len(rewards)), math.nan, dtype=torch.float64)
    columns = {key: values for key, values in columns.items() if key not in RESERVED}
    problem = ""
    for i, reward in enumerate(rewards):
        try:
            values = reward.func(prompts=prompts, completions=completions, completion_ids=completion_ids,
                                 trainer_state=TrainerState(step), log_extra=_ignored, log_metric=_ignored,
                                 **columns)  # fmt: skip
        except Exception as exc:  # the user's code: any failure is reported, not a traceback from deep inside
            problem = f"reward function {reward.name} raised {type(exc).__name__}: {_one_line(str(exc))}"
            break
        try:
            numbers = [math.nan if v is None else float(v) for v in values]
        except Exception:  # whatever the values are: a float each, or the function is reported
            problem = f"reward function {reward.name} returned {_show(values)}: expected a float or None each"
            break
        if len(numbers) != len(completions):
            problem = (f"reward function {reward.name} returned {len(numbers)} rewards for {len(completions)} "
                       "completions: it must return one per completion")  # fmt: skip
            break
        out[:, i] = torch.tensor(numbers, dtype=torch.float64)
    problems = [problem]
    if env.world_size > 1:
        problems = [""] * env.world_size
        dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p), "")
    if first:
        raise UserError(first)
    return out


def _ignored(*args: Any, **kwargs: Any) -> None:
    """TRL's `log_extra` and `log_metric`, accepted and ignored."""


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _show(values: Any) -> str:
    text = _one_line(repr(values))
    return text if len(text) <= 80 else text[:77] + "..."
