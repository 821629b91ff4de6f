"""After training: answer prompts with what training produced, framed the way training framed its prompts.

The model is loaded as what its directory holds: a merged (or any plain) model; an export of export_quantized.py
(bnb through transformers' 4-bit loading, HQQ through HQQ's own loader); or, with --quant bnb|hqq (or an adapter
whose manifest says training quantized), the base quantized exactly as training quantized it, checked against the
manifest's digests. An adapter is then applied with PEFT.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from qlora_fsdp.checkpoint.manifest import intra_op_threads, read_manifest
from qlora_fsdp.config.options import TrainConfig, choices
from qlora_fsdp.data.formats import format_prompt, missing_prefix, special_prefix
from qlora_fsdp.data.images import ImageInputs, load_image_inputs, resolve_image
from qlora_fsdp.errors import UserError
from qlora_fsdp.model.attention import fix_latent_attention
from qlora_fsdp.model.formats import kept_experts_layer
from qlora_fsdp.model.hub import load_tokenizer, resolve_model_path
from qlora_fsdp.model.lora import load_saved_adapter
from qlora_fsdp.model.skeleton import build_skeleton
from qlora_fsdp.model.streaming import stream_weights
from qlora_fsdp.model.vision import auto_model_class
from qlora_fsdp.parallel.precision import PRECISIONS, quant_compute_dtype
from qlora_fsdp.quant.experts import QuantizedExperts
from qlora_fsdp.tools.config import GenerateConfig
from qlora_fsdp.tools.export import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    HQQ_WEIGHTS,
    check_adapter,
    read_adapter,
    training_backend,
    training_base,
)

EXIT_WORDS = ("exit", "quit")
EXPORT_KINDS = {"hqq": "hqq", "bitsandbytes": "bnb"}
"""_export_kind -> the --quant that writes it."""


def load_for_generation(cfg: TrainConfig, options: GenerateConfig) -> tuple[nn.Module, Any]:
    """(model in eval mode, tokenizer) for --model, with --adapter applied if given; a vision-language model is
    built by transformers' image-text class."""
    path = resolve_model_path(cfg.model.model)
    adapter = read_adapter(options.adapter) if options.adapter else None
    precision = PRECISIONS[cfg.fsdp.precision]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    exported = _export_kind(path)
    manifest = read_manifest(options.adapter) if options.adapter else None
    # An export of ours (or a pre-quantized bnb release) is the base as it was trained; FP8 and MXFP4 releases are
    # read through the checkpoint formats like any base.
    if exported in EXPORT_KINDS and manifest is not None and EXPORT_KINDS[exported] != manifest.flags["quant"]:
        raise UserError(
            f"--model {path} is quantized ({exported}) but the adapter was trained on a --quant "
            f"{manifest.flags['quant']} base; export that base with scripts/export_quantized.py --adapter "
            f"{options.adapter}, or pass the base model itself"
        )
    if exported in EXPORT_KINDS and manifest is None and cfg.quant.quant != "none":
        raise UserError(f"--model {path} is already quantized ({exported}); drop --quant {cfg.quant.quant}")
    if exported == "hqq":
        from hqq.models.hf.base import AutoHQQHFModel

        dtype = quant_compute_dtype(precision, cfg.quant.compute_dtype)
        model = AutoHQQHFModel.from_quantized(str(path), compute_dtype=dtype, device=str(device))
    elif exported in EXPORT_KINDS or cfg.quant.quant == "none":
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
        model = auto_model_class(config, where=str(path)).from_pretrained(
            path, dtype=precision.param_dtype, device_map=str(device), trust_remote_code=cfg.model.trust_remote_code
        )
    else:
        backend = training_backend(cfg.quant, cfg.fsdp.precision)
        dtype = quant_compute_dtype(precision, cfg.quant.compute_dtype)
        kept = kept_experts_layer(path, cfg.quant, storage_dtype=torch.uint8, compute_dtype=dtype)
        skeleton = build_skeleton(
            cfg.model, backend=backend, param_dtype=precision.param_dtype, path=path, kept_experts=kept
        )
        base = training_base(skeleton, backend, adapter=options.adapter, model_name=cfg.model.model)  # type: ignore[arg-type]
        # Quantized where training quantized (see training_base), then moved to where it generates.
        quantize_on = base.device if base.verify is not None else device
        with intra_op_threads(base.threads):
            stream_weights(skeleton, backend=backend, device=quantize_on)
        base.check({name: skeleton.model.get_submodule(name) for name in skeleton.quantized})
        model = skeleton.model.to(device)
    fix_latent_attention(model)  # padded prompts take the masked attention path (see qlora_fsdp/model/attention.py)
    if adapter is not None:
        from peft import PeftModel

        check_adapter(adapter, model, cfg.model.model)
        if any(isinstance(m, QuantizedExperts) for m in model.modules()):
            config = json.loads((adapter.path / ADAPTER_CONFIG).read_text())
            model = load_saved_adapter(model, adapter.path / ADAPTER_WEIGHTS, config, dtype=precision.param_dtype)
        else:
            model = PeftModel.from_pretrained(model, str(adapter.path))
    return model.eval(), load_tokenizer(path)


