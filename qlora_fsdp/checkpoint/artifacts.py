"""What a run leaves behind it: the LoRA adapter in PEFT's format, the whole model (--train_type full) or the trained
blocks (--train_type llama_pro), each gathered to rank 0 and written there."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from qlora_fsdp.objectives.loss import LM_PREFIX
from qlora_fsdp.parallel.distributed import DistEnv
from qlora_fsdp.parallel.sharding import ShardedModel

if TYPE_CHECKING:
    from qlora_fsdp.checkpoint.manifest import Manifest

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
FULL_WEIGHTS = "model.safetensors"
TRAINED_BLOCKS = "llama_pro_blocks.safetensors"


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
