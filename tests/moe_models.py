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
"""Built only by the tests that name them, which keeps the parametrized suites' cost: PhiMoE (its router an
nn.Linear subclass returning a tuple), DeepSeek-V2 (latent attention with shared experts), OLMoE, DeepSeek-V3
(V2's layout with a sigmoid group-limited router; the FP8 release's architecture)."""
TRANSPOSED = ("gpt_oss", "llama4")
"""Experts stored transposed ([experts, in, out]): gpt-oss's with biases, gate and up interleaved, a clamped SwiGLU,
attention sinks and a router with a bias; Llama 4's with a shared expert and a sigmoid top-1 router that hands every
expert every token, scaled."""


MATRIX: dict[str, tuple[str, str, dict]] = {
    "mixtral": ("mixtral", "bnb", {}),
    "qwen2_moe": ("qwen2_moe", "bnb", {}),
    "qwen3_moe": ("qwen3_moe", "hqq", {}),
    "qwen3_5_moe": ("qwen3_5_moe", "bnb", {}),
    "qwen3_next": ("qwen3_next", "bnb", {}),
    "deepseek_v2": ("deepseek_v2", "bnb", {}),
    # Every layer routed, the shared expert beside the experts in each (the shape once caught by PEFT's rewrite).
    "deepseek_v2-all-moe": ("deepseek_v2", "bnb", {"first_k_dense_replace": 0}),
    "deepseek_v3": ("deepseek_v3", "bnb", {}),
    "deepseek_v32": ("deepseek_v32", "bnb", {}),
    "deepseek_v4": ("deepseek_v4", "bnb", {}),
    "glm4_moe": ("glm4_moe", "bnb", {}),
    "glm4_moe_lite": ("glm4_moe_lite", "bnb", {}),
    "glm_moe_dsa": ("glm_moe_dsa", "bnb", {}),
    "gpt_oss": ("gpt_oss", "bnb", {}),
    "llama4": ("llama4", "hqq", {}),
    "minimax_m2": ("minimax_m2", "bnb", {}),
    "olmoe": ("olmoe", "bnb", {}),
    "phimoe": ("phimoe", "bnb", {}),
    "phimoe-hqq": ("phimoe", "hqq", {}),
    # Families with no settings of their own here: transformers' default config, shrunk (shrunk_config).
    **{f: (f, "bnb", {}) for f in (
        "afmoe", "aria_text", "axk2", "beam", "cohere2_moe", "ernie4_5_moe", "exaone_moe", "flex_olmo", "flint",
        "gemma4_text", "granitemoe", "granitemoe_swa", "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "hy_v4",
        "kimi_linear", "kolibri1", "lara_mini", "mellum", "mimo_v2_flash", "minicpm5_moe", "minimax",
        "minimax_m3_vl_text", "solar_open",
    )},
}
"""The MoE matrix (tests/distributed/test_moe_matrix.py): row id -> (family, --quant, settings over moe_config's),
one 2-rank launch each."""


PEFT_RENAMES = "PEFT 0.22 applies transformers' checkpoint renamings to the adapter's keys when loading it, and "
_IMAGE_TEXT = "an image-text model; its text model is the row"
NOT_IN_MATRIX = {
    "ergo": "refused in one line before any weight is read: ungated experts (has_gate=False), as NemotronH's",
    "jetmoe": "refused in one line before any weight is read: its experts (JetMoeParallelExperts, one 3-D weight "
    "called with its own gating) are a layout this loader does not split per expert",
    "doge": "its routed experts are embedding vectors (CDMoE), not projections: nothing per expert to quantize or "
    "adapt, and its `router_gate`, found by no fused experts beside it, is quantized and adapted like any linear",
    "dbrx": "its experts are 2-D stacked parameters (DbrxExpertGLU's w1, v1, w2), not linears: they would stay in "
    "full precision; and no tiny configuration written yet (its attention settings are a config of their own)",
    "nemotron_h": "refused in one line before any weight is read: ungated experts (has_gate=False)",
    "laguna": PEFT_RENAMES + "`mlp.shared_expert.` (an unescaped regex) also matches `mlp.shared_experts.`, so "
    "PEFT's own round trip breaks the shared experts' keys (`mlp.shared_experts..gate_proj`)",
    "inkling2_text": PEFT_RENAMES + "`sconv.weight_proj` becomes `sconv.weight_proj.weight` there: its short "
    "convolutions' adapters load as missing keys",
    "inkling2_loop_text": "as inkling2_text",
    "inkling_text": "trains, and PEFT loads the adapter with training's keys and values, but the 2 ranks' final eval "
    "loss (5.83) is not what the reloaded adapter gives (6.22): not understood yet, so not claimed",
    "axk1": "no tiny configuration built here runs in transformers' own forward yet (its attention's head "
    "bookkeeping)",
    "bailing_hybrid": "no tiny configuration built here runs in transformers' own forward yet",
    "longcat_flash": "no tiny configuration built here runs in transformers' own forward yet",
    "dots1": "its default config leaves the expert counts unset; no tiny configuration written yet",
    "lfm2_moe": "no tiny configuration built here runs in transformers' own forward yet",
    "jamba": "no tiny configuration built here runs in transformers' own forward yet (its attention layers' "
    "schedule)",
    "granitemoehybrid": "no tiny configuration built here runs in transformers' own forward yet (its attention "
    "layers' schedule)",
    "dots3_note_text": "its config's per-layer settings refuse a two-layer model; no tiny configuration written yet",
    "kolibri1_1": "its config's layer lists refuse a two-layer model; no tiny configuration written yet",
    "zaya": "its config's layer lists refuse a two-layer model; no tiny configuration written yet",
    "qwen4_exp_text": "its default config leaves the indexer's sizes unset; no tiny configuration written yet",
    "dots3_note": _IMAGE_TEXT + " (dots3_note_text)",
    "gemma4": _IMAGE_TEXT + " (gemma4_text)",
    "qwen4_exp": _IMAGE_TEXT + " (qwen4_exp_text)",
}
"""transformers' causal-LM MoE families outside MATRIX, each with why (tests/unit/model/test_moe_families.py
checks that every one transformers ships is in one of the two)."""


