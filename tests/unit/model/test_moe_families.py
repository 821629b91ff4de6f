"""The MoE families outside the parametrized suites (tests/moe_models.py MORE_FAMILIES), in process: PhiMoE's
router (an nn.Linear subclass whose forward returns a tuple) stays full precision and unadapted, DeepSeek-V2's
latent attention runs with a padding mask, and each family's adapter config builds the same keys in PEFT on
transformers' own model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from qlora_fsdp.config.options import LoraConfig, ModelConfig, QuantConfig
from qlora_fsdp.errors import UserError
from qlora_fsdp.model.attention import fix_latent_attention
from qlora_fsdp.model.lora import adapter_keys, inject_lora, lora_layers, peft_lora_layers
from qlora_fsdp.model.skeleton import build_skeleton
from qlora_fsdp.model.streaming import stream_weights
from qlora_fsdp.quant import make_backend
from qlora_fsdp.quant.base import QuantizedLinear
from qlora_fsdp.quant.experts import ExpertAdapter, QuantizedExperts, router_gates
from tests.conftest import randomize_adapters
from tests.moe_models import MATRIX, MORE_FAMILIES, NOT_IN_MATRIX, build_moe_model, moe_config

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("more-moe")
    return {f: build_moe_model(f, root / f, tokenizer_from=tiny_model, seed=i) for i, f in enumerate(MORE_FAMILIES)}


def skeleton_of(path: Path, *, quant: str = "bnb"):
    backend = make_backend(QuantConfig(quant=quant), storage_dtype=torch.uint8, compute_dtype=torch.float32)
    return build_skeleton(ModelConfig(model=str(path)), backend=backend, param_dtype=torch.float32), backend


def test_phimoe_router_is_neither_quantized_nor_adapted(families: dict[str, Path]) -> None:
    """`all` adapts attention and the routed experts, not the router; the router keeps transformers' class and
    full-precision weight; a training forward and backward run and reach every adapter (the issue: PEFT's LoRA on
    the router got its tuple and failed at step 1)."""
    skeleton, backend = skeleton_of(families["phimoe"])
    model = skeleton.model
    routers = sorted(router_gates(model))
    assert routers == [f"model.layers.{i}.mlp.router" for i in range(2)]
    for name in routers:
        router = model.get_submodule(name)
        assert isinstance(router, nn.Linear) and not isinstance(router, QuantizedLinear), type(router)
        assert name not in skeleton.quantized
    assert all(isinstance(m, QuantizedLinear) for m in model.get_submodule("model.layers.0.mlp.experts").gate_up)

    peft_model = inject_lora(model, LoraConfig(lora_rank=4, lora_alpha=8, lora_dropout=0.0), dtype=torch.float32)
    lora = {id(m) for m in peft_lora_layers(peft_model)}
    wrapped = {n.replace("base_model.model.", "", 1) for n, m in peft_model.named_modules() if id(m) in lora}
    assert wrapped == {f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"}
    assert len([m for m in peft_model.modules() if isinstance(m, ExpertAdapter)]) == 2 * 2
    assert sorted(peft_model.peft_config["default"].target_modules) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    for name in routers:  # the model's own router, unwrapped, frozen
        router = peft_model.base_model.model.get_submodule(name)
        assert type(router).__name__ == "PhimoeTopKRouter" and not router.weight.requires_grad

    stream_weights(skeleton, backend=backend, device=CPU)
    randomize_adapters(lora_layers(peft_model), seed=0)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=generator)
    loss = peft_model.train()(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
    loss.backward()
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable)


def test_a_listed_router_is_refused(families: dict[str, Path]) -> None:
    skeleton, _ = skeleton_of(families["phimoe"])
    with pytest.raises(UserError, match=r"router is a router \(model.layers.0.mlp.router, PhimoeTopKRouter\)"):
        inject_lora(skeleton.model, LoraConfig(lora_target_modules="q_proj,router"), dtype=torch.float32)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_latent_attention_with_padding_computes_what_unmasked_rows_do(attention: str) -> None:
    """transformers' DeepSeek-V2 with fewer KV heads than query heads in its config repeats its already per-head
    latent keys on every masked (or eager) path; corrected, a padded batch's rows give the logits each row gives
    alone without a mask (the path transformers itself runs)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = moe_config("deepseek_v2", vocab_size=64)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()
    attentions = [m for m in model.modules() if type(m).__name__ == "DeepseekV2Attention"]
    assert [m.num_key_value_groups for m in attentions] == [2, 2]  # the config's 4 query / 2 KV heads
    assert len(fix_latent_attention(model)) == 2 and {m.num_key_value_groups for m in attentions} == {1}
    ids = torch.randint(3, 64, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=mask).logits
        first = model(input_ids=ids[:1]).logits
        second = model(input_ids=ids[1:, :8]).logits
    torch.testing.assert_close(batch[:1], first, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batch[1:, :8], second, rtol=1e-5, atol=1e-5)
    assert fix_latent_attention(model) == []  # nothing left to correct; a dense model has nothing either


