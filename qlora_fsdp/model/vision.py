"""Image-text models: which transformers class builds a checkpoint, and which of its parts is the language model.

An image-text model (Qwen2-VL, LLaVA, ...) is a vision tower, a projector into the language model's embeddings and
a causal language model. Only the language model is quantized and adapted by default, as axolotl and Unsloth do: the
vision tower and projector stay frozen in full precision unless the flags name them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch import nn

from qlora_fsdp.errors import UserError


def is_image_text(config: Any) -> bool:
    """Whether transformers builds this config as an image-text-to-text model (it has a vision part)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return getattr(config, "vision_config", None) is not None and (
        config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    )


def auto_model_class(config: Any, *, where: str) -> Any:
    """transformers' auto class for this config: image-text-to-text for a VLM, else causal LM. A config that is
    neither (and brings no code of its own) is refused in one line naming its class."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if is_image_text(config):
        return AutoModelForImageTextToText
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not getattr(config, "auto_map", None):
        raise UserError(
            f"--model {where}: {type(config).__name__} is neither a causal language model nor an image-text model "
            "that transformers builds; use a causal LM (Llama, Qwen2, ...) or a VLM (Qwen2-VL, LLaVA, ...)"
        )
    return AutoModelForCausalLM


@dataclass(frozen=True)
class VisionParts:
    """Qualified module names of an image-text model's parts (on the transformers model, before adapters)."""

    language: str
    """The language model (`model.language_model`): quantized and adapted like a causal LM's body."""
    tower: tuple[str, ...]
    """The vision encoder(s): full precision and frozen unless --quantize_vision / --lora_target_modules name them."""
    projector: tuple[str, ...]
    """What maps image features into the language model's embeddings: full precision, frozen unless named."""

    def unquantized(self, *, quantize_vision: bool) -> tuple[str, ...]:
        """Module-name prefixes whose linears keep their full-precision weights."""
        return tuple(f"{n}." for n in (self.projector if quantize_vision else (*self.tower, *self.projector)))


def vision_parts(model: nn.Module) -> VisionParts | None:
    """The parts of an image-text model (None for a causal LM): the children of its base model other than the
    language model, a child named for vision (`visual`, `vision_tower`, `vision_model`) being the tower."""
    if not is_image_text(model.config):
        return None
    names = {m: n for n, m in model.named_modules()}
    decoder = model.get_decoder()
    base = model.base_model
    others = [names[child] for child in base.children() if child is not decoder and names.get(child)]
    tower = tuple(n for n in others if re.search(r"vision|visual", n.rpartition(".")[2]))
    return VisionParts(names[decoder], tower, tuple(n for n in others if n not in tower))


def hidden_states_model(lm: nn.Module) -> nn.Module:
    """What returns the last hidden states for the chunked loss: an image-text model's base model (it takes the
    images), else the decoder."""
    inner = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    if is_image_text(inner.config):
        return inner.base_model
    decoder = lm.get_decoder()
    # Llama 4's causal LM names its base model `language_model` but holds it as `model`: transformers' lookup then
    # returns the causal LM itself.
    return inner.model if decoder is inner and hasattr(inner, "model") else decoder


def split_vision_targets(spec: str, parts: VisionParts | None, model: nn.Module) -> tuple[str, list[str], str | None]:
    """--lora_target_modules on an image-text model: (the spec for the language model, the qualified names of every
    linear in the vision parts it names, a regex of the parts it does not name for PEFT's `exclude_modules`).

    A part is named by its attribute (`visual`, `vision_tower`, `multi_modal_projector`) or qualified name; the
    other names (and `all`) apply to the language model only, so a vision block's `q_proj` or `fc1` is not adapted
    by a name the language model shares with it."""
    if parts is None:
        return spec, [], None
    names = [n.strip() for n in spec.split(",") if n.strip()]
    every = (*parts.tower, *parts.projector)
    named = [p for p in every if p in names or p.rpartition(".")[2] in names]
    rest = [n for n in names if n not in named and n not in {p.rpartition(".")[2] for p in named}]
    linears = [
        n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith(tuple(f"{p}." for p in named))
    ]
    unnamed = [p for p in every if p not in named]
    exclude = rf"({'|'.join(map(re.escape, unnamed))})(\..*)?" if unnamed else None
    return ",".join(rest), linears, exclude
