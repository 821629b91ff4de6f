"""Build a tiny, randomly initialised Hugging Face causal LM directory for tests and benchmarks.

The point is to exercise the *real* loading path (config.json, sharded safetensors with an
index, a fast tokenizer) without downloading anything: the output reloads with
`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` offline. Everything
is derived from the seed and the bundled dataset, so the same arguments give byte-identical
files, which keeps test fixtures and benchmark baselines stable.

Usage:
    python scripts/make_tiny_model.py --output DIR [--arch llama|mistral|qwen2] [--seed 0]
        [--hidden_size 128] [--num_layers 2] [--intermediate_size 256] [--num_heads 4]
        [--num_kv_heads 2] [--vocab_size 512] [--num_shards 2] [--tie_word_embeddings false]
        [--data data/alpaca_tiny.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # heavy imports are deferred so argument errors are reported instantly
    import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO_ROOT / "data" / "alpaca_tiny.jsonl"
ARCHS = ("llama", "mistral", "qwen2")

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, BOS_TOKEN)  # ids 0, 1, 2 in this order
BYTE_ALPHABET = 256
MAX_POSITIONS = 2048

# The standard Alpaca prompt templates; the tokenizer sees them so that prompt words get merges.
PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


def validate_sizes(
    *,
    arch: str,
    hidden_size: int,
    num_layers: int,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    vocab_size: int,
    num_shards: int,
    tie_word_embeddings: bool,
) -> None:
    """Reject shapes that HF cannot build; raises ValueError with one line. Any layer width quantizes: the
    loader pads what does not split into whole 4-bit blocks or HQQ groups."""
    if arch not in ARCHS:
        raise ValueError(f"--arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    for name, value in (
        ("hidden_size", hidden_size),
        ("num_layers", num_layers),
        ("intermediate_size", intermediate_size),
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("vocab_size", vocab_size),
        ("num_shards", num_shards),
    ):
        if value < 1:
            raise ValueError(f"--{name} must be >= 1, got {value}")
    if hidden_size % num_heads:
        raise ValueError(f"--hidden_size {hidden_size} must be divisible by --num_heads {num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"--num_heads {num_heads} must be divisible by --num_kv_heads {num_kv_heads}")
    head_dim = hidden_size // num_heads
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} (hidden_size / num_heads) must be even for rotary embeddings")
    min_vocab = BYTE_ALPHABET + len(SPECIAL_TOKENS)
    if vocab_size < min_vocab:
        raise ValueError(f"--vocab_size must be >= {min_vocab} (byte alphabet + special tokens), got {vocab_size}")
    # Tensors: embed + final norm + 9 per layer (+ lm_head, + 3 q/k/v biases for qwen2).
    n_tensors = 2 + num_layers * (9 + (3 if arch == "qwen2" else 0)) + (0 if tie_word_embeddings else 1)
    if num_shards > n_tensors:
        raise ValueError(f"--num_shards {num_shards} exceeds the number of tensors ({n_tensors})")


def read_rows(data_path: Path) -> list[dict[str, str]]:
    """Load the Alpaca JSONL used as tokenizer training text."""
    if not data_path.is_file():
        raise FileNotFoundError(f"dataset not found: {data_path} (generate it with scripts/make_dataset.py)")
    with open(data_path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def tokenizer_corpus(rows: list[dict[str, str]]) -> Iterator[str]:
    """Yield the text the tokenizer learns from: each row rendered with the Alpaca template.

    Rendering the full prompt (rather than bare fields) means the template words are weighted
    by how often the model will actually see them, and keeps the order fixed for determinism.
    """
    for row in rows:
        template = PROMPT_WITH_INPUT if row.get("input") else PROMPT_NO_INPUT
        yield template.format(instruction=row["instruction"], input=row.get("input", "")) + row["output"]


def train_tokenizer(rows: list[dict[str, str]], vocab_size: int):  # -> PreTrainedTokenizerFast
    """Train a byte-level BPE on the dataset and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte stays encodable
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_corpus(rows), trainer=trainer)
    if tok.get_vocab_size() > vocab_size:
        raise RuntimeError(f"trained tokenizer has {tok.get_vocab_size()} tokens > vocab_size {vocab_size}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        model_max_length=MAX_POSITIONS,
    )


