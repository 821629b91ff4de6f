"""Saving what was trained: the LoRA adapter in PEFT's format, gathered unit by unit (never the base model)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from qlora_fsdp.distributed import DistEnv

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
FULL_WEIGHTS = "model.safetensors"


def gather_adapter(model: FSDP, keys: dict[nn.Module, dict[str, str]], *, env: DistEnv) -> dict[str, torch.Tensor]:
    """Full adapter tensors on rank 0 (empty elsewhere), keyed as PEFT saves them (see lora.adapter_keys).

    Each adapter leaf is its own FSDP unit, so summoning it alone gathers only its few parameters. All ranks
    visit the units in the same order: each summon is a collective.
    """
    state: dict[str, torch.Tensor] = {}
    for unit in FSDP.fsdp_modules(model):
        names = keys.get(unit.module)
        if names is None:
            continue
        with FSDP.summon_full_params(unit, recurse=False, writeback=False, rank0_only=True):
            if env.is_main:
                for param_name, param in unit.module.named_parameters():
                    state[names[param_name]] = param.detach().clone().cpu()
    if env.is_main and "" in state:
        raise RuntimeError("an adapter parameter has no PEFT key; was the model changed after adapter_keys()?")
    return state


def save_adapter(
    model: FSDP, peft_model: nn.Module, keys: dict[nn.Module, dict[str, str]], out: Path, *, env: DistEnv
) -> None:
    """Write adapter_model.safetensors + adapter_config.json that `PeftModel.from_pretrained` loads."""
    state = gather_adapter(model, keys, env=env)
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / ADAPTER_WEIGHTS))
        peft_model.peft_config["default"].save_pretrained(str(out))
    dist.barrier()


def save_full_model(model: FSDP, hf_model: nn.Module, out: Path, *, env: DistEnv) -> None:
    """--train_type full: the whole model is what was trained, gathered to rank 0 on CPU."""
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(True, True)):
        state = model.state_dict()
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        hf_model.save_pretrained(str(out), state_dict=state, safe_serialization=True)
    dist.barrier()