def _export_kind(path: Path) -> str:
    """'hqq' or 'bnb' for a directory export_quantized.py wrote (or any pre-quantized checkpoint), else ''."""
    if (path / HQQ_WEIGHTS).is_file():
        return "hqq"
    quantization = json.loads((path / "config.json").read_text()).get("quantization_config")
    return str(quantization.get("quant_method", "quantized")) if quantization else ""


def prompt_text(tokenizer: Any, history: list[dict[str, Any]], style: str) -> str:
    """The text the model continues: the last user turn in the training prompt style, or the whole conversation
    through the tokenizer's chat template (always, when a turn holds an image)."""
    if style == "chat_template" or any(not isinstance(turn["content"], str) for turn in history):
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("--prompt_style chat_template: this tokenizer has no chat template; pick another style")
        return tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    last = history[-1]["content"]
    return format_prompt(last, prompt_style=style) if style in choices("prompt_style") else last


@torch.no_grad()
def answer(model: nn.Module, tokenizer: Any, text: str, options: GenerateConfig, image: Image | None = None) -> str:
    """The model's continuation of `text`, up to its end-of-sequence token or --max_new_tokens; `image`: the image
    `text`'s placeholder stands for, made into tokens and pixels as training makes them."""
    from transformers import GenerationConfig

    # Tokenized as training tokenizes a sequence: the tokenizer's BOS (where it adds one) once, unless the chat
    # template already wrote it.
    if image is not None:
        text, _, _, _ = image.inputs.expand_text(text, [], [image.path], "--image")
    tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
    tokens = [*missing_prefix(tokens, special_prefix(tokenizer)), *tokens]
    ids = {"input_ids": torch.tensor([tokens]), "attention_mask": torch.ones(1, len(tokens), dtype=torch.long)}
    if image is not None:
        ids |= image.inputs.batch_inputs(ids["input_ids"], [[image.path]])
    device = next(model.parameters()).device
    sampling = {"temperature": options.temperature, "top_p": options.top_p, "top_k": options.top_k}
    generation = GenerationConfig(
        max_new_tokens=options.max_new_tokens,
        do_sample=options.do_sample,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
        **(sampling if options.do_sample else {}),
    )
    if options.do_sample:
        torch.manual_seed(options.seed)
    ids = {k: v.to(device) for k, v in ids.items()}
    out = model.generate(**ids, generation_config=generation)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def run_generate(
    cfg: TrainConfig, options: GenerateConfig, *, stdin: TextIO | None = None, stdout: TextIO | None = None
) -> None:
    """--prompt: print one answer. --chat: answer each line of `stdin` until its end or 'exit'."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    image = _image(cfg, options)
    model, tokenizer = load_for_generation(cfg, options)
    if not options.chat:
        text = prompt_text(tokenizer, [_user(options.prompt, image)], options.prompt_style)
        print(answer(model, tokenizer, text, options, image), file=stdout)
        return
    history: list[dict[str, Any]] = []
    for line in _lines(stdin, stdout):
        # Only the chat template frames a conversation; the training styles frame one instruction at a time. The
        # image goes with the first question.
        framed = options.prompt_style == "chat_template" or image is not None
        history = [*history, _user(line, image if not history else None)] if framed else [_user(line)]
        reply = answer(model, tokenizer, prompt_text(tokenizer, history, options.prompt_style), options, image)
        history.append({"role": "assistant", "content": reply})
        print(reply, file=stdout, flush=True)


@dataclass(frozen=True)
class Image:
    """--image: its path and the model's processor."""

    path: str
    inputs: ImageInputs


def _image(cfg: TrainConfig, options: GenerateConfig) -> Image | None:
    """--image, checked before the model loads: a readable image, and a model with an image processor."""
    if not options.image:
        return None
    path = resolve_image(options.image, root=Path.cwd(), where="--image")
    inputs = load_image_inputs(resolve_model_path(cfg.model.model), trust_remote_code=cfg.model.trust_remote_code)
    if inputs is None:
        raise UserError(f"--image: --model {cfg.model.model} has no image processor (a text-only model); drop --image")
    return Image(path, inputs)


def _user(text: str, image: Image | None = None) -> dict[str, Any]:
    if image is None:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}


def _lines(stdin: TextIO, stdout: TextIO) -> Iterable[str]:
    """Non-empty input lines, with a '> ' prompt when a person is typing."""
    interactive = stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line or line.strip().lower() in EXIT_WORDS:
            return
        if line.strip():
            yield line.strip()
