"""Measurements taken inside a worker process: resident memory and the bytes a model really holds.

Byte counts come from the tensors themselves (packed storage, quantization state, flat-parameter shards), not from
formulas, so padding or an unexpected cast shows up in the figures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a (nested) dict such as HQQ's meta or a bnb QuantState.as_dict()."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors_in(v)]
    return []


def quant_state_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The quantization state of a bnb Linear4bit (ours keeps it on the module, HF on the weight) or HQQLinear."""
    state = getattr(module, "quant_state", None)
    weight = module._parameters.get("weight")
    if state is None and weight is not None:
        state = getattr(weight, "quant_state", None)
    if state is not None:
        return _tensors_in(state.as_dict(packed=True))
    meta = getattr(module, "meta", None)
    if isinstance(meta, dict):
        return _tensors_in(meta)
    return []


def model_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of parameters (packed 4-bit storage included), buffers and quantization state; meta tensors skipped.

    Tied weights are counted once. This is "the quantized model's bytes" the RSS figures are compared with.
    """
    seen: set[int] = set()
    out = {"params": 0, "buffers": 0, "quant_state": 0}
    for kind, tensors in (("params", model.parameters()), ("buffers", model.buffers())):
        for t in tensors:
            if t.is_meta or t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            out[kind] += tensor_bytes(t)
    for module in model.modules():
        out["quant_state"] += sum(tensor_bytes(t) for t in quant_state_tensors(module) if not t.is_meta)
    out["total"] = out["params"] + out["buffers"] + out["quant_state"]
    return out


def flat_param_shard_bytes(model: nn.Module) -> int:
    """Bytes of the FSDP flat-parameter shards this rank holds: quantized storage and unquantized weights alike."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    total = 0
    for unit in FSDP.fsdp_modules(model):
        handle = getattr(unit, "_handle", None)
        if handle is None:
            continue
        flat = handle.flat_param
        shard = getattr(flat, "_local_shard", None)
        total += tensor_bytes(shard if shard is not None else flat)
    return total


def module_quant_state_bytes(model: nn.Module) -> int:
    """Quantization state on this rank: every rank computes and keeps all of it (FSDP does not shard it)."""
    return sum(tensor_bytes(t) for m in model.modules() for t in quant_state_tensors(m) if not t.is_meta)


def preimport(model_dir: str | Path) -> None:
    """Import bitsandbytes and the model's architecture module before timing anything.

    Both sides would otherwise pay these imports (seconds on a small CPU) inside the timed load: ours in
    `make_backend`/`build_skeleton`, the peer's in `from_pretrained`.
    """
    import bitsandbytes  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(model_dir))]
