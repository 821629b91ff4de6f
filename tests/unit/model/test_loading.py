"""qlora_fsdp.model.skeleton and .streaming: the meta skeleton, streaming a safetensors checkpoint into it (each
decoder layer handed on as soon as it is whole), quantization from each layer's own tensor, architecture variants and
error messages."""

from __future__ import annotations

import json
import logging
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from qlora_fsdp.config.options import ModelConfig, QuantConfig
from qlora_fsdp.errors import UserError
from qlora_fsdp.model.hub import load_tokenizer
from qlora_fsdp.model.skeleton import Skeleton, build_skeleton, decoder_layer_classes
from qlora_fsdp.model.streaming import load_model, stream_weights
from qlora_fsdp.quant import QuantBackend, make_backend
from qlora_fsdp.quant.base import QuantizedLinear
from scripts.make_tiny_model import build_tiny_model

CPU = torch.device("cpu")
INDEX = "model.safetensors.index.json"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LAYERS = ["model.layers.0", "model.layers.1"]  # the session tiny model's decoder layers
IDS = torch.tensor([[5, 17, 99, 3, 250, 42, 7, 8]])


def backend_for(
    quant: str, storage: torch.dtype = torch.uint8, compute: torch.dtype = torch.float32
) -> QuantBackend | None:
    return make_backend(QuantConfig(quant=quant), storage_dtype=storage, compute_dtype=compute)


def load(
    path: Path, quant: str = "bnb", *, storage: torch.dtype = torch.uint8, param_dtype: torch.dtype = torch.float32
) -> tuple[QuantBackend | None, Skeleton]:
    backend = backend_for(quant, storage)
    skeleton = load_model(ModelConfig(model=str(path)), backend=backend, device=CPU, param_dtype=param_dtype)
    return backend, skeleton


def stream(
    path: Path,
    quant: str = "bnb",
    *,
    on_ready: Callable[[Skeleton, str, nn.Module], None] | None = None,
    prepare: Callable[[Skeleton], None] | None = None,
) -> tuple[QuantBackend | None, Skeleton, list[str]]:
    """build_skeleton + stream_weights (uint8 storage, fp32), recording every on_unit_ready call in order."""
    backend = backend_for(quant)
    skeleton = build_skeleton(ModelConfig(model=str(path)), backend=backend, param_dtype=torch.float32)
    if prepare is not None:
        prepare(skeleton)
    calls: list[str] = []

    def on_unit_ready(name: str, layer: nn.Module) -> None:
        calls.append(name)
        if on_ready is not None:
            on_ready(skeleton, name, layer)

    stream_weights(skeleton, backend=backend, device=CPU, on_unit_ready=on_unit_ready)
    return backend, skeleton, calls


_SHARED: dict[tuple, tuple[QuantBackend | None, Skeleton]] = {}


def shared(
    path: Path, quant: str = "bnb", *, storage: torch.dtype = torch.uint8, param_dtype: torch.dtype = torch.float32
) -> tuple[QuantBackend | None, Skeleton]:
    """`load` memoised for tests that only read the result."""
    key = (str(path), quant, storage, param_dtype)
    if key not in _SHARED:
        _SHARED[key] = load(path, quant, storage=storage, param_dtype=param_dtype)
    return _SHARED[key]


@pytest.fixture(scope="module", autouse=True)
def _forget_shared_models() -> Iterator[None]:
    yield
    _SHARED.clear()


def checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the model directory, read with safetensors directly."""
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def shard_of(path: Path) -> dict[str, str]:
    return json.loads((path / INDEX).read_text())["weight_map"]


def linear_names(ckpt: dict[str, torch.Tensor]) -> list[str]:
    """Qualified names of the projection linears, read off the checkpoint's keys."""
    return sorted(k.removesuffix(".weight") for k in ckpt if k.removesuffix(".weight").endswith(PROJECTIONS))


