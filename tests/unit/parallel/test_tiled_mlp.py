"""--tiled_mlp in one process: the loaded, quantized, adapted model computes the same loss and gradients over tiles
of tokens as without them (dense Llama with bnb and HQQ; Mixtral and Qwen2-MoE, whose experts and shared expert
are tiled), and a tiled MLP keeps fewer bytes from forward to backward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from qlora_fsdp.config.options import LoraConfig, ModelConfig, QuantConfig, build_config
from qlora_fsdp.errors import UserError
from qlora_fsdp.model.lora import inject_lora, lora_layers
from qlora_fsdp.model.skeleton import build_skeleton
from qlora_fsdp.model.streaming import stream_weights
from qlora_fsdp.objectives.loss import CausalLMLoss
from qlora_fsdp.parallel.tiled_mlp import tile_count, tile_mlps, tiled_modules
from qlora_fsdp.quant import make_backend
from tests.conftest import randomize_adapters

CPU = torch.device("cpu")


def adapted(path: Path, quant: str) -> tuple[nn.Module, dict[str, nn.Module]]:
    """The training skeleton of `path`, loaded with `quant`, with LoRA adapters all non-zero (so every adapter
    parameter has a gradient); plus its decoder layers by name."""
    backend = make_backend(QuantConfig(quant=quant), storage_dtype=torch.uint8, compute_dtype=torch.float32)
    skeleton = build_skeleton(
        ModelConfig(model=str(path)), backend=backend, param_dtype=torch.float32, adapt_experts=True
    )
    lora = LoraConfig(lora_rank=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules="all")
    model = inject_lora(skeleton.model, lora, dtype=torch.float32)
    stream_weights(skeleton, backend=backend, device=CPU)
    randomize_adapters(lora_layers(model), seed=0)
    return model, skeleton.units


def loss_and_grads(root: nn.Module, vocab: int) -> tuple[float, float, dict[str, torch.Tensor]]:
    """Loss, gradient norm and gradients of a padded batch of two rows (40 and 29 tokens), whole logits."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, 40), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 29:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    root.zero_grad(set_to_none=True)
    loss = root(input_ids=ids, labels=labels, attention_mask=mask)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in root.named_parameters() if p.grad is not None}
    norm = torch.cat([g.flatten() for g in grads.values()]).norm().item()
    return loss.item(), norm, grads


def check_tiled_equals_untiled(path: Path, quant: str, setting: str) -> list[str]:
    model, units = adapted(path, quant)
    root = CausalLMLoss(model, chunk_tokens=0)
    vocab = model.config.vocab_size
    loss, norm, grads = loss_and_grads(root, vocab)
    tiled = tile_mlps(units, setting)
    tiled_loss, tiled_norm, tiled_grads = loss_and_grads(root, vocab)
    assert tiled_loss == pytest.approx(loss, rel=1e-6)
    assert tiled_norm == pytest.approx(norm, rel=1e-6)
    assert tiled_grads.keys() == grads.keys() and len(grads) > 0
    for name, grad in grads.items():  # a weight's gradient sums over tokens, tile by tile: rounding differs
        assert (tiled_grads[name] - grad).norm() <= 1e-5 * grad.norm(), name
    return tiled


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_dense_layers_tiled_compute_the_untiled_loss_and_gradients(tiny_model: Path, quant: str) -> None:
    tiled = check_tiled_equals_untiled(tiny_model, quant, "3")
    assert tiled == ["model.layers.0.mlp", "model.layers.1.mlp"]


@pytest.mark.parametrize(("family", "quant"), [("mixtral", "bnb"), ("qwen2_moe", "none")])
def test_experts_tiled_compute_the_untiled_loss_and_gradients(
    moe_models: dict[str, Path], family: str, quant: str
) -> None:
    """Quantized experts (ours) and transformers' own experts module with a shared expert."""
    tiled = check_tiled_equals_untiled(moe_models[family], quant, "4")
    expected = {"mlp.experts"} | ({"mlp.shared_expert"} if family == "qwen2_moe" else set())
    assert {name.split(".", 3)[3] for name in tiled} == expected


def test_a_tiled_mlp_keeps_fewer_bytes_for_backward(tiny_model: Path) -> None:
    """The bytes an MLP's forward saves for backward (outside the tiles' own checkpoints): its intermediate
    activations untiled, only what the tiles' inputs share tiled."""
    model, units = adapted(tiny_model, "bnb")
    mlp = units["model.layers.0"].mlp
    x = torch.randn(1, 256, model.config.hidden_size, requires_grad=True)

    def saved_bytes() -> int:
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            mlp(x).sum().backward()
        return total

    untiled = saved_bytes()
    tile_mlps({"model.layers.0": units["model.layers.0"]}, "4")
    assert saved_bytes() < untiled / 4, untiled


def test_tile_count() -> None:
    assert tile_count("3", 100, 64) == 3
    assert tile_count("auto", 4096, 1024) == 4
    assert tile_count("auto", 4097, 1024) == 5
    assert tile_count("auto", 100, 1024) == 1


def test_a_layer_without_an_mlp_is_refused_in_one_line() -> None:
    with pytest.raises(UserError, match=r"--tiled_mlp: Linear has no MLP under any of the names mlp"):
        tiled_modules(nn.Linear(2, 2))


@pytest.mark.parametrize(("value", "ok"), [("0", True), ("4", True), ("auto", True), ("-1", False), ("x", False)])
def test_flag_values(value: str, ok: bool) -> None:
    cfg = build_config({"model": "some/model", "tiled_mlp": value})
    if ok:
        cfg.validate()
    else:
        with pytest.raises(UserError, match="--tiled_mlp must be N tiles or auto"):
            cfg.validate()
