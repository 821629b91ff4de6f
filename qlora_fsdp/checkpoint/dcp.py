"""Saving and resuming: the LoRA adapter in PEFT's format, and atomic checkpoints that resume on any world size.

A checkpoint directory `checkpoint-STEP/` holds:
- `adapter_model.safetensors` + `adapter_config.json` (LoRA and DoRA): the adapter gathered to rank 0, loadable by
  PEFT on its own, with `qlora_manifest.json` (qlora_fsdp/checkpoint/manifest.py), so the after-training scripts take a
  checkpoint too;
- `sharded/`: the trainable parameters and the optimizer state, written by torch.distributed.checkpoint (DCP) as
  each rank holds them, with their global layout, so a resume on another number of ranks or another sharding
  strategy reshards them as it loads. The quantized base is not in it: it is rebuilt from the model;
- `rank-R.pt` per rank: RNG states and gradient-scaler state (restored when the world size is unchanged). The
  learning-rate schedule is not saved: it is a function of the flags and the step, rebuilt on resume;
- `trainer_state.json`, written last: step, data position (global samples of the epoch consumed), world size. Its
  presence marks a complete checkpoint.

All ranks write into `.checkpoint-STEP.tmp/`, which rank 0 renames into place only after every rank has finished,
so a crash mid-write leaves the previous checkpoint intact and nothing that looks complete. With --async_save the
sharded state is copied to host memory and written by a background thread while training goes on; rank 0 marks the
checkpoint complete from the writer thread as soon as DCP reports it whole.

Checkpoints of format 1 (before `sharded/`: an optimizer shard in each `rank-R.pt`) resume at their own world size.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.staging import StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from qlora_fsdp.checkpoint.resume_rules import as_argument
from qlora_fsdp.compat import reusable_stager
from qlora_fsdp.config.objectives import with_defaults
from qlora_fsdp.errors import UserError
from qlora_fsdp.objectives.loss import LM_PREFIX
from qlora_fsdp.parallel.distributed import DistEnv, broadcast_object
from qlora_fsdp.parallel.sharding import ShardedModel

if TYPE_CHECKING:
    from qlora_fsdp.checkpoint.manifest import Manifest

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
FULL_WEIGHTS = "model.safetensors"
TRAINED_BLOCKS = "llama_pro_blocks.safetensors"
TRAINER_STATE = "trainer_state.json"
SHARDED = "sharded"
CHECKPOINT_PREFIX = "checkpoint-"
FORMAT = 2
"""2: trainable state in DCP's `sharded/`, the data position in global samples. 1: per-rank optimizer shards."""


@dataclass
class TrainState:
    """Where training stands: enough, with the saved tensors, to continue exactly."""

    step: int = 0
    """Optimizer steps done."""
    epoch: int = 0
    """Epoch of the next micro-batch."""
    samples_in_epoch: int = 0
    """Samples of that epoch's global order already consumed, by all ranks together."""
    world_size: int = 1
    seed: int = 0
    """Seed of the data sampler and of the run."""
    settings: dict[str, Any] = field(default_factory=dict)
    """The run's flags that a resume is checked against (resume_rules.RECORDED): must match, resharded or named."""
    format: int = FORMAT


def gather_adapter(model: ShardedModel, keys: dict[nn.Module, dict[str, str]]) -> dict[str, torch.Tensor]:
    """Full adapter tensors on rank 0 (empty elsewhere), keyed as PEFT saves them (see lora.adapter_keys)."""
    state: dict[str, torch.Tensor] = {}
    for module, tensors in model.gather(list(keys)):
        for name, tensor in tensors.items():
            state[keys[module][name]] = tensor
    return state


def load_adapter_into(model: ShardedModel, keys: dict[nn.Module, dict[str, str]], path: Path) -> None:
    """Copy a saved adapter into the sharded model, module by module, bit for bit (every rank reads the file)."""
    saved = load_file(str(path / ADAPTER_WEIGHTS))
    for module, names in keys.items():
        model.load(module, {name: saved[key] for name, key in names.items()})


def save_adapter(
    model: ShardedModel,
    peft_model: nn.Module,
    keys: dict[nn.Module, dict[str, str]],
    out: Path,
    *,
    env: DistEnv,
    manifest: Manifest | None = None,
) -> None:
    """Write adapter_model.safetensors + adapter_config.json that `PeftModel.from_pretrained` loads, and beside them
    the manifest of the base it was trained on (rank 0 holds it)."""
    state = gather_adapter(model, keys)
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / ADAPTER_WEIGHTS))
        peft_model.peft_config["default"].save_pretrained(str(out))
        if manifest is not None:
            manifest.write(out)
    dist.barrier()


def save_full_model(model: ShardedModel, hf_model: nn.Module, out: Path, *, env: DistEnv) -> None:
    """--train_type full: the whole model is what was trained, gathered to rank 0 (on CPU from a GPU)."""
    state = {name.removeprefix(LM_PREFIX): t for name, t in model.full_state_dict().items()}
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        hf_model.save_pretrained(str(out), state_dict=state, safe_serialization=True)
    dist.barrier()


