"""The model's skeleton: the architecture from config.json on the meta device, its linears already swapped for the
backend's empty quantized layers, and a map of where each checkpoint tensor goes. Nothing is read from the weights."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from qlora_fsdp.compat import no_split_modules
from qlora_fsdp.config.options import ModelConfig
from qlora_fsdp.errors import UserError
from qlora_fsdp.model.attention import fix_latent_attention, indexer_linears
from qlora_fsdp.model.formats import CheckpointFormat, checkpoint_format
from qlora_fsdp.model.hub import resolve_model_path
from qlora_fsdp.model.vision import auto_model_class, vision_parts
from qlora_fsdp.quant import QuantBackend
from qlora_fsdp.quant.base import QuantizedLinear
from qlora_fsdp.quant.experts import replace_experts, router_gates

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    """Create parameters on meta but buffers (RoPE inv_freq) for real: buffers are computed, not loaded."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def meta_model(path: Path, *, dtype: torch.dtype, trust_remote_code: bool, attention: str = "sdpa") -> nn.Module:
    """The architecture from config.json with every parameter on meta (no memory, no init cost), attending with
    the `attention` implementation of transformers (sdpa; flash_attention_2 for packed rows where it runs)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        raise UserError(
            f"--model {path}: config.json is not a known architecture ({str(exc).splitlines()[0]})"
        ) from None
    config.use_cache = False
    auto_class = auto_model_class(config, where=str(path))
    with _params_on_meta():
        try:
            model = auto_class.from_config(
                config, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation=attention
            )
        except ValueError as exc:
            if attention == "eager" or "attention implementation" not in str(exc):
                raise
            # An architecture without sdpa (GPT-OSS, say) attends as transformers itself would load it: eagerly.
            log.warning("--model %s: %s attention is not supported by this architecture; using eager", path, attention)
            model = auto_class.from_config(
                config, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation="eager"
            )
    fix_latent_attention(model)
    if getattr(config, "tie_word_embeddings", False):
        # Tying inside _params_on_meta made two meta copies; one parameter with two owners, filled once.
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    return model


def transformers_model(model: nn.Module) -> nn.Module:
    """transformers' own model of `model`'s config on the meta device, as transformers builds it (routed experts
    fused, every linear plain, whatever this project made of them): what its checkpoint conversion reads shapes from,
    and what a user loads an adapter onto."""
    with torch.device("meta"):  # a copy: building writes its dtype and implementations into the config
        return type(model)._from_config(copy.deepcopy(model.config))


def decoder_layer_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The repeated block classes named by the model's `_no_split_modules` (not hard-coded to Llama)."""
    names = set(no_split_modules(model))
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise UserError(
            f"--model: architecture {type(model).__name__} declares no decoder layer class (_no_split_modules) "
            "that FSDP can wrap; use a causal LM from transformers such as Llama, Mistral or Qwen2"
        )
    return tuple(sorted(classes, key=lambda c: c.__name__))


def expanded_layer_prefixes(path: Path) -> tuple[str, ...]:
    """Module-name prefixes of the blocks scripts/block_expansion.py added (config.json `llama_pro_new_layers`)."""
    config = json.loads((path / "config.json").read_text())
    indices = config.get("llama_pro_new_layers")
    if not indices:
        raise UserError(
            f"--train_type llama_pro: {path} has no expanded blocks; run scripts/block_expansion.py --model {path} "
            "--output DIR and train DIR"
        )
    return tuple(f"model.layers.{i}." for i in indices)


@dataclass
class Skeleton:
    """The model on the meta device, its linears already swapped for quantized ones, and where weights go."""

    model: nn.Module
    path: Path
    files: list[Path]
    checkpoint_format: CheckpointFormat
    """How the checkpoint stores its tensors (config.json's `quantization_config`): the files are read through it."""
    layer_classes: tuple[type[nn.Module], ...]
    """Decoder layer classes: the FSDP wrapping and checkpointing unit, found from `_no_split_modules`."""
    units: dict[str, nn.Module]
    """Decoder layers by qualified name, in model order: each is filled, then handed on, as soon as it is whole."""
    quantized: list[str]
    """Qualified names of the linears the backend replaced."""
    head_name: str | None
    """Qualified name of the output head (never quantized)."""
    sources: dict[str, tuple[nn.Module, str]] = field(default_factory=dict)
    """Checkpoint tensor name -> (module, attribute) it fills, named before adapters rename anything."""
    reference: nn.Module | None = None
    """transformers' own model of the config, on meta (transformers_model): what its checkpoint conversion reads
    shapes from, and what a saved adapter is loaded onto."""


def build_skeleton(
    cfg: ModelConfig,
    *,
    backend: QuantBackend | None,
    param_dtype: torch.dtype,
    path: Path | None = None,
    full_precision_prefixes: tuple[str, ...] = (),
    attention: str = "sdpa",
    adapt_experts: bool = False,
    kept_experts: Callable[[nn.Linear], nn.Linear] | None = None,
    weights: bool = True,
) -> Skeleton:
    """The architecture from config.json on meta, with every linear but the head (and `full_precision_prefixes`)
    replaced by the backend's empty quantized layer, and routed experts by `kept_experts`'s where the checkpoint
    keeps its own quantization for them (its format's `kept_experts`). Nothing is read from the checkpoint yet;
    without `weights` (planning a model not downloaded) its weight files are not even looked for."""
    path = path or resolve_model_path(cfg.model)
    reader = checkpoint_format(path)
    files = reader.files(path, allow_pickle=cfg.allow_pickle) if weights else []
    model = meta_model(path, dtype=param_dtype, trust_remote_code=cfg.trust_remote_code, attention=attention)
    layer_classes = decoder_layer_classes(model)
    head = model.get_output_embeddings()
    head_name = next((n for n, m in model.named_modules() if m is head), None)
    parts = vision_parts(model)
    if parts is not None:  # an image-text model's vision tower and projector stay in full precision by default
        full_precision_prefixes += parts.unquantized(quantize_vision=cfg.quantize_vision)
    if backend is not None:
        # The output head stays in full precision: small next to the body and sensitive to quantization error; so
        # do the linears that choose (the gates that route tokens, the indexers that pick the keys attended to).
        kept = router_gates(model) | indexer_linears(model) | {head_name}
        backend.replace_linears(
            model, should_quantize=lambda n: n not in kept and not n.startswith(full_precision_prefixes)
        )
    if backend is not None or adapt_experts or kept_experts is not None:
        # Routed experts become one layer per expert: kept in the checkpoint's quantization, quantized like the
        # linears or, unquantized with adapters on them, plain frozen linears. Full fine-tuning without
        # quantization trains transformers' own fused module.
        replace_experts(model, kept_experts or (backend.make_module if backend is not None else _plain_linear))
    quantized = [n for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    # Quantized layers keep the checkpoint's names (weight, bias): their `weight` quantizes what arrives.
    sources = {n: _owner(model, n) for n, _ in model.named_parameters(remove_duplicate=False)}
    sources |= {n: _owner(model, n) for n, _ in model.named_buffers()}
    units = {n: m for n, m in model.named_modules() if isinstance(m, layer_classes)}
    reference = transformers_model(model)
    return Skeleton(model, path, files, reader, layer_classes, units, quantized, head_name, sources, reference)


def _plain_linear(linear: nn.Linear) -> nn.Linear:
    return linear


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    module_name, _, attr = name.rpartition(".")
    return model.get_submodule(module_name), attr
