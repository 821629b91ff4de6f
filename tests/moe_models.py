"""Random mixture-of-experts models built by transformers' own classes and written by its own `save_pretrained`
(so the checkpoint has the per-expert layout transformers writes), with the tiny Llama's tokenizer beside them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


def moe_config(family: str, *, vocab_size: int, hidden: int = 64, layers: int = 2, experts: int = 8, top_k: int = 2,
               intermediate: int = 256, **extra):  # fmt: skip
    """A config of `family`; Qwen2-MoE gets a shared expert (and its gate), Qwen3-MoE none."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=top_k,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    common.update(extra)
    if family == "mixtral":
        return MixtralConfig(**common, intermediate_size=intermediate, num_local_experts=experts)
    if family == "qwen2_moe":
        return Qwen2MoeConfig(
            **common,
            intermediate_size=intermediate,
            moe_intermediate_size=intermediate,
            shared_expert_intermediate_size=intermediate,
            num_experts=experts,
            decoder_sparse_step=1,
        )
    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            **common,
            intermediate_size=intermediate,
            moe_intermediate_size=intermediate,
            num_experts=experts,
            head_dim=hidden // 4,
        )
    raise ValueError(f"unknown family {family}")


def build_moe_model(family: str, out: Path, *, tokenizer_from: Path, seed: int = 0, **sizes) -> Path:
    """Save a random `family` model (transformers' own initialisation) to `out` with `tokenizer_from`'s tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    vocab_size = json.loads((tokenizer_from / "config.json").read_text())["vocab_size"]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    ids = {f"{t}_token_id": getattr(tokenizer, f"{t}_token_id") for t in ("bos", "eos", "pad")}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(family, vocab_size=vocab_size, **ids, **sizes))
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, out / name)
    return out
