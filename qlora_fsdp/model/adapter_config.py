"""The saved adapter config in the form PEFT loads onto transformers' own model, whichever PEFT version loads it.

On transformers 5 PEFT rewrites an adapter config's `target_modules` before it adapts a model whose routed experts
transformers fuses: it reads `gate_proj`, `up_proj` and `down_proj` (on the families converted like Qwen2-MoE:
DeepSeek-V2/V3, GLM-4.5, Qwen3-Next, ...) as the experts' names from before transformers 5, and adapts the fused
experts under them, at twice the rank. A dense MLP or shared expert with those names would then lose its adapter
and the experts' would not fit (peft 0.21.2 moves every such name; 0.22.0 keeps a name that matches linears but
adds the experts' parameter all the same, and converts Qwen2-MoE too, which 0.21.2 did not).

Training adapts this project's own skeleton, whose experts are already split per expert, with the names as given
(compat.peft_targets_as_given). The config it saves names those linears, and any named as transformers'
conversion mapping names the experts' sources, in `target_parameters` instead, by their full path
(`model.layers.0.mlp.gate_proj.weight`), which no PEFT version rewrites: PEFT adapts each with a parameter adapter
whose keys and shapes are a LoRA linear's and whose output is the same (B @ A added to the weight instead of
B @ A @ x to the output). Such adapters take no dropout and no DoRA: the saved config says dropout 0, and DoRA on
those linears is refused.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

from torch import nn

from qlora_fsdp.compat import converter_patterns, peft_rewrites, weight_transforms
from qlora_fsdp.errors import UserError

if TYPE_CHECKING:
    from peft import LoraConfig

log = logging.getLogger(__name__)


def experts_source_names(model: nn.Module) -> set[str]:
    """The names routed experts' linears had before transformers fused them (`gate_proj`, `w1`, ...), read from
    the sources of transformers' conversion mapping for `model`: the names a PEFT version may take for the experts
    (peft 0.22 does for Qwen2-MoE, 0.21 did not), so they are moved whatever the installed PEFT says."""
    names = set()
    for converter in weight_transforms(model)[1]:
        for pattern in converter_patterns(converter)[0]:
            parts = re.split(r"\\?\.", pattern)
            if len(parts) > 1 and parts[-1] == "weight":
                names.add(parts[-2])
    return names


def make_loadable(
    config: LoraConfig, *, model: nn.Module, reference: nn.Module, adapted: dict[str, nn.Module], dora: bool
) -> None:
    """Rewrite `config` (the run's, after PEFT adapted `model`) into the form PEFT loads onto `reference`,
    transformers' own model of `model`'s config: each target name PEFT would read as routed experts is replaced by the
    weights of the linears it adapted here (`adapted`: {path from the base model: LoRA layer}). Refuses, before
    training, DoRA on such linears, and a config the installed PEFT would still rewrite."""
    experts = experts_source_names(model)
    moved = sorted(
        str(name) for name in config.target_modules or () if name in experts or peft_rewrites(reference, modules=[name])
    )
    if moved:
        if dora:
            raise UserError(
                f"--train_type dora: PEFT would read {', '.join(moved)} as the routed experts' names and load their "
                "adapters onto the experts, and the form that avoids it takes no DoRA; pass --train_type lora, or "
                "leave those linears out of --lora_target_modules"
            )
        paths = sorted(path for path in adapted if path.rpartition(".")[2] in moved)
        config.target_modules = sorted(set(config.target_modules) - set(moved))
        config.target_parameters = sorted({*(config.target_parameters or ()), *(f"{p}.weight" for p in paths)})
        config.lora_dropout = 0.0
        log.info("adapter config: the %d linears named %s are saved as target_parameters, which PEFT loads as they "
                 "trained", len(paths), ", ".join(moved))  # fmt: skip
    if peft_rewrites(reference, modules=list(config.target_modules or ()), parameters=config.target_parameters or ()):
        import peft

        raise UserError(
            f"--lora_target_modules: peft {peft.__version__} would rewrite this adapter's targets when loading it onto "
            f"{model.config.model_type} (its transformers-5 conversion), so it would not load as trained; install the "
            "peft version constraints-cpu.txt names"
        )
