"""The hooks through which the trainer builds a run's objective without knowing which one it is.

The trainer makes a Setup, starts the spec's run (`ObjectiveRun`), asks it for its loaders before the model loads,
then, once the model is sharded, for the objective that trains and the one that evaluates. A run's own state (GRPO's
generation) is the objective's `state_dict`, which checkpoints save per rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from qlora_fsdp.config.objectives import ObjectiveConfig
from qlora_fsdp.config.options import DataConfig, EvalConfig
from qlora_fsdp.data.loader import Batching, build_loaders
from qlora_fsdp.objectives.base import Forward, Objective
from qlora_fsdp.objectives.reference import REFERENCE_FILE, ReferenceLookup, reference_table
from qlora_fsdp.objectives.specs import ObjectiveSpec, objective_spec
from qlora_fsdp.parallel.distributed import DistEnv
from qlora_fsdp.parallel.sharding import ShardedModel

Setting = Callable[[str], Any]


@dataclass(frozen=True)
class Setup:
    """What a run's objective may build from: its flags, the data flags, and the job."""

    objective: ObjectiveConfig
    data: DataConfig
    eval: EvalConfig
    tokenizer: Any
    env: DistEnv
    batching: Batching
    """How rows become batches (the kind of rows is the objective's: its spec says)."""
    model_path: Path
    output_dir: Path


@dataclass(frozen=True)
class Trainee:
    """The sharded model an objective trains, and what it needs of the run around it."""

    model: ShardedModel
    forward: Forward
    loader: DataLoader
    resume_step: int | None
    """The step a resumed run continues after; None for a new run."""
    report: Callable[[str], None]
    """Writes a line to the run's log (rank 0)."""


class ObjectiveRun:
    """One run's objective. Subclasses give `build`; reading other rows, a reference table or a rollout are theirs."""

    def __init__(self, spec: ObjectiveSpec, setup: Setup) -> None:
        self.spec, self.setup = spec, setup

    @classmethod
    def build(cls, setting: Setting, forward: Forward, *, reference: ReferenceLookup | None = None,
              rollout: Any = None) -> Objective:  # fmt: skip
        """The objective with its settings (`setting(name)`: the flag, or the objective's default)."""
        raise NotImplementedError

    def loaders(self) -> tuple[DataLoader, DataLoader | None]:
        """This rank's training loader and evaluation loader (None without an evaluation set)."""
        s = self.setup
        return build_loaders(s.data, s.eval, s.tokenizer, s.env, replace(s.batching, kind=self.spec.rows))

    def objective(self, trainee: Trainee, *, training: bool) -> Objective:
        """The objective that trains (`training`) or that evaluates."""
        return self.build(self.setup.objective.setting, trainee.forward)


class ReferenceRun(ObjectiveRun):
    """An objective against the reference model, whose log-probs of the training rows may be computed once
    (--precompute_reference) instead of in every step; evaluation runs its reference forward itself."""

    def objective(self, trainee: Trainee, *, training: bool) -> Objective:
        reference = None
        if training and self.setup.objective.precompute_reference:
            reference = self._precomputed(trainee)
        return self.build(self.setup.objective.setting, trainee.forward, reference=reference)

    def _precomputed(self, trainee: Trainee) -> ReferenceLookup:
        path, loader, started = self.setup.output_dir / REFERENCE_FILE, trainee.loader, time.perf_counter()
        table, reused = reference_table(
            trainee.model.module, loader.dataset, forward=trainee.forward, env=self.setup.env, path=path,
            reuse=trainee.resume_step is not None, make_loader=lambda rows: DataLoader(
                # Its own generator: drawing the iterator's seed from the global one would shift dropout masks.
                rows, batch_size=self.setup.data.batch_size, collate_fn=loader.collate_fn,
                generator=torch.Generator(),
            ),
        )  # fmt: skip
        how = "read back from" if reused else f"computed in {time.perf_counter() - started:.1f}s and saved to"
        trainee.report(f"reference log-probs of {len(loader.dataset)} {self.spec.unit} {how} {path}")
        return table.__getitem__


def start(setup: Setup) -> ObjectiveRun:
    """The run of the objective --objective names."""
    spec = objective_spec(setup.objective.objective)
    return spec.run_class()(spec, setup)


def make_objective(cfg: ObjectiveConfig, forward: Forward, *, reference: ReferenceLookup | None = None,
                   rollout: Any = None) -> Objective:  # fmt: skip
    """The objective `cfg` names, with its settings, outside a run (tests and benchmarks compare it with TRL's)."""
    return objective_spec(cfg.objective).run_class().build(cfg.setting, forward, reference=reference,
                                                           rollout=rollout)  # fmt: skip
