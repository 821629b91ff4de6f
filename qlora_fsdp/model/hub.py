"""The model directory: where it is (a local directory or a hub download), which weight files it holds, its
tokenizer, and a digest that tells it from another model."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from qlora_fsdp.errors import UserError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_INDEX = "pytorch_model.bin.index.json"
PICKLE_FILE = "pytorch_model.bin"


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or name.count("/") != 1 or (os.sep == "\\" and "\\" in name)


def resolve_model_path(name: str, *, weights: bool = True) -> Path:
    """A local directory as is; a hub id downloaded (config, tokenizer and safetensors only; without `weights`, its
    JSON files alone) to the HF cache."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"--model {name}: directory has no config.json; point --model at a Hugging Face model dir")
        return path
    if path.exists() or _looks_like_path(name):
        raise UserError(f"--model {name}: no such model directory; pass a local model directory or a hub id (org/name)")
    from huggingface_hub import snapshot_download

    try:
        patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model"] if weights else ["*.json"]
        return Path(snapshot_download(name, allow_patterns=patterns))
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


def load_tokenizer(path: Path):
    """The model's tokenizer; one without a pad token pads with eos (labels mask the padding anyway)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:  # transformers' message runs to many lines; its first names the problem
        raise UserError(
            f"--model {path}: no tokenizer transformers can load there ({str(exc).strip().splitlines()[0]}); copy "
            "the base model's tokenizer files (tokenizer.json, tokenizer_config.json) into it"
        ) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def model_identity(path: Path) -> str:
    """A short digest of a model directory's config.json and the start of each weight file.

    It tells another base model (even one with the same architecture) from this one, whatever the directory is
    called now, without reading the weights.
    """
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        with open(file, "rb") as fh:
            digest.update(fh.read(1 << 16))
        digest.update(str(file.stat().st_size).encode())
    return f"config and weights {digest.hexdigest()[:16]}"
