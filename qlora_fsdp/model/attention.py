"""Attention: which of transformers' implementations the model attends with, and corrections to transformers'
attention modules where their bookkeeping disagrees with the tensors they make.

Multi-head latent attention (DeepSeek-V2/V3 and the families built on it) expands its compressed latent through
`kv_b_proj` into keys and values for every query head, yet transformers 5 still sets `num_key_value_groups` from
the config's `num_key_value_heads`. Real checkpoints keep the two head counts equal (groups 1); a config with fewer
KV heads (a tiny test model's, say) makes the eager and masked-sdpa paths repeat the already-full keys again:
"The size of tensor a (4) must match the size of tensor b (8)". Unmasked sdpa only runs because its `enable_gqa`
path is a no-op on equal head counts, so the model's meaning is groups 1, and that is what is set here.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)


def latent_attention_groups(module: nn.Module) -> bool:
    """Whether `module` is latent attention whose `kv_b_proj` makes keys and values for every query head while
    its `num_key_value_groups` says otherwise (so transformers would repeat them)."""
    needed = ("kv_b_proj", "num_heads", "qk_nope_head_dim", "v_head_dim", "num_key_value_groups")
    if not all(hasattr(module, attr) for attr in needed) or module.num_key_value_groups == 1:
        return False
    per_head = module.qk_nope_head_dim + module.v_head_dim
    return getattr(module.kv_b_proj, "out_features", None) == module.num_heads * per_head


def fix_latent_attention(model: nn.Module) -> list[str]:
    """Give every latent-attention module of `model` whose keys already cover every head one key-value group, as
    its weights mean; returns the modules' names."""
    fixed = [name for name, module in model.named_modules() if latent_attention_groups(module)]
    for name in fixed:
        model.get_submodule(name).num_key_value_groups = 1
    if fixed:
        log.warning(
            "%s: num_key_value_heads %s ignored: latent attention makes keys and values for all %s query heads",
            type(model).__name__,
            getattr(model.config, "num_key_value_heads", "?"),
            getattr(model.config, "num_attention_heads", "?"),
        )
    return fixed


FLASH_ATTENTION = "flash_attention_2"


def attention_implementation(*, packing: bool, device: torch.device, dtype: torch.dtype) -> str:
    """flash_attention_2 for packed rows on a GPU where flash-attn is installed (it needs bf16/fp16), else sdpa."""
    if not packing or device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return "sdpa"
    from transformers.utils import is_flash_attn_2_available

    return FLASH_ATTENTION if is_flash_attn_2_available() else "sdpa"


def indexer_linears(model: nn.Module) -> set[str]:
    """The linears of sparse-attention indexers (DeepSeek-V3.2's and GLM-5's lightning indexer, DeepSeek-V4's in
    its compressed sparse attention): they score keys only to pick the top-k each query attends to, and no gradient
    flows through a choice (V3.2's runs under no_grad), so an adapter there would learn nothing and quantizing them
    would change which keys are chosen. Like routers they stay in full precision, frozen and unadapted. Found by
    the module's class, whose name transformers ends in `Indexer`."""
    found = set()
    for name, module in model.named_modules():
        if type(module).__name__.endswith("Indexer"):
            found |= {f"{name}.{n}" for n, m in module.named_modules() if n and isinstance(m, nn.Linear)}
    return found