def unit_of(name: str) -> str:
    """`model.layers.N` for a tensor of decoder layer N, '' for the rest."""
    parts = name.split(".")
    return ".".join(parts[:3]) if parts[:2] == ["model", "layers"] else ""


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_shards(
    path: Path, tensors: dict[str, torch.Tensor], shard_index: Callable[[str], int], *, seed: int
) -> None:
    """Replace the checkpoint in `path` by `tensors` split into shards by `shard_index` (0-based), each file written
    with its tensors in a shuffled order, and a matching index."""
    for old in path.glob("model*.safetensors*"):
        old.unlink()
    count = max(shard_index(name) for name in tensors) + 1
    files = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    names = list(tensors)
    random.Random(seed).shuffle(names)
    weight_map = {name: files[shard_index(name)] for name in names}
    for file in files:
        save_file({n: tensors[n] for n in names if weight_map[n] == file}, str(path / file), metadata={"format": "pt"})
    (path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def arrival_order(path: Path) -> list[str]:
    """Tensor names in the order they are read: shards in file order, each as safetensors lists it."""
    names = []
    for file in sorted(set(shard_of(path).values())):
        with safe_open(path / file, framework="pt") as shard:
            names.extend(shard.keys())
    return names


def quantized_modules(root: nn.Module) -> dict[str, QuantizedLinear]:
    return {n: m for n, m in root.named_modules() if isinstance(m, QuantizedLinear)}


def assert_packed_from(backend: QuantBackend, module: QuantizedLinear, weight: torch.Tensor, name: str) -> None:
    """`module` holds exactly what quantizing `weight` gives: packed bytes and every state tensor."""
    expected = backend.quantize(weight)
    assert torch.equal(module.packed_bytes(), expected.packed.flatten()), name
    state = module.state_tensors()
    assert set(state) == set(expected.state), name
    for key, value in expected.state.items():
        assert torch.equal(state[key], value), (name, key)


@pytest.fixture(scope="module")
def qwen2_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-layer Qwen2 (q/k/v biases) with random non-zero biases (transformers initialises them to zero, which a
    bias never loaded could match by chance), and two biases in another shard than their weight: v_proj's bias
    arrives after its weight, k_proj's weight after its bias."""
    path = build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2", seed=3, num_layers=1)
    tensors = checkpoint(path)
    gen = torch.Generator().manual_seed(5)
    for name in [n for n in tensors if n.endswith(".bias")]:
        tensors[name] = torch.randn(tensors[name].shape, generator=gen)
    late = {"model.layers.0.self_attn.v_proj.bias", "model.layers.0.self_attn.k_proj.weight"}
    rewrite_shards(path, tensors, lambda n: int(n in late), seed=6)
    return path


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-tied"), seed=4, num_layers=1, tie_word_embeddings=True)


# Layer 1 is split over shards 1 and 2, layer 0 over all three; everything else is scattered too. Layer 1 is whole
# at the end of shard 2, layer 0 only in shard 3, so layer 1 must be reported first.
SCRAMBLED_SHARDS = {
    "lm_head.weight": 0,
    "model.layers.1.mlp.gate_proj.weight": 0,
    "model.layers.1.mlp.up_proj.weight": 0,
    "model.layers.1.mlp.down_proj.weight": 0,
    "model.layers.1.self_attn.q_proj.weight": 0,
    "model.layers.1.self_attn.k_proj.weight": 0,
    "model.layers.0.self_attn.o_proj.weight": 0,
    "model.layers.0.mlp.down_proj.weight": 0,
    "model.layers.1.input_layernorm.weight": 1,
    "model.layers.1.post_attention_layernorm.weight": 1,
    "model.layers.1.self_attn.v_proj.weight": 1,
    "model.layers.1.self_attn.o_proj.weight": 1,
    "model.norm.weight": 1,
    "model.layers.0.mlp.up_proj.weight": 1,
}


@pytest.fixture(scope="module")
def scrambled_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session tiny model with its tensors shuffled across three shards (see SCRAMBLED_SHARDS)."""
    path = copy_model(tiny_model, tmp_path_factory.mktemp("scrambled") / "model")
    rewrite_shards(path, checkpoint(tiny_model), lambda n: SCRAMBLED_SHARDS.get(n, 2), seed=7)
    return path


# --- the skeleton ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_skeleton_is_on_meta_with_projections_replaced_and_sources_for_every_tensor(
    tiny_model: Path, quant: str
) -> None:
    backend = backend_for(quant)
    skeleton = build_skeleton(ModelConfig(model=str(tiny_model)), backend=backend, param_dtype=torch.float32)
    ckpt = checkpoint(tiny_model)
    model = skeleton.model
    assert all(p.is_meta for p in model.parameters())  # nothing read yet
    assert skeleton.path == tiny_model
    assert [f.name for f in skeleton.files] == sorted(set(shard_of(tiny_model).values()))
    assert sorted(skeleton.quantized) == linear_names(ckpt)
    for name in skeleton.quantized:
        assert backend.is_quantized(model.get_submodule(name)), name
        assert model.get_submodule(name).is_meta, name
    assert skeleton.head_name == "lm_head"
    assert type(model.lm_head) is nn.Linear
    assert list(skeleton.units) == LAYERS
    for name, layer in skeleton.units.items():
        assert layer is model.get_submodule(name)
        assert isinstance(layer, skeleton.layer_classes)
    # Every checkpoint tensor has a place of the right shape (quantized layers: their [out, in]).
    assert set(ckpt) <= set(skeleton.sources)
    for name, tensor in ckpt.items():
        module, attr = skeleton.sources[name]
        if backend.is_quantized(module) and attr == "weight":
            assert (module.out_features, module.in_features) == tensor.shape, name
        else:
            assert getattr(module, attr).shape == tensor.shape, name


def test_full_precision_prefixes_stay_plain_linears(tiny_model: Path) -> None:
    backend = backend_for("hqq")
    skeleton = build_skeleton(
        ModelConfig(model=str(tiny_model)),
        backend=backend,
        param_dtype=torch.float32,
        full_precision_prefixes=("model.layers.1.",),
    )
    ckpt = checkpoint(tiny_model)
    assert sorted(skeleton.quantized) == [n for n in linear_names(ckpt) if n.startswith("model.layers.0.")]
    stream_weights(skeleton, backend=backend, device=CPU)
    for name in linear_names(ckpt):
        module = skeleton.model.get_submodule(name)
        if name.startswith("model.layers.1."):
            assert type(module) is nn.Linear, name
            assert torch.equal(module.weight.detach(), ckpt[f"{name}.weight"]), name
        else:
            assert backend.is_quantized(module), name


# --- what loading gives ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("storage", [torch.uint8, torch.bfloat16], ids=["u8", "bf16"])
@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_everything_is_loaded_and_every_projection_quantized(
    tiny_model: Path, quant: str, storage: torch.dtype
) -> None:
    backend, loaded = shared(tiny_model, quant, storage=storage)
    model = loaded.model
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    assert not meta, meta
    assert sorted(loaded.quantized) == linear_names(checkpoint(tiny_model))
    for name in loaded.quantized:
        module = model.get_submodule(name)
        assert backend.is_quantized(module) and not module.is_meta, name
        assert module.weight.dtype == storage, name
        assert all(not t.is_meta for t in module.state_tensors().values()), name
    assert "lm_head" not in loaded.quantized
    assert type(model.lm_head) is nn.Linear


@pytest.mark.parametrize("storage", [torch.uint8, torch.bfloat16], ids=["u8", "bf16"])
@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_quantized_weights_come_from_their_own_checkpoint_tensor(
    tiny_model: Path, quant: str, storage: torch.dtype
) -> None:
    """Each quantized layer holds exactly what quantizing its own checkpoint weight gives."""
    backend, loaded = shared(tiny_model, quant, storage=storage)
    ckpt = checkpoint(tiny_model)
    for name in loaded.quantized:
        assert_packed_from(backend, loaded.model.get_submodule(name), ckpt[f"{name}.weight"], name)


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_unquantized_params_are_the_checkpoint_in_param_dtype(
    tiny_model: Path, quant: str, param_dtype: torch.dtype
) -> None:
    _, loaded = shared(tiny_model, quant, param_dtype=param_dtype)
    ckpt = checkpoint(tiny_model)
    quantized = set(loaded.quantized)
    plain = {n: p for n, p in loaded.model.named_parameters() if n.rpartition(".")[0] not in quantized}
    # Embeddings, the two norms per layer, the final norm and the head.
    expected = {n for n in ckpt if n.rpartition(".")[0] not in quantized}
    assert set(plain) == expected
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= set(plain)
    for name, param in plain.items():
        assert param.dtype == param_dtype, name
        assert torch.equal(param.detach(), ckpt[name].to(param_dtype)), name


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_no_backend_loads_every_weight_unchanged(tiny_model: Path, param_dtype: torch.dtype) -> None:
    _, loaded = shared(tiny_model, "none", param_dtype=param_dtype)
    ckpt = checkpoint(tiny_model)
    assert loaded.quantized == []
    params = dict(loaded.model.named_parameters())
    assert set(params) == set(ckpt)
    for name, param in params.items():
        assert param.dtype == param_dtype, name
        assert torch.equal(param.detach(), ckpt[name].to(param_dtype)), name
    for name in linear_names(ckpt):
        assert type(loaded.model.get_submodule(name)) is nn.Linear


def test_no_backend_model_computes_what_transformers_computes(tiny_model: Path) -> None:
    _, loaded = shared(tiny_model, "none")
    reference = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        ours = loaded.model.eval()(input_ids=IDS).logits
        theirs = reference(input_ids=IDS).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_single_file_checkpoint_loads(tiny_model: Path, tmp_path: Path) -> None:
    path = copy_model(tiny_model, tmp_path / "single")
    ckpt = checkpoint(tiny_model)
    for shard in path.glob("*.safetensors"):
        shard.unlink()
    (path / INDEX).unlink()
    save_file(ckpt, str(path / "model.safetensors"), metadata={"format": "pt"})
    _, loaded = load(path, "none")
    for name, param in loaded.model.named_parameters():
        assert torch.equal(param.detach(), ckpt[name]), name


# --- streaming ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("quant", ["bnb", "hqq", "none"])
def test_each_layer_is_handed_on_once_as_soon_as_it_is_whole(tiny_model: Path, quant: str) -> None:
    """on_unit_ready runs once per decoder layer, in checkpoint order, when that layer is complete (adapter-like
    parameters added after the skeleton allocated too) and the later layer is still on meta."""
    weight_map = shard_of(tiny_model)
    # Precondition: each layer lies in one shard, layer 0 in the first, layer 1 in the second.
    assert {weight_map[n] for n in weight_map if unit_of(n) == LAYERS[0]} == {"model-00001-of-00002.safetensors"}
    assert {weight_map[n] for n in weight_map if unit_of(n) == LAYERS[1]} == {"model-00002-of-00002.safetensors"}
    ckpt = checkpoint(tiny_model)
    backend = backend_for(quant)
    checked: list[str] = []

    def add_adapter_like_parameters(skeleton: Skeleton) -> None:
        for layer in skeleton.units.values():
            layer.mlp.register_parameter("extra", nn.Parameter(torch.empty(4, 8, device="meta")))

    def on_ready(skeleton: Skeleton, name: str, layer: nn.Module) -> None:
        assert layer is skeleton.units[name]
        meta = [n for n, p in layer.named_parameters() if p.is_meta]
        assert not meta, (name, meta)
        assert layer.mlp.extra.shape == (4, 8) and layer.mlp.extra.requires_grad
        quantized = quantized_modules(layer)
        assert len(quantized) == (len(PROJECTIONS) if backend is not None else 0)
        for sub, module in quantized.items():
            assert_packed_from(backend, module, ckpt[f"{name}.{sub}.weight"], f"{name}.{sub}")
        for pname, param in layer.named_parameters():
            if pname.rpartition(".")[0] not in quantized and pname != "mlp.extra":
                assert torch.equal(param.detach(), ckpt[f"{name}.{pname}"]), (name, pname)
        for later in LAYERS[LAYERS.index(name) + 1 :]:
            later_layer = skeleton.units[later]
            assert all(p.is_meta for p in later_layer.parameters()), later
            assert all(m.is_meta for m in quantized_modules(later_layer).values()), later
        checked.append(name)

    _, skeleton, calls = stream(tiny_model, quant, on_ready=on_ready, prepare=add_adapter_like_parameters)
    assert calls == LAYERS
    assert checked == LAYERS
    # Embeddings, final norm and head are filled by the time stream_weights returns.
    assert not [n for n, p in skeleton.model.named_parameters() if p.is_meta]


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_tensors_in_any_order_and_layers_spanning_shards(tiny_model: Path, scrambled_model: Path, quant: str) -> None:
    weight_map = shard_of(scrambled_model)
    # Preconditions: both layers span shards, and tensors of the two layers interleave in the stream.
    for layer in LAYERS:
        assert len({weight_map[n] for n in weight_map if unit_of(n) == layer}) > 1, layer
    order = [unit_of(n) for n in arrival_order(scrambled_model)]
    last = {layer: max(i for i, u in enumerate(order) if u == layer) for layer in LAYERS}
    assert last[LAYERS[1]] < last[LAYERS[0]]
    assert order.index(LAYERS[0]) < last[LAYERS[1]]

    states: dict[str, list[bool]] = {}

    def on_ready(skeleton: Skeleton, name: str, layer: nn.Module) -> None:
        assert not [n for n, p in layer.named_parameters() if p.is_meta], name
        if name == LAYERS[1]:
            # Layer 0 has begun arriving but is not whole: some of its projections are filled, some not.
            states[name] = [m.is_meta for m in quantized_modules(skeleton.units[LAYERS[0]]).values()]

    _, scrambled, calls = stream(scrambled_model, quant, on_ready=on_ready)
    assert calls == [LAYERS[1], LAYERS[0]]
    assert any(states[LAYERS[1]]) and not all(states[LAYERS[1]])

    _, normal = shared(tiny_model, quant)
    assert sorted(scrambled.quantized) == sorted(normal.quantized)
    for name in normal.quantized:
        ours, reference = scrambled.model.get_submodule(name), normal.model.get_submodule(name)
        assert torch.equal(ours.packed_bytes(), reference.packed_bytes()), name
        for key, value in reference.state_tensors().items():
            assert torch.equal(ours.state_tensors()[key], value), (name, key)
    reference_params = dict(normal.model.named_parameters())
    for name, param in scrambled.model.named_parameters():
        assert torch.equal(param.detach(), reference_params[name].detach()), name
    with torch.no_grad():
        assert torch.equal(scrambled.model.eval()(input_ids=IDS).logits, normal.model.eval()(input_ids=IDS).logits)


def test_checkpoint_tensor_unknown_to_the_model_is_ignored_with_a_warning(
    tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = copy_model(tiny_model, tmp_path / "model")
    tensors = checkpoint(tiny_model)
    extra = "model.layers.0.mlp.unused.weight"
    tensors[extra] = torch.ones(3)
    rewrite_shards(path, tensors, lambda n: int(unit_of(n) != LAYERS[0]), seed=8)
    with caplog.at_level(logging.WARNING, logger="qlora_fsdp.model.streaming"):
        _, skeleton, calls = stream(path, "none")
    assert calls == LAYERS
    assert extra in caplog.text
    assert not [n for n, p in skeleton.model.named_parameters() if p.is_meta]


# --- architecture variants ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_qwen2_attention_biases_are_loaded(qwen2_model: Path, quant: str) -> None:
    """Each quantized projection gets its checkpoint bias as its bias and its checkpoint weight as its packed weight,
    whichever of the two arrives first."""
    ckpt = checkpoint(qwen2_model)
    bias_keys = sorted(k for k in ckpt if k.endswith(".bias"))
    assert len(bias_keys) == 3  # q, k, v of the single layer
    assert all(ckpt[k].abs().min() > 0 for k in bias_keys)  # precondition: no bias is zero by chance
    backend, loaded, calls = stream(qwen2_model, quant)
    assert calls == ["model.layers.0"]
    for key in bias_keys:
        name = key.removesuffix(".bias")
        module = loaded.model.get_submodule(name)
        assert backend.is_quantized(module), key
        bias = module._parameters.get("bias")
        assert isinstance(bias, nn.Parameter) and not bias.is_meta, key
        assert torch.equal(bias.detach(), ckpt[key]), key
        assert_packed_from(backend, module, ckpt[f"{name}.weight"], name)
        x = torch.randn(2, module.in_features, generator=torch.Generator().manual_seed(9))
        with torch.no_grad():
            torch.testing.assert_close(module(x), x @ module.dequantize().T + ckpt[key], rtol=1e-4, atol=1e-5)
    assert decoder_layer_classes(loaded.model)[0].__name__ == "Qwen2DecoderLayer"
    assert [c.__name__ for c in loaded.layer_classes] == ["Qwen2DecoderLayer"]


@pytest.mark.parametrize("quant", ["bnb", "none"])
def test_tied_embeddings_share_one_parameter(tied_model: Path, quant: str) -> None:
    ckpt = checkpoint(tied_model)
    assert "lm_head.weight" not in ckpt  # HF leaves the tied head out of the checkpoint
    _, loaded = load(tied_model, quant)
    model = loaded.model
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert not model.lm_head.weight.is_meta
    assert torch.equal(model.lm_head.weight.detach(), ckpt["model.embed_tokens.weight"])
    assert "lm_head" not in loaded.quantized
    assert loaded.head_name == "lm_head"


def test_decoder_layer_classes_for_llama(tiny_model: Path) -> None:
    _, loaded = shared(tiny_model, "none")
    classes = decoder_layer_classes(loaded.model)
    assert [c.__name__ for c in classes] == ["LlamaDecoderLayer"]
    assert loaded.layer_classes == classes
    assert sum(isinstance(m, classes) for m in loaded.model.modules()) == 2


def test_decoder_layer_classes_needs_no_split_modules() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 2)

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Block(), Block()])

    with pytest.raises(UserError) as info:
        decoder_layer_classes(Plain())
    assert "_no_split_modules" in str(info.value)
    assert "--model" in str(info.value)

    class Declared(Plain):
        _no_split_modules = ("Block",)

    assert decoder_layer_classes(Declared()) == (Block,)

    class WrongName(Plain):
        _no_split_modules = ("DecoderLayer",)  # names a class the model does not contain

    with pytest.raises(UserError):
        decoder_layer_classes(WrongName())


# --- bad model directories -----------------------------------------------------------------------------------------


def drop_tensor(src: Path, dst: Path, dropped: str) -> Path:
    path = copy_model(src, dst)
    index = json.loads((path / INDEX).read_text())
    shard = path / index["weight_map"].pop(dropped)
    tensors = load_file(str(shard))
    del tensors[dropped]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (path / INDEX).write_text(json.dumps(index))
    return path


@pytest.mark.parametrize(
    ("quant", "dropped"),
    [
        ("none", "model.layers.1.post_attention_layernorm.weight"),
        ("hqq", "model.layers.0.self_attn.q_proj.weight"),
        ("bnb", "model.norm.weight"),
    ],
)
def test_checkpoint_missing_a_tensor(tiny_model: Path, tmp_path: Path, quant: str, dropped: str) -> None:
    """A UserError names the missing tensor before any weight is read: the names in the files already show it,
    so no layer is handed on (sharded, quantized) for nothing."""
    path = drop_tensor(tiny_model, tmp_path / "model", dropped)
    calls: list[str] = []
    with pytest.raises(UserError) as info:
        stream(path, quant, on_ready=lambda _s, name, _l: calls.append(name))
    assert "lacks" in str(info.value)
    assert dropped in str(info.value)
    assert calls == []


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_missing_weight_of_a_quantized_layer_with_a_bias_is_named(
    qwen2_model: Path, tmp_path: Path, quant: str
) -> None:
    """The bias of a quantized projection arriving does not stand in for its missing weight."""
    dropped = "model.layers.0.self_attn.q_proj.weight"
    path = drop_tensor(qwen2_model, tmp_path / "model", dropped)
    with pytest.raises(UserError) as info:
        load(path, quant)
    assert dropped in str(info.value)


def test_deleted_shard_is_named(tiny_model: Path, tmp_path: Path) -> None:
    path = copy_model(tiny_model, tmp_path / "model")
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) == 2
    shards[1].unlink()
    with pytest.raises(UserError) as info:
        load(path, "bnb")
    assert shards[1].name in str(info.value)
    assert shards[0].name not in str(info.value)


def test_directory_without_config_json(tiny_model: Path, tmp_path: Path) -> None:
    path = copy_model(tiny_model, tmp_path / "model")
    (path / "config.json").unlink()
    with pytest.raises(UserError) as info:
        load(path, "none")
    assert "config.json" in str(info.value)
    assert "--model" in str(info.value)


def test_directory_without_weights(tiny_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "empty"
    path.mkdir()
    shutil.copy(tiny_model / "config.json", path / "config.json")
    with pytest.raises(UserError) as info:
        load(path, "none")
    assert "safetensors" in str(info.value)


def test_nonexistent_path(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "model"
    with pytest.raises(UserError) as info:
        load(missing, "bnb")
    assert "--model" in str(info.value)
    assert str(missing) in str(info.value)


# --- tokenizer ------------------------------------------------------------------------------------------------------


def test_tokenizer_keeps_its_own_pad(tiny_model: Path) -> None:
    tokenizer = load_tokenizer(tiny_model)
    assert tokenizer.pad_token == "<|pad|>"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id


def test_tokenizer_without_pad_pads_with_eos(tiny_model: Path, tmp_path: Path) -> None:
    path = copy_model(tiny_model, tmp_path / "model")
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        file = path / name
        if file.is_file():
            data = json.loads(file.read_text())
            data.pop("pad_token", None)
            file.write_text(json.dumps(data))
    assert AutoTokenizer.from_pretrained(path).pad_token_id is None  # the precondition really holds
    tokenizer = load_tokenizer(path)
    assert tokenizer.pad_token_id is not None
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    assert tokenizer.pad_token == "<|endoftext|>"


@pytest.mark.parametrize(
    "offsets", [[0, 10**9], [0, 8], [4, 0]], ids=["beyond-the-file", "more-bytes-than-the-tensor", "reversed"]
)
def test_a_header_whose_offsets_do_not_fit_is_refused_before_any_read(tmp_path: Path, offsets: list[int]) -> None:
    """The reader fills each tensor's memory straight from the file: a header must never make it write past it."""
    import json as _json

    from qlora_fsdp.model.formats.files import read_safetensors

    header = _json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": offsets}}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    with pytest.raises(UserError, match="corrupt header"):
        list(read_safetensors(path))


def test_a_model_directory_without_a_tokenizer_is_refused_in_one_line(tiny_model: Path, tmp_path: Path) -> None:
    """A saved model without its tokenizer (save_pretrained of the model alone) is named, with the fix."""
    from qlora_fsdp.model.hub import load_tokenizer

    (tmp_path / "config.json").write_text((tiny_model / "config.json").read_text())
    with pytest.raises(UserError, match=r"no tokenizer transformers can load there .*copy the base model's") as info:
        load_tokenizer(tmp_path)
    assert "\n" not in str(info.value)
