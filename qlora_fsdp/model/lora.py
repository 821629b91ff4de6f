"""LoRA injection through PEFT, and the choice of which parameters train."""

from __future__ import annotations

import contextlib
import logging
import math
import re
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from qlora_fsdp.compat import peft_targets_as_given
from qlora_fsdp.config.options import LoraConfig
from qlora_fsdp.errors import UserError
from qlora_fsdp.model.adapter_config import make_loadable
from qlora_fsdp.model.attention import indexer_linears
from qlora_fsdp.model.skeleton import transformers_model
from qlora_fsdp.model.vision import split_vision_targets, vision_parts
from qlora_fsdp.quant.experts import FUSED, ExpertAdapter, QuantizedExperts, is_projection, router_gates

log = logging.getLogger(__name__)


def adapts_experts(spec: str) -> bool:
    """Whether `--lora_target_modules` puts adapters on routed experts: `all`, or a list naming `experts`."""
    names = [name.strip() for name in spec.split(",")]
    return spec.strip() == "all" or "experts" in names


def target_modules(spec: str, model: nn.Module, *, within: str = "") -> tuple[list[str], list[str]]:
    """(names for PEFT's `target_modules`, qualified names for its `exclude_modules`).

    `all`: the last names of every linear under `within` that projects (plain or quantized) except the output head,
    routers, indexers and the per-expert layers (adapted through their fused parameters instead); else the listed
    names, less `experts`, a listed router PEFT's LoRA cannot wrap refused. Excluded: any other linear under
    `within` that a chosen name would catch (a sparse-attention indexer's `gate_proj` beside the compressor's, a
    linear with a forward of its own, a router sharing a name), since PEFT matches names by their last parts.
    """
    gates = router_gates(model)
    indexers = indexer_linears(model)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith(within)}
    if spec.strip() != "all":
        names = [name.strip() for name in spec.split(",") if name.strip() and name.strip() != "experts"]
        _refuse_routers(spec, names, gates, model)
        adapted = {n for n, m in linears.items() if n not in indexers and is_projection(m)}
    else:
        head = model.get_output_embeddings()
        inside = tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, QuantizedExperts))
        adapted = {
            n
            for n, m in linears.items()
            if m is not head
            and is_projection(m)
            and n not in gates | indexers
            and not (inside and n.startswith(inside))
        }
        names = sorted({n.rpartition(".")[2] for n in adapted})
    caught = [n for n in linears if any(n == t or n.endswith(f".{t}") for t in names)]
    return names, sorted(n for n in caught if n not in adapted)


def _refuse_routers(spec: str, names: list[str], gates: set[str], model: nn.Module) -> None:
    """A listed name PEFT would match to a router that is more than a projection (PhiMoE's returns a tuple) fails
    in the first forward, deep in PEFT; say so before anything is built."""
    for gate in sorted(gates):
        router = model.get_submodule(gate)
        # PEFT matches a listed name against the whole qualified name or its last parts.
        named = next((n for n in names if gate == n or gate.endswith(f".{n}")), None)
        if named is not None and not is_projection(router):
            raise UserError(
                f"--lora_target_modules {spec}: {named} is a router ({gate}, {type(router).__name__}), which routes "
                "tokens in full precision and cannot take an adapter; leave it out"
            )


def inject_lora(
    model: nn.Module, cfg: LoraConfig, *, dtype: torch.dtype, saved: bool = True, reference: nn.Module | None = None
) -> nn.Module:
    """Wrap `model` in a PeftModel whose only trainable parameters are the adapters, stored in `dtype`.

    On a meta skeleton the adapters are meta too: `init_adapters` gives them their values once their decoder
    layer has been loaded. Routed experts (QuantizedExperts) get per-expert adapters on their fused projections,
    recorded in the adapter config as PEFT's `target_parameters`, so PEFT builds the same adapter on the
    transformers model; the config is saved in the form PEFT loads there (adapter_config.make_loadable, on
    `reference`, transformers' own model of `model`'s config, built here if not given), unless the adapter is not to
    be `saved` (one loaded from its file to generate with).
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    experts = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedExperts)}
    adapt_experts = bool(experts) and adapts_experts(cfg.lora_target_modules)
    if adapt_experts and cfg.train_type == "dora":
        raise UserError(
            "--train_type dora: DoRA on routed experts is not supported; use --train_type lora, or name the modules "
            "to adapt in --lora_target_modules without `experts`"
        )
    parts = vision_parts(model)
    spec, vision_linears, vision_exclude = split_vision_targets(cfg.lora_target_modules, parts, model)
    names, excluded = target_modules(spec, model, within=f"{parts.language}." if parts else "") if spec else ([], [])
    if not names + vision_linears:
        raise UserError(
            f"--lora_target_modules {cfg.lora_target_modules}: name at least one linear layer besides experts "
            "(e.g. q_proj,v_proj,experts), or pass all"
        )
    exclude = "|".join([*([vision_exclude] if vision_exclude else []), *map(re.escape, excluded)]) or None
    peft_config = PeftLoraConfig(
        exclude_modules=exclude,
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=names + vision_linears,
        bias="none",
        task_type="CAUSAL_LM",
        use_dora=cfg.train_type == "dora",
    )
    try:
        with peft_targets_as_given():  # the experts here are split already: the names mean what they say
            peft_model = get_peft_model(model, peft_config, autocast_adapter_dtype=False)
    except ValueError as exc:
        raise UserError(f"--lora_target_modules {cfg.lora_target_modules}: {str(exc).splitlines()[0]}") from None
    peft_config = peft_model.peft_config["default"]
    if adapt_experts:
        for module in experts.values():
            for adapter in module.add_adapters(rank=cfg.lora_rank, alpha=cfg.lora_alpha):
                adapter.requires_grad_(True)
        # PEFT's own layout for them (see ExpertAdapter), which has no dropout.
        peft_config.target_parameters = sorted(
            {f"{name.rpartition('.')[2]}.{fused}" for name in experts for fused in FUSED}
        )
        peft_config.lora_dropout = 0.0
    if saved:
        lora = set(peft_lora_layers(model))
        adapted = {n: m for n, m in model.named_modules() if m in lora}
        reference = reference or transformers_model(model)
        make_loadable(peft_config, model=model, reference=reference, adapted=adapted, dora=cfg.train_type == "dora")
    for param in peft_model.parameters():
        if param.requires_grad:
            param.data = param.data.to(dtype)
    for layer in peft_lora_layers(peft_model):
        # PEFT casts the adapter input to the adapter weight's dtype, read outside the adapter's FSDP1 unit: stored
        # dtype in forward, cast dtype in a checkpoint's recompute, which then refuses to run. FSDP casts inputs.
        layer.cast_input_dtype_enabled = False
    return peft_model


def peft_lora_layers(module: nn.Module) -> list[nn.Module]:
    """PEFT's LoRA layers under `module` (each holds lora_A, lora_B and, for DoRA, a magnitude per adapter)."""
    from peft.tuners.lora import LoraLayer

    return [m for m in module.modules() if isinstance(m, LoraLayer)]


