"""Saving and resuming: the LoRA adapter in PEFT's format, and atomic, resumable training checkpoints.

A checkpoint directory `checkpoint-STEP/` holds:
- `adapter_model.safetensors` + `adapter_config.json`: the adapter gathered to rank 0, loadable by PEFT on its own,
  with `qlora_manifest.json` (qlora_fsdp/manifest.py), so the after-training scripts take a checkpoint too;
- `rank-R.pt` per rank: that rank's optimizer shard, RNG states and gradient-scaler state (the learning-rate
  schedule is not saved: it is a function of the flags and the step, rebuilt on resume);
  Optimizer state stays sharded (no gather, no extra memory), so a resume needs the same world size;
- `trainer_state.json`, written last: step, data position, world size. Its presence marks a complete checkpoint.

All ranks write into `.checkpoint-STEP.tmp/`, which rank 0 renames into place only after every rank has finished,
so a crash mid-write leaves the previous checkpoint intact and nothing that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import secrets
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from qlora_fsdp.distributed import DistEnv, broadcast_object
from qlora_fsdp.errors import UserError
from qlora_fsdp.fsdp import ShardedModel
from qlora_fsdp.loss import LM_PREFIX

if TYPE_CHECKING:
    from qlora_fsdp.manifest import Manifest

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
FULL_WEIGHTS = "model.safetensors"
TRAINED_BLOCKS = "llama_pro_blocks.safetensors"
TRAINER_STATE = "trainer_state.json"
CHECKPOINT_PREFIX = "checkpoint-"


@dataclass
class TrainState:
    """Where training stands: enough, with the saved tensors, to continue exactly."""

    step: int = 0
    """Optimizer steps done."""
    epoch: int = 0
    """Epoch of the next micro-batch."""
    batch_in_epoch: int = 0
    """Micro-batches of that epoch already consumed."""
    world_size: int = 1
    seed: int = 0
    """Seed of the data sampler and of the run."""
    settings: dict[str, Any] = field(default_factory=dict)
    """The flags a resume must share with the run that saved the checkpoint (data order, tensor shapes)."""


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


def save_checkpoint(
    *,
    model: ShardedModel,
    peft_model: nn.Module,
    keys: dict[nn.Module, dict[str, str]],
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    state: TrainState,
    output_dir: Path,
    total_limit: int,
    env: DistEnv,
    manifest: Manifest | None = None,
) -> Path:
    """Write `checkpoint-STEP/` atomically (see the module docstring); returns its path."""
    final = output_dir / f"{CHECKPOINT_PREFIX}{state.step}"
    tmp = output_dir / f".{CHECKPOINT_PREFIX}{state.step}.tmp"
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    save_adapter(model, peft_model, keys, tmp, env=env, manifest=manifest)
    per_rank = {
        "optimizer": model.optimizer_state(optimizer),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "rng": _rng_state(env.device),
    }
    torch.save(per_rank, tmp / f"rank-{env.rank}.pt")
    dist.barrier()
    if env.is_main:
        _write_json_durably(tmp / TRAINER_STATE, asdict(state))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _prune(output_dir, total_limit)
    dist.barrier()
    return final


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


def _prune(output_dir: Path, total_limit: int) -> None:
    for stale in output_dir.glob(f".{CHECKPOINT_PREFIX}*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    if total_limit > 0:
        for old in list_checkpoints(output_dir)[:-total_limit]:
            shutil.rmtree(old, ignore_errors=True)


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
    path: Path, settings: dict[str, Any], *, world_size: int, may_change: tuple[str, ...] = ()
) -> list[str]:
    """Refuse, before any heavy work, a resume whose data order or tensors could not match the checkpoint's.

    Returns the changes of `may_change` settings ("--lr 0.01 -> 0.005"), which the caller applies and reports.
    """
    state = read_train_state(path)
    if state.world_size != world_size:
        raise UserError(
            f"--resume_from {path}: saved by {state.world_size} processes but this job has {world_size}; "
            f"optimizer state is sharded per rank, so resume with --nproc_per_node/--nnodes giving {state.world_size}"
        )
    # Settings a checkpoint of an older version did not record are taken as unchanged.
    changed = {k: f"--{k} {state.settings[k]!r} -> {v!r}" for k, v in settings.items() if state.settings.get(k, v) != v}
    refused = [text for k, text in changed.items() if k not in may_change]
    if refused:
        raise UserError(f"--resume_from {path}: the checkpoint was made with other settings ({'; '.join(refused)})")
    return [text for k, text in changed.items() if k in may_change]


def model_identity(path: Path) -> str:
    """A short digest of a model directory's config.json and the start of each weight file.

    It tells another base model (even one with the same architecture) from this one, whatever the directory is
    called now, without reading the weights.
    """
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        with open(file, "rb") as fh:
            digest.update(fh.read(1 << 16))
        digest.update(str(file.stat().st_size).encode())
    return f"config and weights {digest.hexdigest()[:16]}"


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
    return TrainState(**json.loads((path / TRAINER_STATE).read_text()))


def load_checkpoint(
    path: Path,
    *,
    model: ShardedModel,
    keys: dict[nn.Module, dict[str, str]],
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    env: DistEnv,
) -> TrainState:
    """Restore everything `save_checkpoint` wrote (check_resume_compatible has vetted it)."""
    state = read_train_state(path)
    load_adapter_into(model, keys, path)
    # map_location cpu: RNG states must stay CPU tensors; the optimizer moves its state to the parameters.
    per_rank = torch.load(path / f"rank-{env.rank}.pt", map_location="cpu", weights_only=True)
    model.load_optimizer_state(optimizer, per_rank["optimizer"])
    if scaler is not None and per_rank["scaler"] is not None:
        scaler.load_state_dict(per_rank["scaler"])
    _set_rng_state(per_rank["rng"], env.device)
    return state
