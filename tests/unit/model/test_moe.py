"""Mixture-of-experts models: loading through transformers' conversion, every expert quantized, the forward against
transformers' own module, per-expert LoRA in PEFT's layout, the router's loss, and refused layouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from qlora_fsdp.config.options import LoraConfig, ModelConfig, QuantConfig
from qlora_fsdp.errors import UserError
from qlora_fsdp.model.lora import adapter_keys, inject_lora, lora_layers
from qlora_fsdp.model.skeleton import build_skeleton
from qlora_fsdp.model.streaming import load_model, stream_weights
from qlora_fsdp.quant import make_backend
from qlora_fsdp.quant.base import QuantizedLinear
from qlora_fsdp.quant.experts import ExpertAdapter, QuantizedExperts, replace_experts, router_gates
from tests.conftest import REPO_ROOT, launch, randomize_adapters
from tests.moe_models import FAMILIES, TRANSPOSED, build_moe_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, moe_models: dict[str, Path]) -> dict[str, Path]:
    """The parametrized families and the transposed ones (gpt-oss, Llama 4), each saved by transformers."""
    root = tmp_path_factory.mktemp("transposed")
    built = {f: build_moe_model(f, root / f, tokenizer_from=tiny_model, seed=7 + i) for i, f in enumerate(TRANSPOSED)}
    return moe_models | built


def backend_for(quant: str):
    return make_backend(QuantConfig(quant=quant), storage_dtype=torch.uint8, compute_dtype=torch.float32)


def hf_model(path: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def weights_of(layer: nn.Module) -> torch.Tensor:
    return layer.dequantize() if isinstance(layer, QuantizedLinear) else layer.weight.detach()


def place_dequantized(ours: nn.Module, reference: nn.Module) -> None:
    """The reference transformers model with every weight the loaded model computes with (dequantized)."""
    state = reference.state_dict()
    with torch.no_grad():
        for wrapped, module in ours.named_modules():
            name = wrapped.replace(".base_layer", "")  # under PEFT's wrapper, the base model's name
            if isinstance(module, QuantizedExperts):
                for fused in module.fused_names():  # in transformers' layout, transposed where it is
                    state[f"{name}.{fused}"].copy_(module.fused(fused))
            elif isinstance(module, QuantizedLinear) and ".experts." not in name:
                state[f"{name}.weight"].copy_(module.dequantize())


def inputs(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 24), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0  # a padded row
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("quant", ["bnb", "hqq", "none"])
@pytest.mark.parametrize("family", FAMILIES + TRANSPOSED)
def test_loaded_model_computes_what_transformers_computes(models: dict[str, Path], family: str, quant: str) -> None:
    """The per-expert checkpoint transformers wrote, loaded through its conversion, quantized expert by expert:
    logits equal transformers' model holding the same (dequantized) weights."""
    path = models[family]
    skeleton = load_model(
        ModelConfig(model=str(path)), backend=backend_for(quant), device=CPU, param_dtype=torch.float32
    )
    experts = [m for m in skeleton.model.modules() if isinstance(m, QuantizedExperts)]
    assert len(experts) == (2 if quant != "none" else 0)
    reference = hf_model(path)
    place_dequantized(skeleton.model, reference)
    batch = inputs(reference.config.vocab_size)
    ours = skeleton.model.eval()(**batch).logits
    theirs = reference(**batch).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    if quant != "none":
        # Quantization changed the weights: the comparison is against the dequantized ones, not the originals.
        original = hf_model(path)(**batch).logits
        assert (ours - original).abs().max() > 1e-3


