"""LoRA injection through PEFT, and the choice of which parameters train."""

from __future__ import annotations

import torch
from torch import nn

from qlora_fsdp.config import LoraConfig
from qlora_fsdp.errors import UserError


def target_modules(spec: str, model: nn.Module, linear_classes: tuple[type[nn.Module], ...]) -> list[str]:
    """`all`: the names of every linear layer (plain or quantized) except the output head; else the listed names.

    Computed here rather than PEFT's "all-linear", which does not recognise every quantized class (HQQLinear).
    """
    if spec.strip() != "all":
        return [name.strip() for name in spec.split(",") if name.strip()]
    head = model.get_output_embeddings()
    return sorted(
        {
            name.rpartition(".")[2]
            for name, m in model.named_modules()
            if isinstance(m, linear_classes) and m is not head
        }
    )


def inject_lora(
    model: nn.Module, cfg: LoraConfig, *, dtype: torch.dtype, quantized_classes: tuple[type[nn.Module], ...] = ()
) -> nn.Module:
    """Wrap `model` in a PeftModel whose only trainable parameters are the adapters, stored in `dtype`.

    Adapters are created on the base layer's device: real on a rank that holds weights, meta on a low-memory
    rank (FSDP's broadcast from rank 0 fills them, so every rank starts from rank 0's initialisation).
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_config = PeftLoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=target_modules(cfg.lora_target_modules, model, (nn.Linear, *quantized_classes)),
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
    return peft_model


def prepare_full_finetune(model: nn.Module, *, only_prefixes: tuple[str, ...] = ()) -> nn.Module:
    """--train_type full: every weight trains; llama_pro: only the parameters under `only_prefixes`."""
    for name, param in model.named_parameters():
        param.requires_grad_(not only_prefixes or name.startswith(only_prefixes))
    return model


def adapter_keys(peft_model: nn.Module) -> dict[nn.Module, dict[str, str]]:
    """{adapter leaf module: {its parameter name: key in PEFT's saved adapter}}, taken before FSDP wrapping.

    PEFT itself names the keys (get_peft_model_state_dict on the unwrapped model), matched to parameters by storage,
    so saving needs no name surgery on FSDP-wrapped names. Only ranks holding real tensors get keys (meta tensors
    have no storage); the other ranks get the modules, which is all they need to join the gathers.
    """
    from peft import get_peft_model_state_dict

    saved = get_peft_model_state_dict(peft_model)
    by_storage = {t.data_ptr(): key for key, t in saved.items() if not t.is_meta}
    return {
        module: {name: by_storage.get(p.data_ptr(), "") for name, p in module.named_parameters(recurse=False)}
        for module in peft_model.modules()
        if is_trainable_leaf(module)
    }


def is_trainable_leaf(module: nn.Module) -> bool:
    """A module without children whose own parameters all train: an adapter layer (or DoRA magnitude)."""
    params = list(module.parameters(recurse=False))
    return not list(module.children()) and bool(params) and all(p.requires_grad for p in params)
