"""qlora_fsdp.model.lora: targets, injection, adapter keys and initialisation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import get_peft_model_state_dict
from torch import nn

from qlora_fsdp.config.options import LoraConfig, ModelConfig, QuantConfig
from qlora_fsdp.errors import UserError
from qlora_fsdp.model.lora import adapter_keys, init_adapters, inject_lora, lora_layers, target_modules
from qlora_fsdp.model.skeleton import build_skeleton
from qlora_fsdp.model.streaming import load_model
from qlora_fsdp.quant import QuantBackend, make_backend

CPU = torch.device("cpu")
LLAMA_LINEARS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
NUM_LAYERS = 2  # the session tiny model


def loaded(path: Path, quant: str) -> tuple[QuantBackend | None, nn.Module]:
    backend = make_backend(QuantConfig(quant=quant), storage_dtype=torch.bfloat16, compute_dtype=torch.bfloat16)
    result = load_model(ModelConfig(model=str(path)), backend=backend, device=CPU, param_dtype=torch.bfloat16)
    return backend, result.model


@pytest.fixture(scope="module")
def read_only_models(tiny_model: Path):
    """quant -> (backend, model), loaded once per module, for tests that never modify the model."""
    cache: dict[str, tuple[QuantBackend | None, nn.Module]] = {}

    def get(quant: str) -> tuple[QuantBackend | None, nn.Module]:
        if quant not in cache:
            cache[quant] = loaded(tiny_model, quant)
        return cache[quant]

    return get


# --- target_modules -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("quant", ["bnb", "hqq", "none"])
def test_all_targets_every_projection_but_the_head(read_only_models, quant: str) -> None:
    _backend, model = read_only_models(quant)
    names, excluded = target_modules("all", model)
    assert sorted(names) == LLAMA_LINEARS
    assert "lm_head" not in names and excluded == []


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_all_finds_the_quantized_layers(read_only_models, quant: str) -> None:
    # Every projection was quantized, so "all" can only find them through the quantized classes being nn.Linear.
    backend, model = read_only_models(quant)
    assert all(backend.is_quantized(m) for n, m in model.named_modules() if n.endswith("proj"))
    assert sorted(target_modules("all", model)[0]) == LLAMA_LINEARS


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("q_proj, v_proj", ["q_proj", "v_proj"]),
        ("q_proj,v_proj", ["q_proj", "v_proj"]),
        (" q_proj , ,v_proj, ", ["q_proj", "v_proj"]),
        ("down_proj", ["down_proj"]),
    ],
)
def test_explicit_targets_are_parsed(spec: str, expected: list[str]) -> None:
    assert target_modules(spec, nn.Module()) == (expected, [])


# --- inject_lora and adapter_keys ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_only_adapters_train_in_the_requested_dtype(tiny_model: Path, quant: str, dtype: torch.dtype) -> None:
    backend, model = loaded(tiny_model, quant)
    cfg = LoraConfig(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0)
    peft_model = inject_lora(model, cfg, dtype=dtype)
    trainable = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in peft_model.named_parameters() if not p.requires_grad}
    # A and B for each of 7 projections in each layer.
    assert len(trainable) == 2 * len(LLAMA_LINEARS) * NUM_LAYERS
    for name, param in trainable.items():
        assert ".lora_A." in name or ".lora_B." in name, name
        assert param.dtype == dtype, name
        assert not param.is_meta, name
    assert not [n for n in frozen if "lora_" in n]
    assert any("lm_head" in n for n in frozen)
    assert not any("lm_head" in n for n in trainable)
    # Shapes follow the rank: A is [r, in], B is [out, r]; B starts at zero so the model starts unchanged.
    q = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert tuple(q.lora_A["default"].weight.shape) == (4, 128)
    assert tuple(q.lora_B["default"].weight.shape) == (128, 4)
    assert torch.count_nonzero(q.lora_B["default"].weight) == 0
    assert backend.is_quantized(q.base_layer)


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_explicit_targets_get_the_only_adapters(tiny_model: Path, quant: str) -> None:
    _backend, model = loaded(tiny_model, quant)
    cfg = LoraConfig(lora_rank=2, lora_dropout=0.0, lora_target_modules="q_proj, v_proj")
    peft_model = inject_lora(model, cfg, dtype=torch.float32)
    owners = {n.split(".lora_")[0].rpartition(".")[2] for n, p in peft_model.named_parameters() if p.requires_grad}
    assert owners == {"q_proj", "v_proj"}
    assert sum(p.requires_grad for p in peft_model.parameters()) == 2 * 2 * NUM_LAYERS


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_adapters_change_the_output(tiny_model: Path, quant: str) -> None:
    _backend, model = loaded(tiny_model, quant)
    cfg = LoraConfig(lora_rank=2, lora_alpha=2.0, lora_dropout=0.0)
    peft_model = inject_lora(model, cfg, dtype=torch.bfloat16).eval()
    ids = torch.tensor([[4, 9, 33, 120, 7]])
    with torch.no_grad():
        before = peft_model(input_ids=ids).logits.float()
        for name, param in peft_model.named_parameters():
            if ".lora_B." in name:
                param.fill_(0.05)
        after = peft_model(input_ids=ids).logits.float()
    assert torch.isfinite(before).all() and torch.isfinite(after).all()
    assert (after - before).abs().max() > 1e-3


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_adapter_keys_are_peft_saved_keys(tiny_model: Path, quant: str) -> None:
    _backend, model = loaded(tiny_model, quant)
    cfg = LoraConfig(lora_rank=4)
    peft_model = inject_lora(model, cfg, dtype=torch.float32)
    keys = adapter_keys(peft_model)
    saved = get_peft_model_state_dict(peft_model)
    qualified = {id(p): n for n, p in peft_model.named_parameters()}
    mapped = []
    for module, by_name in keys.items():
        assert set(by_name) == {n for n, _ in module.named_parameters(recurse=False)}
        for name, key in by_name.items():
            param = getattr(module, name)
            assert param.requires_grad
            # PEFT saves "<path>.lora_A.weight": the parameter's qualified name without the adapter name.
            assert key == qualified[id(param)].replace(".default.", "."), key
            assert torch.equal(saved[key], param.detach()), key
            mapped.append(key)
    assert len(mapped) == len(set(mapped))
    assert set(mapped) == set(saved)
    trainable = {id(p) for p in peft_model.parameters() if p.requires_grad}
    assert {id(getattr(m, n)) for m, d in keys.items() for n in d} == trainable


@pytest.mark.parametrize("quant", ["bnb", "none"])
def test_unknown_target_names_the_flag(tiny_model: Path, quant: str) -> None:
    _backend, model = loaded(tiny_model, quant)
    cfg = LoraConfig(lora_target_modules="qkv_proj")
    with pytest.raises(UserError) as info:
        inject_lora(model, cfg, dtype=torch.float32)
    assert "--lora_target_modules" in str(info.value)
    assert "qkv_proj" in str(info.value)


# --- adapters on a meta skeleton: keys and initialisation ----------------------------------------------------------


def skeleton_with_adapters(path: Path, quant: str, *, dora: bool = False) -> tuple[nn.Module, nn.Module]:
    backend = make_backend(QuantConfig(quant=quant), storage_dtype=torch.uint8, compute_dtype=torch.float32)
    skeleton = build_skeleton(ModelConfig(model=str(path)), backend=backend, param_dtype=torch.float32)
    cfg = LoraConfig(lora_rank=4, lora_dropout=0.0, train_type="dora" if dora else "lora")
    return skeleton, inject_lora(skeleton.model, cfg, dtype=torch.float32)


@pytest.mark.parametrize("quant", ["bnb", "none"])
def test_adapter_keys_on_a_meta_skeleton_match_peft_on_a_real_model(tiny_model: Path, quant: str) -> None:
    """Keys are taken before any weight exists (no storage to match by): they must still be PEFT's own."""
    _, meta_peft = skeleton_with_adapters(tiny_model, quant)
    assert all(p.is_meta for p in meta_peft.parameters() if p.requires_grad)
    _backend, model = loaded(tiny_model, quant)
    real_peft = inject_lora(model, LoraConfig(lora_rank=4), dtype=torch.float32)
    meta_keys = {k for names in adapter_keys(meta_peft).values() for k in names.values()}
    assert meta_keys == set(get_peft_model_state_dict(real_peft))


