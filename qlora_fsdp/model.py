"""Model loading: skeleton on meta, stream safetensors shards one at a time, quantize each linear as it arrives.

Peak host memory is about one tensor plus the quantized model on rank 0 (and one tensor on the other ranks with
`--low_memory`), never the full-precision model.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from qlora_fsdp.config import ModelConfig
from qlora_fsdp.distributed import DistEnv
from qlora_fsdp.errors import UserError
from qlora_fsdp.quant import QuantBackend

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_INDEX = "pytorch_model.bin.index.json"
PICKLE_FILE = "pytorch_model.bin"


@dataclass
class LoadedModel:
    model: nn.Module
    path: Path
    layer_classes: tuple[type[nn.Module], ...]
    """Decoder layer classes: the FSDP wrapping and checkpointing unit, found from `_no_split_modules`."""
    quantized: list[str]
    """Qualified names of the linears the backend replaced."""


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or name.count("/") != 1 or (os.sep == "\\" and "\\" in name)


def resolve_model_path(name: str) -> Path:
    """A local directory as is; a hub id downloaded (config, tokenizer and safetensors only) to the HF cache."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"--model {name}: directory has no config.json; point --model at a Hugging Face model dir")
        return path
    if path.exists() or _looks_like_path(name):
        raise UserError(f"--model {name}: no such model directory; pass a local model directory or a hub id (org/name)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"]))
    except Exception as exc:  # offline, unknown repo, gated: the same advice for each
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(
            f"--model {name}: not a local directory and the Hugging Face hub could not provide it ({reason}); "
            "download it beforehand and pass the local directory"
        ) from None


def shard_files(path: Path, *, allow_pickle: bool = False) -> list[Path]:
    """The weight files of a model directory in index order; every listed shard must exist.

    safetensors only, unless `allow_pickle`: a pickle (.bin) checkpoint can run code when loaded.
    """
    for index_name, single, pickled in ((INDEX_FILE, SINGLE_FILE, False), (PICKLE_INDEX, PICKLE_FILE, True)):
        index = path / index_name
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (path / single).is_file():
            files = [single]
        else:
            continue
        if pickled and not allow_pickle:
            raise UserError(
                f"--model {path}: only pickle weights ({files[0]}), which can run code when loaded; convert them to "
                "safetensors or pass --allow_pickle true (they are then loaded with torch.load(weights_only=True))"
            )
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise UserError(f"--model {path}: shard {missing[0]} is listed in {index_name} but missing; re-download it")
        return [path / f for f in files]
    raise UserError(f"--model {path}: no {INDEX_FILE} or {SINGLE_FILE}; the model directory has no weights")


def _read_tensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) one at a time: safetensors lazily from disk; pickle only with weights_only, memory-mapped."""
    if file.suffix == ".safetensors":
        with safe_open(file, framework="pt", device="cpu") as shard:
            for name in shard.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, shard.get_tensor(name)
    else:
        yield from torch.load(file, map_location="cpu", weights_only=True, mmap=True).items()


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


def build_skeleton(path: Path, *, dtype: torch.dtype, trust_remote_code: bool) -> nn.Module:
    """The architecture from config.json with every parameter on meta (no memory, no init cost)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        raise UserError(
            f"--model {path}: config.json is not a known architecture ({str(exc).splitlines()[0]})"
        ) from None
    config.use_cache = False
    with _params_on_meta():
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation="sdpa"
        )
    return model


def decoder_layer_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The repeated block classes named by the model's `_no_split_modules` (not hard-coded to Llama)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise UserError(
            f"--model: architecture {type(model).__name__} declares no decoder layer class (_no_split_modules) "
            "that FSDP can wrap; use a causal LM from transformers such as Llama, Mistral or Qwen2"
        )
    return tuple(sorted(classes, key=lambda c: c.__name__))


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[attr] = value


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


def load_model(
    cfg: ModelConfig,
    *,
    backend: QuantBackend | None,
    env: DistEnv,
    param_dtype: torch.dtype,
    path: Path | None = None,
    full_precision_prefixes: tuple[str, ...] = (),
) -> LoadedModel:
    """Build the skeleton, quantize target linears, and stream the checkpoint in.

    With `cfg.low_memory`, only rank 0 keeps real tensors (on CPU); other ranks keep meta tensors and receive the
    values from the per-unit broadcast in fsdp.wrap_model. Every rank quantizes each weight itself, so quantization
    state (which FSDP does not broadcast) exists, identical, everywhere.
    """
    path = path or resolve_model_path(cfg.model)
    files = shard_files(path, allow_pickle=cfg.allow_pickle)
    model = build_skeleton(path, dtype=param_dtype, trust_remote_code=cfg.trust_remote_code)
    layer_classes = decoder_layer_classes(model)
    # Names as the checkpoint has them, before quantized modules rename their parameters (HQQ's W_q).
    expected = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    quantized = []
    if backend is not None:
        # The output head stays in full precision: small next to the body and sensitive to quantization error.
        head = model.get_output_embeddings()
        head_name = next((n for n, m in model.named_modules() if m is head), None)
        quantized = backend.replace_linears(
            model,
            should_quantize=lambda n: n != head_name and not n.startswith(full_precision_prefixes),
            device=env.device,
        )
    keep = env.is_main or not cfg.low_memory
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    for file in files:
        for name, tensor in _read_tensors(file):
            module_name, _, attr = name.rpartition(".")
            module = modules.get(module_name)
            if module is None or (name not in expected and attr not in module._buffers):
                log.warning("ignoring checkpoint tensor %s: no such parameter in the model", name)
                continue
            if backend is not None and backend.is_quantized(module) and attr == "weight":
                backend.load_weight(module, tensor, device=env.device, keep=keep)
            else:
                value = tensor.to(param_dtype) if tensor.is_floating_point() else tensor
                _set_tensor(model, name, value if keep else torch.empty_like(value, device="meta"))
            loaded.add(name)
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" not in loaded:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
        loaded.add("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing:
        raise UserError(
            f"--model {path}: checkpoint lacks {len(missing)} tensor(s), e.g. {missing[0]}; is it complete?"
        )
    return LoadedModel(model=model, path=path, layer_classes=layer_classes, quantized=quantized)


def load_tokenizer(path: Path):
    """The model's tokenizer; one without a pad token pads with eos (labels mask the padding anyway)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