def moe_config(family: str, *, vocab_size: int, hidden: int = 64, layers: int = 2, experts: int = 8, top_k: int = 2,
               intermediate: int = 256, **extra):  # fmt: skip
    """A config of `family` built by transformers (`extra` overrides any setting); Qwen2-MoE gets a shared expert
    (and its gate), Qwen3-MoE none; DeepSeek-V2 a dense first layer, a shared expert and latent attention; PhiMoE
    routes to 2 experts whatever `top_k` says; the families with a dense first layer (DeepSeek, GLM) get one, with
    linear attention (Qwen3-Next, Qwen3.5) one layer of each kind, DeepSeek-V4 one compressed-sparse and one heavily
    compressed layer, the first hash-routed."""
    from transformers import AutoConfig

    head = hidden // 4
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, num_experts_per_tok=top_k, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    # Latent attention (DeepSeek-V2/V3, GLM-4.7-Flash, GLM-5).
    latent = dict(kv_lora_rank=hidden // 2, qk_nope_head_dim=head // 2, qk_rope_head_dim=head // 2, v_head_dim=head)
    # DeepSeek's and GLM's routed layers: a shared expert, a dense first layer.
    deepseek = dict(intermediate_size=intermediate, n_routed_experts=experts, n_shared_experts=1)
    dense_first = ["dense"] + ["sparse"] * (layers - 1)
    linear_attention = (["linear_attention", "full_attention"] * layers)[:layers]
    settings: dict[str, dict] = {
        "mixtral": dict(intermediate_size=intermediate, num_local_experts=experts),
        "qwen2_moe": dict(
            intermediate_size=intermediate, moe_intermediate_size=intermediate,
            shared_expert_intermediate_size=intermediate, num_experts=experts, decoder_sparse_step=1,
        ),
        "qwen3_moe": dict(
            intermediate_size=intermediate, moe_intermediate_size=intermediate, num_experts=experts, head_dim=head
        ),
        # No jitter: the routing is then sparsemixer's alone (its Gumbel sampling while training).
        "phimoe": dict(intermediate_size=intermediate, num_local_experts=experts, router_jitter_noise=0.0),
        "olmoe": dict(intermediate_size=intermediate, num_experts=experts),
        "deepseek_v2": dict(
            **deepseek, **latent, moe_intermediate_size=intermediate, first_k_dense_replace=1, q_lora_rank=None,
            head_dim=head // 2,
        ),
        # V3's attention computes with as many key/value heads as the config says (the release: all of them).
        "deepseek_v3": dict(
            **deepseek, **latent, moe_intermediate_size=intermediate, first_k_dense_replace=1, q_lora_rank=None,
            head_dim=head // 2, n_group=2, topk_group=1, num_key_value_heads=4,
        ),
        "gpt_oss": dict(
            intermediate_size=intermediate // 2, num_local_experts=experts, head_dim=head, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        ),
        "llama4_text": dict(
            intermediate_size=intermediate // 2, num_local_experts=experts, intermediate_size_mlp=intermediate,
            head_dim=head, interleave_moe_layer_step=1, num_experts_per_tok=1,
        ),
        # Qwen3.5-MoE's text model is its causal LM (the release is an image-text model around it).
        "qwen3_5_moe_text": dict(
            moe_intermediate_size=intermediate // 2, shared_expert_intermediate_size=intermediate // 2,
            num_experts=experts, head_dim=head, linear_key_head_dim=head, linear_value_head_dim=head,
            linear_num_key_heads=2, linear_num_value_heads=4, layer_types=linear_attention,
        ),
        "qwen3_next": dict(
            intermediate_size=intermediate, moe_intermediate_size=intermediate // 2,
            shared_expert_intermediate_size=intermediate // 2, num_experts=experts, head_dim=head,
            linear_key_head_dim=head, linear_value_head_dim=head, linear_num_key_heads=2, linear_num_value_heads=4,
            layer_types=linear_attention,
        ),
        # 8 indexer heads: with 2, several keys' scores are ReLU's zero, and top-k then breaks the tie one way on
        # a row alone and another in a padded batch (in transformers' own model too).
        "deepseek_v32": dict(
            **deepseek, **latent, q_lora_rank=hidden // 2, moe_intermediate_size=intermediate // 2, n_group=2,
            topk_group=1, first_k_dense_replace=1, mlp_layer_types=dense_first, head_dim=head // 2,
            layer_types=["indexed_attention"] * layers, index_topk=4, index_head_dim=head, index_n_heads=8,
            num_key_value_heads=4,
        ),
        "glm4_moe": dict(
            **deepseek, moe_intermediate_size=intermediate // 2, n_group=1, topk_group=1, first_k_dense_replace=1,
            head_dim=head,
        ),
        "glm4_moe_lite": dict(
            **deepseek, **latent, q_lora_rank=hidden // 2, moe_intermediate_size=intermediate // 2, n_group=1,
            topk_group=1, mlp_layer_types=dense_first, num_key_value_heads=4,
        ),
        "minimax_m2": dict(intermediate_size=intermediate // 2, num_local_experts=experts, head_dim=head),
        # One key/value head (the release's); compression rates small enough that 64 tokens compress.
        "deepseek_v4": dict(
            moe_intermediate_size=intermediate // 2, n_routed_experts=experts, n_shared_experts=1,
            head_dim=hidden // 2, q_lora_rank=hidden // 2, partial_rotary_factor=0.25, o_groups=2, o_lora_rank=head,
            index_n_heads=2, index_head_dim=head, index_topk=4, sliding_window=8, hc_mult=2, num_key_value_heads=1,
            layer_types=(["compressed_sparse_attention", "heavily_compressed_attention"] * layers)[:layers],
            mlp_layer_types=["hash_moe"] + ["moe"] * (layers - 1),
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        ),
    }  # fmt: skip
    settings["glm_moe_dsa"] = settings["deepseek_v32"]
    model_type = {"llama4": "llama4_text", "qwen3_5_moe": "qwen3_5_moe_text"}.get(family, family)
    if model_type in settings:
        return AutoConfig.for_model(model_type, **(common | settings[model_type] | extra))
    return shrunk_config(model_type, common | {"intermediate_size": intermediate, "experts": experts} | extra)


SHRUNK = {
    "head_dim": 16, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "expert_intermediate_size": 64,
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "index_topk": 4, "index_head_dim": 16, "index_n_heads": 8, "sliding_window": 8, "n_group": 1, "topk_group": 1,
}  # fmt: skip
"""The sizes `shrunk_config` sets where transformers' default config of a family has the setting."""
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
LATENT = ("axk2", "kimi_linear")
"""Families with latent attention, whose key/value heads are its query heads (tiny ones too)."""
ROUTED = {
    "gemma4_text": {"enable_moe_block": True, "top_k_experts": 2},
    "flint": {"mlp_only_layers": [0]},
}
"""Settings that make a family's tiny model route where its default config has no routed layer in two."""


def shrunk_config(model_type: str, sizes: dict):
    """A tiny config of a family without settings of its own above: transformers' default config for it with every
    size it has among `sizes` (moe_config's) and SHRUNK set small; a per-layer schedule keeps two layers of its
    kinds. `sizes["experts"]` is the routed expert count, whatever the family calls it."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type).to_dict()
    sizes = dict(sizes)
    experts = sizes.pop("experts")
    chosen = {k: v for k, v in (SHRUNK | sizes).items() if k in default and (v is not None or k in sizes)}
    chosen |= {k: experts for k in EXPERT_COUNTS if k in default}
    for key, value in default.items():  # every vocabulary and hidden width the family names its own way
        if isinstance(value, int) and not isinstance(value, bool) and key not in chosen:
            if "vocab_size" in key:
                chosen[key] = sizes["vocab_size"]
            elif key.endswith("intermediate_size"):
                chosen[key] = SHRUNK["moe_intermediate_size"]
    if default.get("q_lora_rank") is None:
        chosen.pop("q_lora_rank", None)
    if model_type in LATENT:
        chosen["num_key_value_heads"] = chosen["num_attention_heads"]
    for key in ("layer_types", "mlp_layer_types"):
        if isinstance(default.get(key), list) and key not in sizes:
            kinds = list(dict.fromkeys(default[key]))
            chosen[key] = (kinds * 2)[: sizes["num_hidden_layers"]]
    if default.get("first_k_dense_replace"):
        chosen["first_k_dense_replace"] = 1
    return AutoConfig.for_model(model_type, **(chosen | ROUTED.get(model_type, {})))


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
        for name, buffer in model.named_buffers():  # the checkpoint's buffers, likewise: routing bias, hash table
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.5)
            elif name.endswith("tid2eid"):  # DeepSeek-V4's token -> experts table: k distinct experts a token
                shuffled = torch.rand(buffer.shape[0], model.config.n_routed_experts).argsort(-1)
                buffer.copy_(shuffled[:, : buffer.shape[1]])
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, out / name)
    return out
