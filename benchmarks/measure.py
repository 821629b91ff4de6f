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
    """Quantization state held outside parameters: a bnb Linear4bit's (ours keeps it on the module, HF on the
    weight), an HQQLinear's meta, or our layers' under FSDP1 (replicated; under FSDP2 it is parameters)."""
    from qlora_fsdp.quant.base import QuantizedLinear

    if isinstance(module, QuantizedLinear):
        return [] if module.state_as_parameters else list(module.state_bytes().values())
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


def model_bytes(model: nn.Module, *, exclude: tuple[str, ...] = ()) -> dict[str, int]:
    """Bytes of parameters (packed 4-bit storage included), buffers and quantization state; meta tensors and names
    under the `exclude` prefixes skipped.

    Tied weights are counted once. This is "the quantized model's bytes" the RSS figures are compared with.
    """
    seen: set[int] = set()
    out = {"params": 0, "buffers": 0, "quant_state": 0}
    for kind, tensors in (("params", model.named_parameters()), ("buffers", model.named_buffers())):
        for name, t in tensors:
            if t.is_meta or t.data_ptr() in seen or name.startswith(exclude):
                continue
            seen.add(t.data_ptr())
            out[kind] += tensor_bytes(t)
    for name, module in model.named_modules():
        if not name.startswith(exclude):
            out["quant_state"] += sum(tensor_bytes(t) for t in quant_state_tensors(module) if not t.is_meta)
    out["total"] = out["params"] + out["buffers"] + out["quant_state"]
    return out


def preimport(model_dir: str | Path) -> None:
    """Import bitsandbytes and the model's architecture module before timing anything.

    Both sides would otherwise pay these imports (seconds on a small CPU) inside the timed load: ours in
    `make_backend`/`build_skeleton`, the peer's in `from_pretrained`.
    """
    import bitsandbytes  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(model_dir))]
