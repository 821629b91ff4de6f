"""Filling the skeleton: stream the checkpoint one tensor at a time, quantize each linear as it arrives, and hand
each decoder layer on (to be sharded) as soon as it is whole.

Every rank reads the checkpoint itself; none holds more than its shards plus the layers in flight and the
embeddings, head and norm (sharded last, with the root). There is no rank-0 copy of the model; the only thing sent
between ranks is quantized results, which the ranks share out instead of each computing them all.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from qlora_fsdp.config.options import ModelConfig
from qlora_fsdp.errors import UserError
from qlora_fsdp.model.conversion import CheckpointNames
from qlora_fsdp.model.formats import Prequantized, Stored
from qlora_fsdp.model.formats.base import Stacked
from qlora_fsdp.model.formats.files import Lazy
from qlora_fsdp.model.load_plan import WeightShares
from qlora_fsdp.model.skeleton import Skeleton, build_skeleton, transformers_model
from qlora_fsdp.parallel.distributed import DistEnv
from qlora_fsdp.quant import QuantBackend
from qlora_fsdp.quant.base import QuantizedLinear
from qlora_fsdp.quant.experts import QuantizedExperts

log = logging.getLogger(__name__)


class _Params:
    """Every (module, attribute) that holds each parameter, so replacing a tied parameter replaces it everywhere."""

    def __init__(self, model: nn.Module) -> None:
        self.holders: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for attr, param in module._parameters.items():
                if param is not None:
                    self.holders.setdefault(id(param), []).append((module, attr))

    def replace(self, old: nn.Parameter, value: torch.Tensor) -> None:
        new = nn.Parameter(value, requires_grad=old.requires_grad)
        holders = self.holders.pop(id(old))
        for module, attr in holders:
            module._parameters[attr] = new
        self.holders[id(new)] = holders

    def materialize(self, module: nn.Module, device: torch.device) -> None:
        """Allocate every parameter of `module` still on meta (adapters: initialised later) and move buffers."""
        for param in list(module.parameters()):
            if param.is_meta:
                self.replace(param, torch.empty_like(param, device=device))
        for sub in module.modules():
            for name, buf in sub._buffers.items():
                if buf is not None and not buf.is_meta:
                    sub._buffers[name] = buf.to(device)


def stream_weights(
    skeleton: Skeleton,
    *,
    backend: QuantBackend | None,
    device: torch.device,
    on_unit_ready: Callable[[str, nn.Module], None] | None = None,
    env: DistEnv | None = None,
) -> None:
    """Read the checkpoint one tensor at a time into the skeleton, quantizing each target weight as it arrives.

    With `env`, every rank of the job streams the same checkpoint and shares the quantization out: the backend
    splits each weight between the ranks (see QuantBackend.quantize), or, for a backend that needs weights whole
    (`whole_weights`), each rank quantizes whole weights of a decoder layer and the layer's results are exchanged
    when it is complete (load_plan.WeightShares). Without `env` this process quantizes every weight itself.

    Tensors may come in any order and a decoder layer may span shards: as soon as every tensor of a layer has
    arrived, its remaining meta parameters (adapters) are allocated and `on_unit_ready(name, layer)` runs, so the
    caller can shard it and free the full copy. Parameters outside decoder layers (embeddings, norm, head) are
    kept whole; the caller handles them after this returns. Raises UserError naming a missing tensor.
    """
    model = skeleton.model
    params = _Params(model)
    quantized = {id(m) for n, m in model.named_modules() if backend is not None and backend.is_quantized(m)}
    by_length = sorted(skeleton.units, key=len, reverse=True)

    def unit_of(name: str) -> str:
        return next((u for u in by_length if name.startswith(u + ".")), "")

    # A required "slot" is one parameter; tied names (embed_tokens / lm_head) share one slot.
    slot_of = {name: id(m._parameters[attr]) for name, (m, attr) in skeleton.sources.items() if attr in m._parameters}
    pending: dict[str, set[int]] = {}
    for name, slot in slot_of.items():
        pending.setdefault(unit_of(name), set()).add(slot)
    first_name = {}
    for name, slot in slot_of.items():
        first_name.setdefault(slot, name)
    shares = None
    if backend is not None and backend.whole_weights and env is not None and env.world_size > 1:
        by_unit: dict[str, list[QuantizedLinear]] = {}
        for name, (module, attr) in skeleton.sources.items():
            if id(module) in quantized and attr == "weight" and unit_of(name):
                by_unit.setdefault(unit_of(name), []).append(module)  # type: ignore[arg-type]
        shares = WeightShares(by_unit, backend=backend, env=env, device=device)

    # Where every tensor goes is known from the files' names: a checkpoint that cannot fill the model is refused
    # before any weight is read.
    experts = _split_experts(skeleton)
    names = _checkpoint_names(skeleton, experts)
    filled = {slot_of[n] for target in names.targets() for n in _expand(target, experts) if n in slot_of}
    missing = sorted(first_name[s] for slots in pending.values() for s in slots if s not in filled)
    if missing:
        raise UserError(
            f"--model {skeleton.path}: checkpoint lacks {len(missing)} tensor(s), e.g. {missing[0]}; is it complete?"
        )
    short = names.incomplete(lambda target: _expert_count(model, target))
    if short:
        raise UserError(f"--model {skeleton.path}: checkpoint lacks expert tensors ({short[0]}); is it complete?")

    unjoined: set[str] = set()
    ignored: list[str] = []

    def say_unjoined(name: str, stacked: Stacked) -> None:
        """One line per reason where parts the file stores quantized (an expert's gate and up) cannot be held as the
        one layer they fill, so a layer that could have kept them quantizes them again."""
        if isinstance(stacked.joined, str) and stacked.joined not in unjoined:
            unjoined.add(stacked.joined)
            log.warning(
                "--model %s: %s and every expert's layer like it: %s, so the parts the checkpoint stores (an "
                "expert's gate and up projections) cannot be held as one layer as they are; they are dequantized and "
                "quantized again with --quant %s",
                skeleton.path, name, stacked.joined, backend.name,  # type: ignore[union-attr]
            )  # fmt: skip

    def place(name: str, tensor: Stored, source: str) -> None:
        """Fill `name` from `tensor`, which the checkpoint stores as `source`."""
        located = skeleton.sources.get(name)
        if located is None:
            ignored.append(name)
            return
        module, attr = located
        _check_fits(skeleton.path, name, tensor, module, attr, source)
        kept = None
        if isinstance(tensor, Prequantized):  # the file's own quantization: kept where the layer's is the same
            kept = tensor.kept(module) if attr == "weight" else None
            if kept is None and isinstance(tensor, Stacked) and id(module) in quantized:
                say_unjoined(name, tensor)
            tensor = tensor.dequantize() if kept is None else tensor
        elif isinstance(tensor, Lazy):
            tensor = tensor.read()
        if kept is None and attr == "weight" and isinstance(module, QuantizedLinear) and id(module) not in quantized:
            raise UserError(
                f"--model {skeleton.path}: {source} arrives unquantized for {name}, which holds the checkpoint's own "
                f"quantization ({type(module).__name__}, kept as stored): the checkpoint stores this weight otherwise "
                "than its config.json declares; pass --mxfp4 dequantize to quantize such weights with --quant"
            )
        if kept is not None:
            module.set_quantized(kept.to(device))  # type: ignore[operator]
            if shares is not None:  # every rank read the same bytes: nothing to share out
                shares.drop(module)
        elif id(module) in quantized and attr == "weight":  # a bias of a quantized layer is a plain parameter
            if shares is not None and shares.covers(module):
                shares.arrive(module, tensor)  # type: ignore[arg-type]
            else:
                backend.load_weight(module, tensor, device=device, env=env)  # type: ignore[union-attr]
        elif attr in module._parameters:
            old = module._parameters[attr]
            params.replace(old, tensor.to(device=device, dtype=old.dtype if tensor.is_floating_point() else None))
        else:
            module._buffers[attr] = tensor.to(device)
            return
        unit = unit_of(name)
        waiting = pending.get(unit)
        if waiting is None:
            return
        waiting.discard(slot_of[name])
        if not waiting and unit:
            del pending[unit]
            if shares is not None:
                shares.exchange(unit)
            layer = skeleton.units[unit]
            params.materialize(layer, device)
            if on_unit_ready is not None:
                on_unit_ready(unit, layer)

    for checkpoint_name, stored in skeleton.checkpoint_format.tensors(skeleton.files):
        target = names.fused_target(checkpoint_name)
        # A pre-quantized source of a fused target reaches per-expert layers as the file stores it (the target is
        # then one weight per expert, see CheckpointNames.arrive); any other is fused by transformers' own ops.
        if isinstance(stored, Prequantized) and target is not None and not _per_expert(target, experts):
            stored = stored.dequantize()
        for name, converted in names.arrive(checkpoint_name, stored).items():
            module_name, _, fused = name.rpartition(".")
            module = experts.get(module_name)
            if module is None or fused not in module.fused_names():
                place(name, converted, checkpoint_name)
                continue
            if isinstance(converted, Prequantized):  # one part per expert where the format splits it
                parts = converted.experts()
                converted = converted.dequantize() if parts is None else parts
            elif isinstance(converted, Lazy):
                converted = converted.read()
            count = len(converted) if isinstance(converted, list) else converted.shape[0]
            if count != module.num_experts:
                raise UserError(f"--model {skeleton.path}: {name} holds {count} experts, but the model has "
                                f"{module.num_experts} (config.json); the checkpoint does not match it")  # fmt: skip
            for part, value in module.split(fused, converted).items():  # one 2-D weight (or bias) per expert
                place(f"{module_name}.{part}", value, name)
    if ignored:  # a release's multi-token-prediction layer (DeepSeek-V3's), say: transformers' model has none
        log.warning("--model %s: %d checkpoint tensor(s) the model has no parameter for were skipped, e.g. %s",
                    skeleton.path, len(ignored), ignored[0])  # fmt: skip
    params.materialize(model, device)


def checkpoint_targets(skeleton: Skeleton) -> set[str]:
    """The model names the checkpoint fills, after transformers' conversion (fused experts by their fused name)."""
    return _checkpoint_names(skeleton, _split_experts(skeleton)).targets()


def _checkpoint_names(skeleton: Skeleton, experts: dict[str, QuantizedExperts]) -> CheckpointNames:
    names = skeleton.checkpoint_format.names(skeleton.files)
    # Conversions read parameter shapes (a split's sizes) from transformers' own model, not from packed layers.
    reference = skeleton.reference or transformers_model(skeleton.model)
    return CheckpointNames(reference, names, _model_names(skeleton, experts))


def _expert_count(model: nn.Module, target: str) -> int | None:
    """How many experts the module holding `target` has (None: not an experts module)."""
    with contextlib.suppress(AttributeError):
        return getattr(model.get_submodule(target.rpartition(".")[0]), "num_experts", None)
    return None


def _split_experts(skeleton: Skeleton) -> dict[str, QuantizedExperts]:
    return {n: m for n, m in skeleton.model.named_modules() if isinstance(m, QuantizedExperts)}


def _model_names(skeleton: Skeleton, experts: dict[str, QuantizedExperts]) -> list[str]:
    """The model's tensor names as transformers knows them: routed experts split here keep their fused names."""
    inside = tuple(f"{n}." for n in experts)
    names = [n for n in skeleton.sources if not (inside and n.startswith(inside))]
    return names + [f"{n}.{fused}" for n, module in experts.items() for fused in module.fused_names()]


def _per_expert(target: str, experts: dict[str, QuantizedExperts]) -> bool:
    """Whether the fused target `target` fills per-expert layers each weight of which is [out, in] as the
    checkpoint's per-expert weights are (transposed layouts are fused by transformers' own ops)."""
    module_name, _, fused = target.rpartition(".")
    module = experts.get(module_name)
    return module is not None and fused in module.fused_names() and not module.layout.transposed


def _check_fits(path: Path, name: str, tensor: Stored, module: nn.Module, attr: str, source: str) -> None:
    """Refuses, in one line naming both, a checkpoint tensor `source` that cannot be what fills `name`: another
    shape than the model's (config.json's), or integers for a floating-point parameter (or the reverse); a quantized
    layer's weight is its [out, in] matrix, whatever its packed storage."""
    if isinstance(module, QuantizedLinear) and attr == "weight":
        shape, floating = torch.Size((module.out_features, module.in_features)), True
    else:
        held = module._parameters.get(attr, module._buffers.get(attr))
        if held is None:
            return
        shape, floating = held.shape, held.is_floating_point()
    if isinstance(tensor, Prequantized):
        found, kind_fits = "quantized", True
    else:
        found, kind_fits = str(tensor.dtype).removeprefix("torch."), tensor.is_floating_point() == floating
    if tuple(tensor.shape) != tuple(shape) or not kind_fits:
        where = name if source == name else f"{name} (from {source})"
        raise UserError(
            f"--model {path}: {where}: expected {list(shape)} {'floating-point' if floating else 'integer'} values "
            f"(config.json's model), found {found} {list(tensor.shape)}; the checkpoint does not match its config.json"
        )


def _expand(name: str, experts: dict[str, QuantizedExperts]) -> list[str]:
    """`name` itself, or for a fused experts name (`...experts.gate_up_proj`) the per-expert weights it fills."""
    module_name, _, attr = name.rpartition(".")
    module = experts.get(module_name)
    if module is None or attr not in module.fused_names():
        return [name]
    return [f"{module_name}.{part}" for part in module.part_names(attr)]


def load_model(
    cfg: ModelConfig,
    *,
    backend: QuantBackend | None,
    device: torch.device,
    param_dtype: torch.dtype,
    path: Path | None = None,
    kept_experts: Callable[[nn.Linear], nn.Linear] | None = None,
) -> Skeleton:
    """The whole model in this process, quantized, unsharded (tools and tests; training streams into shards)."""
    skeleton = build_skeleton(cfg, backend=backend, param_dtype=param_dtype, path=path, kept_experts=kept_experts)
    stream_weights(skeleton, backend=backend, device=device)
    return skeleton
