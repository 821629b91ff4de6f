"""qlora_fsdp.model: streaming a safetensors checkpoint into a quantized skeleton, per rank, and its error messages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from qlora_fsdp.config import ModelConfig, QuantConfig
from qlora_fsdp.distributed import DistEnv
from qlora_fsdp.errors import UserError
from qlora_fsdp.model import decoder_layer_classes, load_model, load_tokenizer
from qlora_fsdp.quant import QuantBackend, make_backend
from scripts.make_tiny_model import build_tiny_model

CPU = torch.device("cpu")
INDEX = "model.safetensors.index.json"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def env(rank: int, world: int = 2) -> DistEnv:
    return DistEnv(rank, 0, world, world, CPU, "gloo")


def backend_for(quant: str, dtype: torch.dtype = torch.bfloat16) -> QuantBackend | None:
    return make_backend(QuantConfig(quant=quant), storage_dtype=dtype, compute_dtype=dtype)


def load(
    path: Path,
    quant: str = "bnb",
    *,
    rank: int = 0,
    low_memory: bool = True,
    param_dtype: torch.dtype = torch.bfloat16,
):
    backend = backend_for(quant, param_dtype)
    loaded = load_model(
        ModelConfig(model=str(path), low_memory=low_memory), backend=backend, env=env(rank), param_dtype=param_dtype
    )
    return backend, loaded


_SHARED: dict[tuple, tuple] = {}


def shared(
    path: Path, quant: str = "bnb", *, rank: int = 0, low_memory: bool = True, param_dtype: torch.dtype = torch.bfloat16
):
    """`load` memoised for tests that only read the result (HQQ's quantizer is the slow part of the suite)."""
    key = (str(path), quant, rank, low_memory, param_dtype)
    if key not in _SHARED:
        _SHARED[key] = load(path, quant, rank=rank, low_memory=low_memory, param_dtype=param_dtype)
    return _SHARED[key]


@pytest.fixture(scope="module", autouse=True)
def _forget_shared_models():
    yield
    _SHARED.clear()


def checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the model directory, read with safetensors directly."""
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def linear_names(ckpt: dict[str, torch.Tensor]) -> list[str]:
    """Qualified names of the projection linears, read off the checkpoint's keys."""
    return sorted(k.removesuffix(".weight") for k in ckpt if k.removesuffix(".weight").endswith(PROJECTIONS))


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def qwen2_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2", seed=3, num_layers=1)


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-tied"), seed=4, num_layers=1, tie_word_embeddings=True)


# --- where tensors live per rank ----------------------------------------------------------------------------------


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_rank0_holds_real_tensors_and_quantizes_every_projection(tiny_model: Path, quant: str) -> None:
    backend, loaded = shared(tiny_model, quant, rank=0)
    ckpt = checkpoint(tiny_model)
    model = loaded.model
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    assert not meta, meta
    assert sorted(loaded.quantized) == linear_names(ckpt)
    for name in loaded.quantized:
        assert backend.is_quantized(model.get_submodule(name)), name
    assert "lm_head" not in loaded.quantized
    assert type(model.lm_head) is nn.Linear
    assert loaded.path == tiny_model


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_quantized_weights_come_from_their_own_checkpoint_tensor(tiny_model: Path, quant: str) -> None:
    """Each quantized layer dequantizes to its own checkpoint weight (4-bit error bound as in test_quant)."""
    backend, loaded = shared(tiny_model, quant, param_dtype=torch.float32)
    ckpt = checkpoint(tiny_model)
    for name in loaded.quantized:
        weight = ckpt[f"{name}.weight"]
        deq = backend.dequantize(loaded.model.get_submodule(name)).float()
        assert deq.shape == weight.shape, name
        assert (deq - weight).abs().mean() < 0.2 * weight.std(), name


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_low_memory_rank1_is_meta_with_real_identical_quant_state(tiny_model: Path, quant: str) -> None:
    backend, main = shared(tiny_model, quant, rank=0)
    _, other = shared(tiny_model, quant, rank=1)
    main_params = dict(main.model.named_parameters())
    other_params = dict(other.model.named_parameters())
    assert set(other_params) == set(main_params)
    for name, param in other_params.items():
        assert param.is_meta, name
        # Same shape and dtype as rank 0's real tensor, so the broadcast at wrap time fits.
        assert (param.shape, param.dtype) == (main_params[name].shape, main_params[name].dtype), name
    assert sorted(other.quantized) == sorted(main.quantized)
    for name in main.quantized:
        main_state = backend.quant_state_tensors(main.model.get_submodule(name))
        other_state = backend.quant_state_tensors(other.model.get_submodule(name))
        assert main_state and set(other_state) == set(main_state), name
        for key, value in other_state.items():
            assert not value.is_meta, (name, key)
            assert torch.equal(value, main_state[key]), (name, key)


@pytest.mark.parametrize("quant", ["bnb", "hqq", "none"])
def test_without_low_memory_rank1_is_real_and_equal_to_rank0(tiny_model: Path, quant: str) -> None:
    _, main = shared(tiny_model, quant, rank=0)  # rank 0 keeps real tensors either way
    _, other = load(tiny_model, quant, rank=1, low_memory=False)
    main_params = dict(main.model.named_parameters())
    for name, param in other.model.named_parameters():
        assert not param.is_meta, name
        a, b = param.detach(), main_params[name].detach()
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_unquantized_params_are_the_checkpoint_in_param_dtype(
    tiny_model: Path, quant: str, param_dtype: torch.dtype
) -> None:
    backend, loaded = shared(tiny_model, quant, param_dtype=param_dtype)
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
        assert not param.requires_grad, name
    for name in quantized:
        assert backend.packed(loaded.model.get_submodule(name)).dtype == param_dtype, name


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_no_backend_loads_every_weight_unchanged(tiny_model: Path, param_dtype: torch.dtype) -> None:
    _, loaded = load(tiny_model, "none", param_dtype=param_dtype)
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
    _, loaded = load(tiny_model, "none", param_dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 99, 3, 250, 42, 7, 8]])
    with torch.no_grad():
        ours = loaded.model.eval()(input_ids=ids).logits
        theirs = reference(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_single_file_checkpoint_loads(tiny_model: Path, tmp_path: Path) -> None:
    path = copy_model(tiny_model, tmp_path / "single")
    ckpt = checkpoint(tiny_model)
    for shard in path.glob("*.safetensors"):
        shard.unlink()
    (path / INDEX).unlink()
    save_file(ckpt, str(path / "model.safetensors"), metadata={"format": "pt"})
    _, loaded = load(path, "none", param_dtype=torch.float32)
    for name, param in loaded.model.named_parameters():
        assert torch.equal(param.detach(), ckpt[name]), name


# --- architecture variants -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_qwen2_attention_biases_are_loaded(qwen2_model: Path, quant: str) -> None:
    backend, loaded = load(qwen2_model, quant, param_dtype=torch.float32)
    ckpt = checkpoint(qwen2_model)
    bias_keys = sorted(k for k in ckpt if k.endswith(".bias"))
    assert len(bias_keys) == 3  # q, k, v of the single layer
    for key in bias_keys:
        module = loaded.model.get_submodule(key.removesuffix(".bias"))
        assert backend.is_quantized(module), key
        bias = module._parameters.get("bias")
        assert isinstance(bias, nn.Parameter) and not bias.is_meta, key
        assert torch.equal(bias.detach(), ckpt[key]), key
    assert decoder_layer_classes(loaded.model)[0].__name__ == "Qwen2DecoderLayer"
    assert [c.__name__ for c in loaded.layer_classes] == ["Qwen2DecoderLayer"]


@pytest.mark.parametrize("quant", ["bnb", "none"])
def test_tied_embeddings_share_one_parameter(tied_model: Path, quant: str) -> None:
    ckpt = checkpoint(tied_model)
    assert "lm_head.weight" not in ckpt  # HF leaves the tied head out of the checkpoint
    _, loaded = load(tied_model, quant, param_dtype=torch.float32)
    model = loaded.model
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert not model.lm_head.weight.is_meta
    assert torch.equal(model.lm_head.weight.detach(), ckpt["model.embed_tokens.weight"])
    assert "lm_head" not in loaded.quantized

    _, other = load(tied_model, quant, rank=1, param_dtype=torch.float32)
    assert other.model.lm_head.weight is other.model.get_input_embeddings().weight


def test_decoder_layer_classes_for_llama(tiny_model: Path) -> None:
    _, loaded = load(tiny_model, "none", param_dtype=torch.float32)
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


@pytest.mark.parametrize(
    ("quant", "dropped"),
    [("none", "model.layers.1.post_attention_layernorm.weight"), ("hqq", "model.layers.0.self_attn.q_proj.weight")],
)
def test_checkpoint_missing_a_tensor(tiny_model: Path, tmp_path: Path, quant: str, dropped: str) -> None:
    path = copy_model(tiny_model, tmp_path / "model")
    index = json.loads((path / INDEX).read_text())
    shard = path / index["weight_map"].pop(dropped)
    tensors = load_file(str(shard))
    del tensors[dropped]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (path / INDEX).write_text(json.dumps(index))
    with pytest.raises(UserError) as info:
        load(path, quant)
    assert "lacks" in str(info.value)
    assert dropped in str(info.value)


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