def _materialize_adapters(layers: list[nn.Module]) -> None:
    for layer in layers:
        for module in (*layer.lora_A.values(), *layer.lora_B.values()):
            module.weight = nn.Parameter(torch.full(module.weight.shape, float("nan")))


def test_init_adapters_is_peft_default_and_depends_only_on_seed_and_name(tiny_model: Path) -> None:
    _, peft_model = skeleton_with_adapters(tiny_model, "none")
    layers = lora_layers(peft_model)
    _materialize_adapters(layers)

    def draw(seed: int, name: str) -> list[torch.Tensor]:
        init_adapters(layers, seed=seed, name=name)
        return [layer.lora_A["default"].weight.detach().clone() for layer in layers]

    first, again, other_name, other_seed = draw(1, "model.layers.0"), draw(1, "model.layers.0"), \
        draw(1, "model.layers.1"), draw(2, "model.layers.0")  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(first, other_name, strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(first, other_seed, strict=True))
    for layer, a in zip(layers, first, strict=True):
        assert torch.count_nonzero(layer.lora_B["default"].weight) == 0
        # PEFT's default: Kaiming-uniform with a=sqrt(5), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        bound = 1 / a.shape[1] ** 0.5
        assert a.abs().max() <= bound and a.abs().max() > 0.5 * bound
    # The global RNG (dropout masks) is untouched by initialisation.
    state = torch.get_rng_state()
    init_adapters(layers, seed=1, name="x")
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_init_adapters_sets_dora_magnitude_to_the_dequantized_row_norms(tiny_model: Path, quant: str) -> None:
    from qlora_fsdp.model.streaming import stream_weights

    skeleton, peft_model = skeleton_with_adapters(tiny_model, quant, dora=True)
    backend = make_backend(QuantConfig(quant=quant), storage_dtype=torch.uint8, compute_dtype=torch.float32)
    stream_weights(skeleton, backend=backend, device=CPU)
    layers = lora_layers(peft_model)
    init_adapters(layers, seed=0, name="")
    for layer in layers:
        magnitude = layer.lora_magnitude_vector["default"].weight
        expected = torch.linalg.norm(layer.get_base_layer().dequantize(), dim=1)
        assert magnitude.requires_grad and magnitude.dtype == torch.float32
        assert torch.allclose(magnitude, expected, rtol=1e-6), layer
