"""Random mixture-of-experts models built by transformers' own classes and written by its own `save_pretrained`
(so the checkpoint has the per-expert layout transformers writes), with the tiny Llama's tokenizer beside them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
"""Built for every parametrized MoE test (the `moe_models` fixture)."""
MORE_FAMILIES = ("phimoe", "deepseek_v2", "olmoe", "deepseek_v3")
TRANSPOSED = ("gpt_oss", "llama4")
"""Experts stored transposed ([experts, in, out]): gpt-oss's with biases, gate and up interleaved, a clamped SwiGLU,
attention sinks and a router with a bias; Llama 4's with a shared expert and a sigmoid top-1 router that hands every
expert every token, scaled."""
"""Built only by the tests that name them, which keeps the parametrized suites' cost: PhiMoE (its router an
nn.Linear subclass returning a tuple), DeepSeek-V2 (latent attention with shared experts), OLMoE, DeepSeek-V3
(V2's layout with a sigmoid group-limited router; the FP8 release's architecture)."""


def moe_config(family: str, *, vocab_size: int, hidden: int = 64, layers: int = 2, experts: int = 8, top_k: int = 2,
               intermediate: int = 256, **extra):  # fmt: skip
    """A config of `family`; Qwen2-MoE gets a shared expert (and its gate), Qwen3-MoE none; DeepSeek-V2 a dense
    first layer, a shared expert and latent attention; PhiMoE routes to 2 experts whatever `top_k` says."""
    from transformers import (
        DeepseekV2Config,
        DeepseekV3Config,
        GptOssConfig,
        Llama4TextConfig,
        MixtralConfig,
        OlmoeConfig,
        PhimoeConfig,
        Qwen2MoeConfig,
        Qwen3MoeConfig,
    )

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
    if family == "phimoe":
        # No jitter: the routing is then sparsemixer's alone (its Gumbel sampling while training).
        return PhimoeConfig(
            **common, intermediate_size=intermediate, num_local_experts=experts, router_jitter_noise=0.0
        )
    if family == "olmoe":
        return OlmoeConfig(**common, intermediate_size=intermediate, num_experts=experts)
    if family in ("deepseek_v2", "deepseek_v3"):
        head = hidden // 4
        # V3's attention computes with as many key/value heads as the config says (the release: all of them).
        groups = {"n_group": 2, "topk_group": 1, "num_key_value_heads": 4} if family == "deepseek_v3" else {}
        return (DeepseekV2Config if family == "deepseek_v2" else DeepseekV3Config)(
            **(common | groups),
            intermediate_size=intermediate,
            moe_intermediate_size=intermediate,
            n_routed_experts=experts,
            n_shared_experts=1,
            first_k_dense_replace=1,
            q_lora_rank=None,
            kv_lora_rank=hidden // 2,
            qk_nope_head_dim=head // 2,
            qk_rope_head_dim=head // 2,
            head_dim=head // 2,
            v_head_dim=head,
        )
    if family == "gpt_oss":
        return GptOssConfig(
            **common, intermediate_size=intermediate // 2, num_local_experts=experts, head_dim=hidden // 4,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2), sliding_window=8,
        )  # fmt: skip
    if family == "llama4":
        return Llama4TextConfig(
            **(common | {"num_experts_per_tok": 1}), intermediate_size=intermediate // 2, num_local_experts=experts,
            intermediate_size_mlp=intermediate, head_dim=hidden // 4, interleave_moe_layer_step=1,
        )  # fmt: skip
    raise ValueError(f"unknown family {family}")


def build_moe_model(family: str, out: Path, *, tokenizer_from: Path, seed: int = 0, **sizes) -> Path:
    """Save a random `family` model (transformers' own initialisation) to `out` with `tokenizer_from`'s tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    vocab_size = json.loads((tokenizer_from / "config.json").read_text())["vocab_size"]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    ids = {f"{t}_token_id": getattr(tokenizer, f"{t}_token_id") for t in ("bos", "eos", "pad")}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(family, vocab_size=vocab_size, **ids, **sizes))
    with torch.no_grad():  # biases transformers initialises to zero: random, so a misplaced one shows
        for name, param in model.named_parameters():
            if name.endswith("_bias") or name.endswith("router.bias") or name.endswith("sinks"):
                param.normal_(0, 0.5)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, out / name)
    return out
