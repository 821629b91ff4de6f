"""Checkpoints: atomic `checkpoint-STEP/` directories, written during training and loaded on any world size.

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
from torch import nn
from torch.distributed.checkpoint.staging import StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from qlora_fsdp.checkpoint.artifacts import load_adapter_into, save_adapter
from qlora_fsdp.compat import reusable_stager
from qlora_fsdp.parallel.distributed import DistEnv
from qlora_fsdp.parallel.sharding import ShardedModel

if TYPE_CHECKING:
    from qlora_fsdp.checkpoint.manifest import Manifest

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


@dataclass(frozen=True)
class AdapterExport:
    """The adapter in PEFT's format, which each checkpoint also holds so that it loads on its own (save_adapter's
    inputs)."""

    peft_model: nn.Module
    """The PeftModel before wrapping, for its adapter config."""
    keys: dict[nn.Module, dict[str, str]]
    """lora.adapter_keys: each adapter leaf's parameters' keys in the file."""
    manifest: Manifest | None
    """The base the adapter was trained on, written beside it."""


@dataclass(frozen=True)
class CheckpointContents:
    """What each checkpoint holds: the run's live objects, read at every save."""

    model: ShardedModel
    optimizer: torch.optim.Optimizer
    scaler: Any
    """The gradient scaler, or None."""
    adapter: AdapterExport | None
    """LoRA and DoRA: the adapter in PEFT's format too; None otherwise."""
    objective_state: Callable[[], dict[str, Any]] = dict
    """This rank's state of the objective (GRPO: a generation later steps reuse), kept with its RNG state."""


@dataclass(frozen=True)
class SaveOptions:
    """Where checkpoints go, how many stay and how they are written."""

    output_dir: Path
    """Holds the `checkpoint-STEP/` directories."""
    total_limit: int
    """The newest complete checkpoints kept (0: all)."""
    keep: Path | None
    """Never deleted: the checkpoint this run resumed from."""
    async_save: bool
    """Write the sharded state in the background while training goes on."""
    timeout_s: float
    """The background writes' process group's collective timeout."""


class Checkpointer:
    """Writes `checkpoint-STEP/` (see the module docstring) holding `contents` as `options` say, reporting each
    completed one through `report`."""

    def __init__(
        self, contents: CheckpointContents, options: SaveOptions, *, env: DistEnv, report: Callable[[str], None]
    ) -> None:
        self.contents, self.options, self.env, self.report = contents, options, env, report
        self.group, self.stager = None, None
        if options.async_save:
            # Background writes run their collectives beside training's, so on a group of their own; gloo, because
            # DCP stages to host memory.
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=options.timeout_s))
            cuda = env.device.type == "cuda"
            self.stager = reusable_stager(StagingOptions(cuda, False, False, cuda))
        self.pending: _Pending | None = None

    def save(self, state: TrainState, *, wait: bool) -> Path:
        """Checkpoint `state`: whole on return when `wait` or without --async_save, else in the background, marked
        complete as soon as DCP is done. A save in flight completes first: one at a time."""
        started = time.perf_counter()  # training's stall includes waiting for the save before
        self.wait()
        contents, output_dir = self.contents, self.options.output_dir
        final = output_dir / f"{CHECKPOINT_PREFIX}{state.step}"
        tmp = output_dir / f".{CHECKPOINT_PREFIX}{state.step}.tmp"
        if self.env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        if (adapter := contents.adapter) is not None:
            save_adapter(contents.model, adapter.peft_model, adapter.keys, tmp, env=self.env, manifest=adapter.manifest)
        per_rank = {
            "scaler": contents.scaler.state_dict() if contents.scaler is not None else None,
            "rng": _rng_state(self.env.device),
            "objective": contents.objective_state(),
        }
        torch.save(per_rank, tmp / f"rank-{self.env.rank}.pt")
        sharded = _sharded_state(contents.model, contents.optimizer)
        pending = _Pending(tmp, final, replace(state, settings=dict(state.settings)), started)
        if not self.options.async_save or wait:
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
        if not self.options.async_save:
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
        options = self.options
        for stale in options.output_dir.glob(f".{CHECKPOINT_PREFIX}*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        if options.total_limit > 0:
            keep = {path.resolve() for path in (options.keep, newest) if path is not None}
            for old in list_checkpoints(options.output_dir)[: -options.total_limit]:
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
