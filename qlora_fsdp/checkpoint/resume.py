"""Where a run starts: the checkpoint it resumes and whether it may (its settings and data layout against this
job's), a fresh run's removal of old checkpoints, and the check that every rank sees the same output directory."""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from qlora_fsdp.checkpoint.dcp import CHECKPOINT_PREFIX, TRAINER_STATE, TrainState, list_checkpoints, read_train_state
from qlora_fsdp.checkpoint.resume_rules import as_argument
from qlora_fsdp.config.objectives import with_defaults
from qlora_fsdp.errors import UserError
from qlora_fsdp.parallel.distributed import DistEnv, broadcast_object


def resolve_resume(resume_from: str, output_dir: Path) -> Path | None:
    """The checkpoint to resume from: None for a fresh run, else a complete checkpoint directory."""
    if not resume_from:
        return None
    if resume_from == "auto":
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume_from)
    if not (path / TRAINER_STATE).is_file():
        raise UserError(f"--resume_from {resume_from}: not a complete checkpoint (no {TRAINER_STATE}); use 'auto'")
    return path


def check_resume_compatible(
    path: Path,
    settings: dict[str, Any],
    *,
    world_size: int,
    may_change: tuple[str, ...] = (),
    resharded: tuple[str, ...] = (),
) -> list[str]:
    """Refuse, before any heavy work, a resume whose data order or tensors could not match the checkpoint's.

    `resharded`: settings that change only how the saved state is laid out over ranks and steps (batch size,
    sharding strategy), which checkpoints of format 2 may change like the world size. Returns the changes to report
    ("--lr 0.01 -> 0.005", a new world size or global batch), which the caller applies.
    """
    state = read_train_state(path)
    state.settings, settings = with_defaults(state.settings), with_defaults(settings)
    legacy = state.format < 2
    if legacy and state.world_size != world_size:
        raise UserError(
            f"--resume_from {path}: saved by {state.world_size} processes but this job has {world_size}; this "
            "checkpoint predates resharded checkpoints (its optimizer state is sharded per rank), so resume it with "
            f"--nproc_per_node/--nnodes giving {state.world_size}"
        )
    allowed = may_change if legacy else may_change + resharded
    # Settings a checkpoint of an older version did not record are unknown, taken as unchanged (the trainer names
    # the must-match ones it could not check: resume_rules.unrecorded).
    changed = {k: f"--{k} {state.settings[k]!r} -> {v!r}" for k, v in settings.items() if state.settings.get(k, v) != v}
    refused = [k for k in changed if k not in allowed]
    if refused:
        saved = " ".join(as_argument(k, state.settings[k]) for k in refused)
        raise UserError(
            f"--resume_from {path}: the checkpoint was made with other settings "
            f"({'; '.join(changed[k] for k in refused)}); to continue it, resume with {saved}, or start a new run in "
            "another --output_dir"
        )
    notes = [text for k, text in changed.items() if k in allowed]
    return notes if legacy else notes + _new_layout(path, state, settings, world_size)


def _new_layout(path: Path, state: TrainState, settings: dict[str, Any], world_size: int) -> list[str]:
    """What a resume on another world size or global batch changes, or the reason it cannot continue the data."""

    def shape(ranks: int, flags: dict[str, Any]) -> tuple[int, int, str]:
        batch, accumulation = flags.get("batch_size", 1), flags.get("gradient_accumulation_steps", 1)
        split = flags.get("sequence_parallel_size", 1)  # the ranks of a group read the same rows
        readers = f"{ranks // split} groups of {split} ranks" if split > 1 else f"{ranks} ranks"
        text = f"{readers} x --batch_size {batch} x --gradient_accumulation_steps {accumulation}"
        return ranks // split * batch, ranks // split * batch * accumulation, text

    old_micro, old_global, old_text = shape(state.world_size, state.settings)
    new_micro, new_global, new_text = shape(world_size, {**state.settings, **settings})
    if settings.get("dataset_streaming") and (state.world_size, old_micro) != (world_size, new_micro):
        raise UserError(
            f"--resume_from {path}: --dataset_streaming deals rows to ranks by position, so a stream resumes only at "
            f"its own shape; resume with {state.world_size} processes and --batch_size "
            f"{state.settings.get('batch_size', 1)}"
        )
    if settings.get("group_by_length") and old_micro != new_micro:
        raise UserError(
            f"--resume_from {path}: --group_by_length orders rows in global batches of {old_micro} (world size x "
            f"--batch_size), so it continues only with world size x --batch_size = {old_micro}"
        )
    iterations, group = settings.get("num_iterations") or 1, state.settings.get("num_generations")

    def layout(ranks: int, flags: dict[str, Any]) -> tuple[Any, ...]:
        """What a rank's held generation depends on: the ranks and how each one's micro-batches are made."""
        return ranks, *(flags.get(k) for k in ("batch_size", "gradient_accumulation_steps", "num_generations"))

    if state.step % iterations and layout(world_size, settings) != layout(state.world_size, state.settings):
        raise UserError(
            f"--resume_from {path}: step {state.step} falls between the --num_iterations {iterations} steps that reuse "
            f"one generation of completions, which the checkpoint holds rank by rank for {old_text}, --num_generations "
            f"{group}; resume it with those, or from a checkpoint whose step is a multiple of {iterations}"
        )
    if iterations > 1 and old_global / group != new_global / settings.get("num_generations"):
        raise UserError(
            f"--resume_from {path}: with --num_iterations {iterations} the data position counts each step's prompts "
            f"{iterations} times, so it continues only with {old_global // group} prompts a step ({old_text} / "
            f"--num_generations {group}); keep that product, or start a new run"
        )
    notes = []
    if world_size != state.world_size:
        notes.append(
            f"world size {state.world_size} -> {world_size} (trainable weights and optimizer state resharded; the "
            "random state of dropout starts afresh)"
        )
    if new_global != old_global:
        notes.append(
            f"global batch {old_global} ({old_text}) -> {new_global} ({new_text}): the data goes on from sample "
            f"{state.samples_in_epoch} of epoch {state.epoch} in the same order, but the steps no longer match the "
            "saved run's"
        )
    return notes


def remove_checkpoints(output_dir: Path) -> None:
    """Delete a previous run's checkpoints (complete and unfinished), so this run neither prunes nor resumes them."""
    for path in [*output_dir.glob(f"{CHECKPOINT_PREFIX}*"), *output_dir.glob(f".{CHECKPOINT_PREFIX}*.tmp")]:
        if path.is_dir() and path.name.strip(".").removeprefix(CHECKPOINT_PREFIX).removesuffix(".tmp").isdigit():
            shutil.rmtree(path, ignore_errors=True)


def output_dir_shared(output_dir: Path, env: DistEnv) -> bool:
    """Whether every rank sees the same `output_dir` (a shared filesystem), tested by a file rank 0 writes there.

    Only multi-node jobs can differ: each rank writes its checkpoint shard, and a node-local directory would leave
    every checkpoint incomplete.
    """
    if env.world_size == env.local_world_size:
        return True
    marker = output_dir / f".node-check-{broadcast_object(secrets.token_hex(8), env)}"
    if env.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        marker.touch()
    dist.barrier()
    seen = torch.tensor(float(marker.exists()), device=env.device)
    dist.all_reduce(seen, op=dist.ReduceOp.MIN)
    dist.barrier()
    if env.is_main:
        marker.unlink()
    return bool(seen.item())