def test_names_peft_reads_as_experts_are_adapted_and_saved_by_their_weights(families: dict[str, Path]) -> None:
    """DeepSeek-V2's dense MLP and shared experts (gate_proj, up_proj, down_proj) are names PEFT's transformers-5
    conversion reads as the routed experts': they are adapted in training all the same, and the saved config names
    them by their weights in target_parameters, which PEFT leaves alone (once they were left out of training; before
    that, saved by name, PEFT moved their adapters onto the experts at twice the rank)."""
    skeleton, _ = skeleton_of(families["deepseek_v2"])
    peft_model = inject_lora(skeleton.model, LoraConfig(lora_rank=4, lora_alpha=8), dtype=torch.float32)
    lora = {id(m) for m in peft_lora_layers(peft_model)}
    adapted = {n.replace("base_model.model.", "", 1) for n, m in peft_model.named_modules() if id(m) in lora}
    mlps = [f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")]
    mlps += [f"model.layers.1.mlp.shared_experts.{p}_proj" for p in ("gate", "up", "down")]
    assert set(mlps) <= adapted
    config = peft_model.peft_config["default"]
    assert sorted(config.target_modules) == ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_proj"]
    assert sorted(config.target_parameters) == sorted(["experts.down_proj", "experts.gate_up_proj"] +
                                                      [f"{m}.weight" for m in mlps])  # fmt: skip
    assert not config.rank_pattern and not config.alpha_pattern  # PEFT's doubled rank would not fit the experts'

    skeleton, _ = skeleton_of(families["deepseek_v2"])
    listed = inject_lora(skeleton.model, LoraConfig(lora_target_modules="q_proj,down_proj"), dtype=torch.float32)
    config = listed.peft_config["default"]
    assert sorted(config.target_modules) == ["q_proj"] and config.lora_dropout == 0.0
    assert sorted(config.target_parameters) == sorted(f"{m}.weight" for m in mlps if m.endswith("down_proj"))
    skeleton, _ = skeleton_of(families["deepseek_v2"])
    with pytest.raises(UserError, match=r"--train_type dora: PEFT would read gate_proj, up_proj as the routed"):
        inject_lora(skeleton.model, LoraConfig(lora_target_modules="q_proj,gate_proj,up_proj", train_type="dora"),
                    dtype=torch.float32)  # fmt: skip


@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_adapter_config_builds_the_same_keys_in_peft(families: dict[str, Path], family: str) -> None:
    """PEFT, given the adapter config training records, adapts transformers' own model under exactly the keys
    training saves, in their shapes (a rank PEFT doubled for names it reads as experts would show), routers left
    out on both sides."""
    from peft import get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    skeleton, _ = skeleton_of(families[family])
    peft_model = inject_lora(
        skeleton.model, LoraConfig(lora_rank=4, lora_alpha=8, lora_dropout=0.0), dtype=torch.float32
    )
    keys = adapter_keys(peft_model).items()
    saved = {key: tuple(getattr(module, attr).shape) for module, names in keys for attr, key in names.items()}
    assert any(".experts." in key for key in saved)
    assert not [m for m in skeleton.model.modules() if isinstance(m, QuantizedExperts) and m.gate_up_adapter is None]
    reference = AutoModelForCausalLM.from_pretrained(families[family], dtype=torch.float32)
    theirs = get_peft_model(reference, peft_model.peft_config["default"])
    assert {key: tuple(t.shape) for key, t in get_peft_model_state_dict(theirs).items()} == saved


def transformers_moe_families() -> set[str]:
    """Every model type transformers builds a causal LM for whose modeling code defines a mixture-of-experts class
    (one named for experts or MoE: fused experts, DBRX's expert GLU, JetMoE's parallel experts): read from the
    source, no model built."""
    import importlib.util
    import re

    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = set()
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        module = model_type_to_module_name(model_type)
        spec = importlib.util.find_spec(f"transformers.models.{module}.modeling_{module}")
        source = Path(spec.origin).read_text() if spec is not None and spec.origin is not None else ""
        if re.search(r"^class \w*(Expert|MoE|Moe)\w*\(", source, re.MULTILINE):
            found.add(model_type)
    return found


def test_every_moe_family_transformers_ships_is_in_the_matrix_or_says_why() -> None:
    """A family transformers adds is caught here: it joins MATRIX (trained on 2 ranks, its adapter loaded by PEFT)
    or NOT_IN_MATRIX with its reason; a reason for a family transformers no longer ships is stale."""
    shipped = transformers_moe_families()
    # The control: the scan finds fused experts, DBRX's 2-D expert GLU and JetMoE's experts, and no dense model.
    assert {"mixtral", "deepseek_v4", "glm_moe_dsa", "dbrx", "jetmoe"} <= shipped
    assert not {"llama", "qwen3", "bamba"} & shipped
    trained = {family for family, _, _ in MATRIX.values()} | {"llama4_text", "qwen3_5_moe_text"}  # their text models
    assert not set(NOT_IN_MATRIX) & trained
    assert sorted(shipped - trained - set(NOT_IN_MATRIX)) == [], "add each to MATRIX, or to NOT_IN_MATRIX with why"
    assert sorted((set(NOT_IN_MATRIX) | trained) - shipped) == []