def test_every_expert_is_quantized_and_gates_are_not(moe_models: dict[str, Path]) -> None:
    path = moe_models["qwen2_moe"]
    skeleton = build_skeleton(ModelConfig(model=str(path)), backend=backend_for("bnb"), param_dtype=torch.float32)
    config = json.loads((path / "config.json").read_text())
    per_layer = 2 * config["num_experts"] + 4 + 3  # experts x (gate_up, down), attention, shared expert
    assert len(skeleton.quantized) == config["num_hidden_layers"] * per_layer
    layer = skeleton.model.model.layers[0].mlp
    assert type(layer.shared_expert_gate) is nn.Linear  # the shared expert's gate routes: full precision
    assert not isinstance(layer.gate, QuantizedLinear)
    assert all(isinstance(m, QuantizedLinear) for m in [*layer.experts.gate_up, *layer.experts.down])


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_fused_checkpoint_loads_the_same(moe_models: dict[str, Path], tmp_path: Path, quant: str) -> None:
    """A checkpoint already in transformers' fused layout (gate_up_proj [E, 2I, H]) gives the same bytes."""
    path = moe_models["mixtral"]
    fused = tmp_path / "fused"
    fused.mkdir()
    reference = hf_model(path)
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(fused / "model.safetensors"))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (fused / name).write_bytes((path / name).read_bytes())
    packed = []
    for model_dir in (path, fused):
        skeleton = load_model(ModelConfig(model=str(model_dir)), backend=backend_for(quant), device=CPU,
                              param_dtype=torch.float32)  # fmt: skip
        packed.append([m.packed_bytes().clone() for m in skeleton.model.modules() if isinstance(m, QuantizedLinear)])
    assert len(packed[0]) == len(packed[1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(*packed, strict=True))


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_only_routed_experts_are_dequantized(
    moe_models: dict[str, Path], quant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = moe_models["mixtral"]
    skeleton = load_model(
        ModelConfig(model=str(path)), backend=backend_for(quant), device=CPU, param_dtype=torch.float32
    )
    experts = skeleton.model.model.layers[0].mlp.experts
    calls: list[int] = []
    cls = type(experts.gate_up[0])
    original = cls._forward
    monkeypatch.setattr(cls, "_forward", lambda self, x: (calls.append(id(self)), original(self, x))[1])
    routed = torch.tensor([[1, 3], [3, 1], [1, 3]])  # 3 tokens, each to experts 1 and 3
    hidden = torch.randn(3, experts.gate_up[0].in_features, requires_grad=True)
    out = experts(hidden, routed, torch.full((3, 2), 0.5))
    out.sum().backward()  # backward reaches every expert's (empty) result without dequantizing it
    used = {id(experts.gate_up[i]) for i in (1, 3)} | {id(experts.down[i]) for i in (1, 3)}
    assert sorted(calls) == sorted(used)
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0


def _adapted(path: Path, quant: str, *, rank: int = 4, seed: int = 1):
    """The training skeleton with adapters (non-zero, so B matters), loaded; plus its PEFT keys."""
    backend = backend_for(quant)
    skeleton = build_skeleton(ModelConfig(model=str(path)), backend=backend, param_dtype=torch.float32)
    lora = LoraConfig(lora_rank=rank, lora_alpha=2 * rank, lora_dropout=0.0)
    peft_model = inject_lora(skeleton.model, lora, dtype=torch.float32)
    keys = adapter_keys(peft_model)
    stream_weights(skeleton, backend=backend, device=CPU)
    randomize_adapters(lora_layers(peft_model), seed=seed)
    return skeleton, peft_model, keys


@pytest.mark.parametrize("family", FAMILIES + TRANSPOSED)
def test_expert_adapters_are_peft_target_parameters(models: dict[str, Path], family: str) -> None:
    """The saved keys are exactly the ones PEFT makes for the config, and PEFT on the transformers model (with
    the dequantized base) computes the training forward's logits."""
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    path = models[family]
    skeleton, peft_model, keys = _adapted(path, "bnb")
    experts = [m for m in peft_model.modules() if isinstance(m, ExpertAdapter)]
    assert len(experts) == 2 * 2  # both projections of both layers' experts
    saved = {key: getattr(module, attr).detach() for module, names in keys.items() for attr, key in names.items()}
    config = peft_model.peft_config["default"]
    parameters = sorted(config.target_parameters)
    assert [p for p in parameters if not p.endswith(".weight")] == ["experts.down_proj", "experts.gate_up_proj"]
    # Qwen2-MoE's shared expert, named as its experts once were: saved by weight (qlora_fsdp/model/adapter_config.py)
    assert all(".mlp.shared_expert." in p for p in parameters if p.endswith(".weight"))
    assert any(p.endswith(".weight") for p in parameters) == (family == "qwen2_moe")
    reference = hf_model(path)
    place_dequantized(skeleton.model, reference)
    theirs = get_peft_model(reference, config)
    assert set(get_peft_model_state_dict(theirs)) == set(saved)
    result = set_peft_model_state_dict(theirs, saved)
    assert not result.unexpected_keys
    batch = inputs(reference.config.vocab_size, seed=3)
    ours = peft_model.eval()(**batch).logits
    torch.testing.assert_close(ours, theirs.eval()(**batch).logits, rtol=1e-4, atol=1e-4)
    # The control: the adapters matter here, so a layout error (rows of another expert) would show.
    with theirs.disable_adapter():
        assert (ours - theirs(**batch).logits).abs().max() > 1e-3


def test_expert_adapter_layout_control() -> None:
    """Expert e's A rows and B columns as PEFT's ParamWrapper reshapes them (its delta weight)."""
    adapter = ExpertAdapter(experts=3, in_features=5, out_features=4, rank=2, scaling=1.5)
    adapter.A = nn.Parameter(torch.randn(6, 5))
    adapter.B = nn.Parameter(torch.randn(4, 6))
    x = torch.randn(7, 5)
    sizes = [2, 0, 5]
    out = adapter(x, sizes)
    a = adapter.A.reshape(3, 2, 5)
    b = adapter.B.reshape(4, 2, 3)
    delta = torch.einsum("o r e, e r i -> e o i", b, a) * 1.5  # PEFT's get_delta_weight for [E, out, in]
    expected = torch.cat([x[:2] @ delta[0].T, x[2:7] @ delta[2].T])
    torch.testing.assert_close(out, expected)


def test_dora_on_experts_is_refused(moe_models: dict[str, Path]) -> None:
    skeleton = build_skeleton(
        ModelConfig(model=str(moe_models["mixtral"])), backend=backend_for("bnb"), param_dtype=torch.float32
    )
    with pytest.raises(UserError, match="DoRA on routed experts"):
        inject_lora(skeleton.model, LoraConfig(train_type="dora"), dtype=torch.float32)


def test_named_modules_without_experts_leave_experts_alone(moe_models: dict[str, Path]) -> None:
    skeleton = build_skeleton(
        ModelConfig(model=str(moe_models["mixtral"])), backend=backend_for("bnb"), param_dtype=torch.float32
    )
    peft_model = inject_lora(skeleton.model, LoraConfig(lora_target_modules="q_proj,v_proj"), dtype=torch.float32)
    assert not [m for m in peft_model.modules() if isinstance(m, ExpertAdapter)]
    assert not peft_model.peft_config["default"].target_parameters
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all(".q_proj." in n or ".v_proj." in n for n in trainable)


def test_aux_loss_equals_transformers(moe_models: dict[str, Path]) -> None:
    """The load-balancing loss on the router logits of the training forward (a padded row included) equals what
    transformers' own model returns as aux_loss for the same batch."""
    from qlora_fsdp.objectives.loss import CausalLMLoss, router_loss

    path = moe_models["mixtral"]
    skeleton = load_model(ModelConfig(model=str(path)), backend=None, device=CPU, param_dtype=torch.float32)
    router = router_loss(skeleton.model, 0.02)
    assert router is not None
    loss = CausalLMLoss(skeleton.model, chunk_tokens=16, router=router).train()
    batch = inputs(skeleton.model.config.vocab_size, seed=5)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    total = loss(labels=labels, **batch)
    label_tokens = int((labels[:, 1:] != -100).sum())
    ours = router.take(CPU)[0].item() / label_tokens
    reference = hf_model(path)
    theirs = reference(**batch, output_router_logits=True).aux_loss.item()
    assert ours == pytest.approx(theirs, abs=1e-6)
    plain = CausalLMLoss(skeleton.model, chunk_tokens=16).train()(labels=labels, **batch)
    assert total.item() == pytest.approx(plain.item() + 0.02 * theirs * label_tokens, rel=1e-6)
    assert router_loss(skeleton.model, None) is None  # Mixtral's config does not ask for it by default


class _TransposedExperts(nn.Module):
    """Experts in another layout (GPT-OSS style: transposed, with biases)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = 4
        self.gate_up_proj = nn.Parameter(torch.empty(4, 8, 12, device="meta"))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(4, 12, device="meta"))
        self.down_proj = nn.Parameter(torch.empty(4, 6, 8, device="meta"))


def test_unsupported_layout_is_refused_in_one_line() -> None:
    model = nn.Module()
    model.block = nn.Module()
    model.block.experts = _TransposedExperts()
    with pytest.raises(UserError) as info:
        replace_experts(model, lambda linear: linear)
    message = str(info.value)
    assert "_TransposedExperts (block.experts)" in message and "supported:" in message and "\n" not in message


@pytest.mark.distributed
def test_cli_refuses_an_unsupported_moe_before_reading_weights(tiny_model: Path, tmp_path: Path) -> None:
    """NemotronH's experts are ungated (up and down projections only): train.py names the class and exits 2 without
    reading a weight (the checkpoint's tensor data is garbage past its header, which any read would trip over)."""
    from transformers import AutoModelForCausalLM, NemotronHConfig

    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    config = NemotronHConfig(
        vocab_size=vocab, hidden_size=32, layers_block_type=["full_attention", "moe"], n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    model_dir = tmp_path / "nemotron-h"
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).write_bytes((tiny_model / name).read_bytes())
    weights = model_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header:] = b"\xff" * (len(data) - header)
    weights.write_bytes(bytes(data))
    result = launch(
        REPO_ROOT / "train.py",
        [
            "--model",
            str(model_dir),
            "--dataset",
            str(REPO_ROOT / "data" / "alpaca_tiny.jsonl"),
            "--device",
            "cpu",
            "--output_dir",
            str(tmp_path / "out"),
            "--max_steps",
            "1",
        ],
        nproc=0,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    error = [line for line in result.stderr.splitlines() if "NemotronHExperts" in line]
    assert len(error) == 1 and "supported:" in error[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def _save_adapter(peft_model: nn.Module, keys: dict, out: Path) -> Path:
    """The adapter as train.py writes it (PEFT's keys and config), from the test's own (non-zero) values."""
    out.mkdir(parents=True)
    tensors = {key: getattr(m, attr).detach().contiguous() for m, names in keys.items() for attr, key in names.items()}
    save_file(tensors, str(out / "adapter_model.safetensors"))
    peft_model.peft_config["default"].save_pretrained(str(out))
    return out


@pytest.mark.parametrize(
    ("family", "base_weights"),
    [("mixtral", "original"), ("mixtral", "dequantized"), ("gpt_oss", "dequantized"), ("llama4", "original")],
)
def test_merged_moe_loads_in_transformers_and_reproduces_base_plus_adapter(
    models: dict[str, Path], tmp_path: Path, family: str, base_weights: str
) -> None:
    """The merged directory is a plain transformers model in the checkpoint's own layout (Mixtral's per-expert
    tensors; gpt-oss's and Llama 4's transposed fused ones, biases included); its logits equal PEFT's (base +
    adapter) on the same base weights: the original ones, or the dequantized ones."""
    from peft import PeftModel
    from safetensors import safe_open

    from qlora_fsdp.tools.config import MergeConfig
    from qlora_fsdp.tools.export import merge_adapter

    path = models[family]
    skeleton, peft_model, keys = _adapted(path, "bnb")
    adapter = _save_adapter(peft_model, keys, tmp_path / "adapter")
    options = MergeConfig(
        adapter=str(adapter), output=str(tmp_path / "merged"), dtype="fp32", base_weights=base_weights
    )
    merge_adapter(ModelConfig(model=str(path)), QuantConfig(quant="bnb"), precision="fp32", options=options)
    merged_dir = tmp_path / "merged"
    names = set()
    for shard in merged_dir.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            names |= set(f.keys())
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert names == set(f.keys())  # as transformers saved the base (Mixtral: block_sparse_moe.experts.N.w1...)
    merged = hf_model(merged_dir)
    base = hf_model(path)
    if base_weights == "dequantized":
        place_dequantized(skeleton.model, base)
    reference = PeftModel.from_pretrained(base, str(adapter)).eval()
    batch = inputs(merged.config.vocab_size, seed=7)
    with torch.no_grad():
        ours, theirs = merged(**batch).logits, reference(**batch).logits
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
        with reference.disable_adapter():
            assert (ours - reference(**batch).logits).abs().max() > 1e-3  # the adapter was merged in


@pytest.mark.parametrize("family", ["qwen2_moe", *TRANSPOSED])
def test_generate_applies_the_adapter_to_quantized_experts(
    models: dict[str, Path], tmp_path: Path, family: str
) -> None:
    """scripts/generate.py's model: the quantized base with the saved adapter, experts included."""
    from qlora_fsdp.config.options import TrainConfig
    from qlora_fsdp.tools.config import GenerateConfig
    from qlora_fsdp.tools.generate import load_for_generation

    path = models[family]
    _, peft_model, keys = _adapted(path, "hqq")
    adapter = _save_adapter(peft_model, keys, tmp_path / "adapter")
    cfg = TrainConfig()
    cfg.model.model, cfg.quant.quant, cfg.fsdp.precision = str(path), "hqq", "fp32"
    model, _ = load_for_generation(cfg, GenerateConfig(adapter=str(adapter)))
    batch = inputs(peft_model.config.vocab_size, seed=9)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, peft_model.eval()(**batch).logits, rtol=1e-5, atol=1e-5)


def test_export_refuses_moe_in_one_line(moe_models: dict[str, Path], tmp_path: Path) -> None:
    from qlora_fsdp.tools.config import ExportConfig
    from qlora_fsdp.tools.export import export_quantized

    options = ExportConfig(output=str(tmp_path / "out"))
    with pytest.raises(UserError, match=r"routed experts.*merge the adapter instead"):
        export_quantized(ModelConfig(model=str(moe_models["mixtral"])), QuantConfig(quant="bnb"), precision="fp32",
                         options=options)  # fmt: skip
    assert not (tmp_path / "out").exists()


def test_unquantized_experts_keep_the_model_dtype(moe_models: dict[str, Path]) -> None:
    """--quant none with adapters on experts: the per-expert linears are bf16 like the rest, and the forward runs."""
    skeleton = build_skeleton(
        ModelConfig(model=str(moe_models["mixtral"])), backend=None, param_dtype=torch.bfloat16, adapt_experts=True
    )
    stream_weights(skeleton, backend=None, device=CPU)
    experts = skeleton.model.model.layers[0].mlp.experts
    assert isinstance(experts, QuantizedExperts)
    assert {m.weight.dtype for m in [*experts.gate_up, *experts.down]} == {torch.bfloat16}
    assert skeleton.model(**inputs(skeleton.model.config.vocab_size)).logits.dtype == torch.bfloat16


def test_dense_modules_with_3d_weights_are_not_experts() -> None:
    """A Conv1d's weight is 3-D (LFM2, Mamba): not an experts module, left alone."""
    model = nn.Module()
    model.conv = nn.Conv1d(4, 4, 3, device="meta")
    model.proj_gate = nn.Linear(4, 4, device="meta")
    assert replace_experts(model, lambda linear: linear) == []
    assert router_gates(model) == set()


def test_gate_named_linears_of_dense_models_are_adapted(tiny_model: Path) -> None:
    from qlora_fsdp.model.lora import target_modules

    model = build_skeleton(ModelConfig(model=str(tiny_model)), backend=None, param_dtype=torch.float32).model
    model.model.layers[0].per_layer_input_gate = nn.Linear(4, 4, device="meta")
    assert "per_layer_input_gate" in target_modules("all", model)[0]


def test_a_checkpoint_missing_one_experts_tensor_is_refused_before_reading(
    moe_models: dict[str, Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    path = moe_models["mixtral"]
    broken = tmp_path / "broken"
    broken.mkdir()
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((path / name).read_bytes())
    skeleton = build_skeleton(ModelConfig(model=str(broken)), backend=backend_for("bnb"), param_dtype=torch.float32)
    ready: list[str] = []
    with pytest.raises(UserError, match=r"lacks expert tensors \(model\.layers\.1\.mlp\.experts\.gate_up_proj: 7 of 8"):
        stream_weights(skeleton, backend=backend_for("bnb"), device=CPU, on_unit_ready=lambda n, _: ready.append(n))
    assert ready == []


def test_router_loss_on_packed_rows_skips_padding(moe_models: dict[str, Path]) -> None:
    """Packed rows go without an attention mask; `token_mask` keeps their padding out of the router's loss."""
    from qlora_fsdp.objectives.loss import CausalLMLoss, router_loss

    skeleton = load_model(
        ModelConfig(model=str(moe_models["mixtral"])), backend=None, device=CPU, param_dtype=torch.float32
    )
    batch = inputs(skeleton.model.config.vocab_size, seed=11)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    auxes = []
    for kwargs in ({"attention_mask": batch["attention_mask"]}, {"token_mask": batch["attention_mask"]}, {}):
        router = router_loss(skeleton.model, 0.01)
        CausalLMLoss(skeleton.model, chunk_tokens=16, router=router).train()(
            input_ids=batch["input_ids"], labels=labels, **kwargs
        )
        auxes.append(router.take(CPU)[0].item())
    assert auxes[1] == pytest.approx(auxes[0], abs=1e-7)
    assert abs(auxes[2] - auxes[0]) > 1e-6  # the control: padding counted


def test_router_loss_flag_on_a_model_without_one_is_refused(tiny_model: Path) -> None:
    from qlora_fsdp.objectives.loss import router_loss

    model = build_skeleton(ModelConfig(model=str(tiny_model)), backend=None, param_dtype=torch.float32).model
    assert router_loss(model, None) is None
    with pytest.raises(UserError, match="no load-balancing loss"):
        router_loss(model, 0.01)


def test_adapters_off_is_the_base_model_experts_included(moe_models: dict[str, Path]) -> None:
    """DPO's reference (lora.adapters_off) switches the routed experts' own adapters off with PEFT's: the logits are
    the base model's, and the adapters are back on afterwards."""
    from qlora_fsdp.model.lora import adapters_off

    _, peft_model, _ = _adapted(moe_models["mixtral"], "bnb")
    batch = inputs(peft_model.config.vocab_size)
    with torch.no_grad():
        adapted = peft_model(**batch).logits
        with adapters_off(peft_model):
            off = peft_model(**batch).logits
        again = peft_model(**batch).logits
        experts = [m for m in peft_model.modules() if isinstance(m, ExpertAdapter)]
        for adapter in experts:
            adapter.B.zero_()
        with peft_model.disable_adapter():  # PEFT's layers off, the experts' now zero: the base model
            base = peft_model(**batch).logits
    assert experts and (adapted - off).abs().max() > 1e-3
    torch.testing.assert_close(off, base, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, adapted)