def save_trained_blocks(model: ShardedModel, blocks: dict[nn.Module, str], out: Path, *, env: DistEnv) -> Path:
    """--train_type llama_pro: the trained blocks' tensors, under their checkpoint names, gathered block by block.

    Copying these tensors over the expanded checkpoint's gives the fine-tuned model.
    """
    state: dict[str, torch.Tensor] = {}
    for block, tensors in model.gather(list(blocks)):
        state |= {f"{blocks[block]}{name}": tensor for name, tensor in tensors.items()}
    path = out / TRAINED_BLOCKS
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        save_file(state, str(path))
    dist.barrier()
    return path


def _rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _sharded_state(model: ShardedModel, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The trainable parameters and the optimizer state as this rank holds them, under the model's own names (no
    FSDP or checkpoint wrappers), which is what lets DCP load them onto another layout."""
    options = StateDictOptions(ignore_frozen_params=model.state_dict_skips_frozen)
    weights, optim = get_state_dict(model.module, optimizer, options=options)
    trained = {name for group in optim["param_groups"] for name in group["params"]}
    return {"model": {k: v for k, v in weights.items() if k in trained}, "optim": optim}


@dataclass
class _Pending:
    """A checkpoint whose sharded state DCP is still writing; `done` is set once it is complete (or failed)."""

    tmp: Path
    final: Path
    state: TrainState
    started: float
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    message: str = ""


class Checkpointer:
    """Writes `checkpoint-STEP/` (see the module docstring), in the background with --async_save, and keeps the
    newest `total_limit` complete ones (0: all), never deleting `keep` (the checkpoint this run resumed from)."""

    def __init__(
        self,
        *,
        model: ShardedModel,
        optimizer: torch.optim.Optimizer,
        scaler: Any,
        adapter: tuple[nn.Module, dict[nn.Module, dict[str, str]], Manifest | None] | None,
        output_dir: Path,
        total_limit: int,
        async_save: bool,
        keep: Path | None,
        env: DistEnv,
        timeout_s: float,
        report: Callable[[str], None],
        objective_state: Callable[[], dict[str, Any]] = dict,
    ) -> None:
        self.model, self.optimizer, self.scaler, self.adapter = model, optimizer, scaler, adapter
        self.objective_state = objective_state
        """This rank's state of the objective (GRPO: a generation later steps reuse), kept with its RNG state."""
        self.output_dir, self.total_limit, self.keep, self.env, self.report = output_dir, total_limit, keep, env, report
        self.async_save, self.group, self.stager = async_save, None, None
        if async_save:
            # Background writes run their collectives beside training's, so on a group of their own; gloo, because
            # DCP stages to host memory.
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
            cuda = env.device.type == "cuda"
            self.stager = reusable_stager(StagingOptions(cuda, False, False, cuda))
        self.pending: _Pending | None = None

    def save(self, state: TrainState, *, wait: bool) -> Path:
        """Checkpoint `state`: whole on return when `wait` or without --async_save, else in the background, marked
        complete as soon as DCP is done. A save in flight completes first: one at a time."""
        started = time.perf_counter()  # training's stall includes waiting for the save before
        self.wait()
        final = self.output_dir / f"{CHECKPOINT_PREFIX}{state.step}"
        tmp = self.output_dir / f".{CHECKPOINT_PREFIX}{state.step}.tmp"
        if self.env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        if self.adapter is not None:
            peft_model, keys, manifest = self.adapter
            save_adapter(self.model, peft_model, keys, tmp, env=self.env, manifest=manifest)
        per_rank = {
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "rng": _rng_state(self.env.device),
            "objective": self.objective_state(),
        }
        torch.save(per_rank, tmp / f"rank-{self.env.rank}.pt")
        sharded = _sharded_state(self.model, self.optimizer)
        pending = _Pending(tmp, final, replace(state, settings=dict(state.settings)), started)
        if not self.async_save or wait:
            dcp.save(sharded, checkpoint_id=tmp / SHARDED, process_group=self.group)
            self._complete(pending)
            dist.barrier()
            if pending.message:
                self.report(pending.message)
            return final
        future = dcp.async_save(
            sharded, checkpoint_id=tmp / SHARDED, process_group=self.group, async_stager=self.stager
        )
        self.pending = pending
        future.add_done_callback(lambda written: self._finished(pending, written))
        self.report(
            f"checkpoint {final}: training goes on after {time.perf_counter() - started:.2f}s, "
            "the rest is written in the background"
        )
        return final

    def _finished(self, pending: _Pending, written: Future) -> None:
        """In DCP's writer thread, once it is done: mark the checkpoint complete without waiting for a step."""
        try:
            written.result()
            self._complete(pending)
        except BaseException as exc:  # handed to the training thread by wait()
            pending.error = exc
        finally:
            pending.done.set()

    def poll(self) -> None:
        """Report a background save that has completed (between steps; no collective). A failed one is left for
        `wait`, which every rank calls at the same point, so that all ranks stop together."""
        pending = self.pending
        if pending is not None and pending.done.is_set() and pending.error is None:
            self.pending = None
            if pending.message:
                self.report(pending.message)

    def wait(self) -> None:
        """Block until a save in flight is whole and marked complete. A collective: with --async_save every rank
        learns whether any rank's background write failed, and raises then."""
        pending, self.pending = self.pending, None
        error = None
        if pending is not None:
            pending.done.wait()
            error = pending.error
            if error is None and pending.message:
                self.report(pending.message)
        if not self.async_save:
            return
        failed = torch.tensor(float(error is not None), device=self.env.device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if error is not None:
            raise error
        if failed.item():
            raise RuntimeError("a background checkpoint write failed on another rank; its log says why")

    def close(self) -> None:
        """Wait for a save in flight, then free the staging buffers."""
        self.wait()
        if self.stager is not None:
            self.stager.close()

    def _complete(self, pending: _Pending) -> None:
        """Rank 0 marks the checkpoint complete and renames it into place. DCP's coordinator (rank 0) returns only
        after every rank's files and the metadata are written."""
        if not self.env.is_main:
            return
        _write_json_durably(pending.tmp / TRAINER_STATE, asdict(pending.state))
        if pending.final.exists():
            shutil.rmtree(pending.final)
        os.replace(pending.tmp, pending.final)
        pending.message = f"checkpoint saved to {pending.final} in {time.perf_counter() - pending.started:.2f}s"
        self._prune(pending.final)

    def _prune(self, newest: Path) -> None:
        """`newest`, just written, is kept even where checkpoints of a later step (an abandoned run) exist."""
        for stale in self.output_dir.glob(f".{CHECKPOINT_PREFIX}*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        if self.total_limit > 0:
            keep = {path.resolve() for path in (self.keep, newest) if path is not None}
            for old in list_checkpoints(self.output_dir)[: -self.total_limit]:
                if old.resolve() not in keep:
                    shutil.rmtree(old, ignore_errors=True)


def _write_json_durably(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w") as fh:
        json.dump(data, fh, indent=2)
        fh.flush()
        os.fsync(fh.fileno())


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints in `output_dir`, oldest first."""
    found = []
    for path in output_dir.glob(f"{CHECKPOINT_PREFIX}*"):
        suffix = path.name[len(CHECKPOINT_PREFIX) :]
        if suffix.isdigit() and (path / TRAINER_STATE).is_file():
            found.append((int(suffix), path))
    return [p for _, p in sorted(found)]


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


def read_train_state(path: Path) -> TrainState:
    data = json.loads((path / TRAINER_STATE).read_text())
    if "batch_in_epoch" in data:  # format 1 counted each rank's micro-batches
        micro = data["world_size"] * data.get("settings", {}).get("batch_size", 1)
        data["samples_in_epoch"] = data.pop("batch_in_epoch") * micro
        data["format"] = 1
    return TrainState(**data)


def read_objective_state(path: Path, env: DistEnv) -> dict[str, Any]:
    """This rank's objective state in a checkpoint, {} where it has none or another world size saved it (its
    rank files then split the work otherwise)."""
    if read_train_state(path).world_size != env.world_size:
        return {}
    per_rank = torch.load(path / f"rank-{env.rank}.pt", map_location="cpu", weights_only=True)
    return per_rank.get("objective", {})


def load_checkpoint(
    path: Path,
    *,
    model: ShardedModel,
    keys: dict[nn.Module, dict[str, str]],
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    env: DistEnv,
) -> TrainState:
    """Restore everything a checkpoint holds (check_resume_compatible has vetted it), resharding its trainable state
    onto this job's ranks. Per-rank RNG states apply only on the world size that saved them."""
    state = read_train_state(path)
    if state.format < 2:
        load_adapter_into(model, keys, path)
    else:
        sharded = _sharded_state(model, optimizer)
        dcp.load(sharded, checkpoint_id=path / SHARDED)
        options = StateDictOptions(ignore_frozen_params=model.state_dict_skips_frozen, strict=False)
        set_state_dict(
            model.module, optimizer, model_state_dict=sharded["model"], optim_state_dict=sharded["optim"],
            options=options,
        )  # fmt: skip
    same_ranks = state.world_size == env.world_size
    # map_location cpu: RNG states must stay CPU tensors; the optimizer moves its state to the parameters.
    per_rank = torch.load(path / f"rank-{env.rank if same_ranks else 0}.pt", map_location="cpu", weights_only=True)
    if state.format < 2:
        model.load_optimizer_state(optimizer, per_rank["optimizer"])
    if scaler is not None and per_rank["scaler"] is not None:
        scaler.load_state_dict(per_rank["scaler"])
    if same_ranks:
        _set_rng_state(per_rank["rng"], env.device)
    # Checkpoints this run writes are of this format and this world size, whatever it resumed from.
    return replace(state, world_size=env.world_size, format=FORMAT)