def make_config(arch: str, **kw):  # -> PretrainedConfig
    """Instantiate the HF config class for `arch` with the shared tiny-model settings."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[arch]
    cfg = cls(max_position_embeddings=MAX_POSITIONS, initializer_range=0.02, dtype="float32", **kw)
    cfg.architectures = [
        {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    ]
    return cfg


def split_into_shards(sizes: list[int], num_shards: int) -> list[int]:
    """Assign consecutive tensors to shards of roughly equal bytes, never leaving a shard empty.

    Returns the shard index of each tensor. Keeping the HF state-dict order (rather than bin
    packing) mirrors how HF shards, so a layer's tensors mostly land in the same file.
    """
    n, total = len(sizes), sum(sizes)
    if not 1 <= num_shards <= n:
        raise ValueError(f"cannot split {n} tensors into {num_shards} non-empty shards")
    out: list[int] = []
    cum, prev = 0, -1
    for i, size in enumerate(sizes):
        # Shard by the tensor's byte midpoint, then clamp: no going back, no skipping a shard
        # (so the first tensor lands in shard 0), and leave one tensor per remaining shard.
        target = min(int((cum + size / 2) * num_shards / max(total, 1)), num_shards - 1)
        lo = max(prev, num_shards - n + i, 0)
        prev = max(lo, min(target, prev + 1))
        out.append(prev)
        cum += size
    return out


def _umask() -> int:
    """Current process umask (reading it requires setting it, so set it straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_shards(state: dict[str, torch.Tensor], output: Path, num_shards: int) -> dict[str, int]:
    """Write HF-style `model-0000i-of-0000n.safetensors` files plus `model.safetensors.index.json`."""
    from safetensors.torch import save_file

    names = list(state)
    sizes = [state[k].numel() * state[k].element_size() for k in names]
    assignment = split_into_shards(sizes, num_shards)
    files = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    weight_map: dict[str, str] = {}
    shard_bytes: dict[str, int] = {}
    for s, fname in enumerate(files):
        part = {k: state[k] for k, a in zip(names, assignment, strict=True) if a == s}
        save_file(part, str(output / fname), metadata={"format": "pt"})
        # safetensors creates files 0600; match the other files (umask) so shared checkouts can read them.
        (output / fname).chmod(0o666 & ~_umask())
        weight_map.update(dict.fromkeys(part, fname))
        shard_bytes[fname] = sum(t.numel() * t.element_size() for t in part.values())
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": dict(sorted(weight_map.items()))}
    (output / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return shard_bytes


def build_tiny_model(
    output: str | Path,
    *,
    arch: str = "llama",
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    intermediate_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 512,
    num_shards: int = 2,
    tie_word_embeddings: bool = False,
    data_path: str | Path = DEFAULT_DATA,
    verbose: bool = False,
) -> Path:
    """Write a tiny random HF causal LM (config, sharded safetensors, tokenizer) to `output`.

    Raises ValueError for shapes HF cannot build. Returns the output path.
    """
    validate_sizes(
        arch=arch,
        hidden_size=hidden_size,
        num_layers=num_layers,
        intermediate_size=intermediate_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        vocab_size=vocab_size,
        num_shards=num_shards,
        tie_word_embeddings=tie_word_embeddings,
    )
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer(read_rows(Path(data_path)), vocab_size)
    config = make_config(
        arch,
        vocab_size=vocab_size,  # may exceed len(tokenizer); spare rows are never indexed
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )

    # Seed right before construction so the weights depend only on the seed and the shapes.
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()

    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if tie_word_embeddings and name == "lm_head.weight":
            continue  # HF omits the tied head from checkpoints; it is re-tied on load
        state[name] = tensor.detach().to(torch.float32).contiguous().clone()

    for stale in output.glob("model*.safetensors*"):  # a previous build may have had more shards
        stale.unlink()
    shard_bytes = write_shards(state, output, num_shards)
    config.save_pretrained(output)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(output)
    tokenizer.save_pretrained(output)

    if verbose:
        n_params = sum(t.numel() for t in state.values())
        shards = ", ".join(f"{k}: {v} B" for k, v in shard_bytes.items())
        print(f"{output}: {arch}, {n_params:,} parameters, tokenizer {len(tokenizer)}/{vocab_size} tokens; {shards}")
    return output


def _str2bool(text: str) -> bool:
    """argparse helper: accept true/false style flags explicitly."""
    low = text.lower()
    if low in ("1", "true", "yes", "y", "on"):
        return True
    if low in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns a process exit code (2 with a one-line error on bad sizes)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True, type=Path, help="model directory to write")
    p.add_argument("--arch", default="llama", choices=ARCHS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden_size", type=int, default=128)
    p.add_argument("--num_layers", type=int, default=2)
    p.add_argument("--intermediate_size", type=int, default=256)
    p.add_argument("--num_heads", type=int, default=4)
    p.add_argument("--num_kv_heads", type=int, default=2)
    p.add_argument("--vocab_size", type=int, default=512)
    p.add_argument("--num_shards", type=int, default=2)
    p.add_argument("--tie_word_embeddings", type=_str2bool, default=False, metavar="{true,false}")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="Alpaca JSONL for tokenizer training")
    args = p.parse_args(argv)

    start = time.perf_counter()
    try:
        build_tiny_model(
            args.output,
            arch=args.arch,
            seed=args.seed,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            intermediate_size=args.intermediate_size,
            num_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads,
            vocab_size=args.vocab_size,
            num_shards=args.num_shards,
            tie_word_embeddings=args.tie_word_embeddings,
            data_path=args.data,
            verbose=True,
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"done in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