def lora_layers(module: nn.Module) -> list[nn.Module]:
    """Every adapter layer under `module`: PEFT's, and the routed experts' own (ExpertAdapter)."""
    from peft.tuners.lora import LoraLayer

    return [m for m in module.modules() if isinstance(m, (LoraLayer, ExpertAdapter))]


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """`model` (a PeftModel) runs as its base model: PEFT's adapters disabled, and the routed experts' own."""
    experts = [m for m in model.modules() if isinstance(m, ExpertAdapter)]
    for adapter in experts:
        adapter.enabled = False
    try:
        with model.disable_adapter():
            yield
    finally:
        for adapter in experts:
            adapter.enabled = True


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
            if isinstance(layer, ExpertAdapter):
                layer.reset(generator)
                continue
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
        if isinstance(module, ExpertAdapter):
            # PEFT's key for the fused parameter's wrapper on the experts module (see ExpertAdapter).
            key = f"{module_name.rpartition('.')[0]}.{module.peft_prefix}lora_"
            out[module] = {"A": f"{key}A.weight", "B": f"{key}B.weight"}
        elif is_trainable_leaf(module):
            prefix = f"{module_name}." if module_name else ""
            out[module] = {n: key_of.get(prefix + n, "") for n, _ in module.named_parameters(recurse=False)}
    return out


def is_trainable_leaf(module: nn.Module) -> bool:
    """A module without children whose own parameters all train: an adapter layer (or DoRA magnitude)."""
    params = list(module.parameters(recurse=False))
    return not list(module.children()) and bool(params) and all(p.requires_grad for p in params)


def load_saved_adapter(model: nn.Module, path: Path, config: dict, *, dtype: torch.dtype) -> nn.Module:
    """A saved LoRA adapter (`config` is its adapter_config.json) on a model whose routed experts are split per
    expert, where PEFT's own loader cannot put its `target_parameters` adapters: built by `inject_lora` as training
    built it, filled from the file by PEFT's keys."""
    from safetensors.torch import load_file

    # target_parameters name the fused experts (`experts.gate_up_proj`) and the linears saved by their weight
    # (`model.layers.0.mlp.gate_proj.weight`, see adapter_config), which training targeted by their last name.
    parameters = [p.rpartition(".") for p in config.get("target_parameters") or []]
    linears = {owner.rpartition(".")[2] for owner, _, attr in parameters if attr not in FUSED}
    experts = ["experts"] if any(attr in FUSED for _, _, attr in parameters) else []
    targets = sorted({*(config.get("target_modules") or []), *linears}) + experts
    lora = LoraConfig(
        lora_rank=int(config["r"]), lora_alpha=float(config["lora_alpha"]), lora_dropout=0.0,
        lora_target_modules=",".join(targets), train_type="dora" if config.get("use_dora") else "lora",
    )  # fmt: skip
    peft_model = inject_lora(model, lora, dtype=dtype, saved=False)
    tensors = load_file(str(path))
    device = next(model.parameters()).device
    for module, names in adapter_keys(peft_model).items():
        for attr, key in names.items():
            if key not in tensors:
                raise UserError(f"--adapter {path.parent}: {path.name} lacks {key}; the adapter file is incomplete")
            module._parameters[attr] = nn.Parameter(tensors[key].to(device=device, dtype=dtype), requires_grad=False)
    return peft_model
