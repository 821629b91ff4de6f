"""LoRA injection through PEFT, and the choice of which parameters train."""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from qlora_fsdp.config import LoraConfig
from qlora_fsdp.errors import UserError


def target_modules(spec: str, model: nn.Module) -> list[str]:
    """`all`: the names of every linear layer (plain or quantized: both are nn.Linear) except the output head;
    else the listed names."""
    if spec.strip() != "all":
        return [name.strip() for name in spec.split(",") if name.strip()]
    head = model.get_output_embeddings()
    return sorted(
        {name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head}
    )


def inject_lora(model: nn.Module, cfg: LoraConfig, *, dtype: torch.dtype) -> nn.Module:
    """Wrap `model` in a PeftModel whose only trainable parameters are the adapters, stored in `dtype`.

    On a meta skeleton the adapters are meta too: `init_adapters` gives them their values once their decoder
    layer has been loaded.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_config = PeftLoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=target_modules(cfg.lora_target_modules, model),
        bias="none",
        task_type="CAUSAL_LM",
        use_dora=cfg.train_type == "dora",
    )
    try:
        peft_model = get_peft_model(model, peft_config, autocast_adapter_dtype=False)
    except ValueError as exc:
        raise UserError(f"--lora_target_modules {cfg.lora_target_modules}: {str(exc).splitlines()[0]}") from None
    for name, param in peft_model.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(dtype)
    for layer in lora_layers(peft_model):
        # PEFT casts the adapter input to the adapter weight's dtype, read outside the adapter's FSDP1 unit: stored
        # dtype in forward, cast dtype in a checkpoint's recompute, which then refuses to run. FSDP casts inputs.
        layer.cast_input_dtype_enabled = False
    return peft_model


def lora_layers(module: nn.Module) -> list[nn.Module]:
    """PEFT's LoRA layers under `module` (each holds lora_A, lora_B and, for DoRA, a magnitude per adapter)."""
    from peft.tuners.lora import LoraLayer

    return [m for m in module.modules() if isinstance(m, LoraLayer)]


def init_adapters(layers: list[nn.Module], *, seed: int, name: str) -> None:
    """PEFT's default initialisation (A: Kaiming-uniform, B: zero; DoRA magnitude: the base weight's row norms),
    drawn on the CPU from a generator seeded by (`seed`, `name`).

    So every rank, world size and device gets the same A and B without communication, and without touching the
    global RNG that dropout draws from. Call it once the layer's base weights are loaded: DoRA's magnitude is
    computed from them, on their device.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    with torch.no_grad():
        for layer in layers:
            for adapter, lora_a in layer.lora_A.items():
                values = torch.empty(lora_a.weight.shape, dtype=torch.float32)
                nn.init.kaiming_uniform_(values, a=math.sqrt(5), generator=generator)
                lora_a.weight.copy_(values)
                layer.lora_B[adapter].weight.zero_()
                if adapter in layer.lora_magnitude_vector:
                    magnitude = layer.lora_magnitude_vector[adapter]
                    magnitude.update_layer(
                        base_layer=layer.get_base_layer(),
                        lora_A=lora_a.weight,
                        lora_B=layer.lora_B[adapter].weight,
                        scaling=layer.scaling[adapter],
                    )
                    # PEFT computes the norms in the dequantized weight's dtype; keep the adapters' dtype.
                    magnitude.weight.data = magnitude.weight.data.to(lora_a.weight.dtype)


def prepare_full_finetune(model: nn.Module, *, only_prefixes: tuple[str, ...] = ()) -> nn.Module:
    """--train_type full: every weight trains; llama_pro: only the parameters under `only_prefixes`."""
    for name, param in model.named_parameters():
        param.requires_grad_(not only_prefixes or name.startswith(only_prefixes))
    return model


def adapter_keys(peft_model: nn.Module) -> dict[nn.Module, dict[str, str]]:
    """{adapter leaf module: {its parameter name: key in PEFT's saved adapter}}, taken before FSDP wrapping.

    PEFT itself names the keys: its get_peft_model_state_dict is given a state dict whose values are markers,
    one per parameter, so this works on a meta model and saving needs no name surgery on sharded names.
    """
    from peft import get_peft_model_state_dict

    names = [name for name, _ in peft_model.named_parameters()]
    markers = {name: torch.tensor([i]) for i, name in enumerate(names)}
    saved = get_peft_model_state_dict(peft_model, state_dict=markers)
    key_of = {names[int(marker)]: key for key, marker in saved.items()}
    out = {}
    for module_name, module in peft_model.named_modules():
        if is_trainable_leaf(module):
            prefix = f"{module_name}." if module_name else ""
            out[module] = {n: key_of.get(prefix + n, "") for n, _ in module.named_parameters(recurse=False)}
    return out


def is_trainable_leaf(module: nn.Module) -> bool:
    """A module without children whose own parameters all train: an adapter layer (or DoRA magnitude)."""
    params = list(module.parameters(recurse=False))
    return not list(module.children()) and bool(params) and all(p.requires_grad for p in params)
