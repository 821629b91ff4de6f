"""qlora_fsdp.objectives.loss: the chunked loss equals the whole-logit loss, value and gradients, for every head it
serves."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

from qlora_fsdp.data import IGNORE_INDEX
from qlora_fsdp.objectives.loss import CausalLMLoss, chunked_loss_sum, full_loss_sum

VOCAB, HIDDEN = 301, 24


def _labels(generator: torch.Generator, batch: int, seq: int, *, masked: bool) -> torch.Tensor:
    labels = torch.randint(0, VOCAB, (batch, seq), generator=generator)
    if masked:  # a prompt prefix and scattered padding carry no label
        labels[:, : seq // 3] = IGNORE_INDEX
        labels[torch.rand(batch, seq, generator=generator) < 0.2] = IGNORE_INDEX
    return labels


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    """Relative error of the whole tensor (fp32 rounding differs with the matmul shapes, element by element)."""
    return bool(torch.linalg.vector_norm(a - b) <= rel * torch.linalg.vector_norm(b))


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_frozen_head_chunks_equal_whole_logits(masked: bool, chunk: int) -> None:
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    head = nn.Linear(HIDDEN, VOCAB, bias=True).requires_grad_(False)
    hidden = torch.randn(3, 40, HIDDEN, generator=g, requires_grad=True)
    labels = _labels(g, 3, 40, masked=masked)

    whole = full_loss_sum(head(hidden), labels)
    (grad_whole,) = torch.autograd.grad(whole, hidden)
    chunked = chunked_loss_sum(hidden, head, labels, chunk_tokens=chunk)
    (grad_chunked,) = torch.autograd.grad(chunked, hidden)

    assert chunked.item() == pytest.approx(whole.item(), rel=1e-6)
    assert _close(grad_chunked, grad_whole, 1e-6)
    assert grad_whole.abs().sum() > 0


def test_trained_linear_head_gets_its_weight_and_bias_gradients() -> None:
    g = torch.Generator().manual_seed(2)
    torch.manual_seed(2)
    head = nn.Linear(HIDDEN, VOCAB, bias=True)
    hidden = torch.randn(2, 30, HIDDEN, generator=g, requires_grad=True)
    labels = _labels(g, 2, 30, masked=True)
    inputs = [hidden, head.weight, head.bias]
    whole = torch.autograd.grad(full_loss_sum(head(hidden), labels), inputs)
    chunked = torch.autograd.grad(chunked_loss_sum(hidden, head, labels, chunk_tokens=4), inputs)
    for a, b in zip(chunked, whole, strict=True):
        assert _close(a, b, 1e-6) and b.abs().sum() > 0


def test_frozen_head_keeps_no_logits_for_backward() -> None:
    """What autograd saves for the loss is one gradient row per label token, not one logit per vocabulary entry."""
    g = torch.Generator().manual_seed(1)
    head = nn.Linear(HIDDEN, 5000, bias=False).requires_grad_(False)
    hidden = torch.randn(2, 64, HIDDEN, generator=g, requires_grad=True)
    labels = torch.randint(0, 5000, (2, 64), generator=g)
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_loss_sum(hidden, head, labels, chunk_tokens=16)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        full_before = len(saved)
        full_loss_sum(head(hidden), labels)
    chunked_floats, full_floats = sum(saved[:full_before]), sum(saved[full_before:])
    assert full_floats >= 2 * 63 * 5000  # the whole logits (and their fp32 copy's softmax) wait for backward
    assert chunked_floats <= 2 * 2 * 64 * HIDDEN  # states-sized tensors only


def _llama(tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN * 2, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tie, attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(config).float()


def _loss_and_grads(model: nn.Module, chunk: int, batch: dict) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = CausalLMLoss(model, chunk_tokens=chunk)(**batch)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _batch(seed: int, *, packed: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (2, 32), generator=g)
    labels = _labels(g, 2, 32, masked=True)
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}
    if packed:  # three samples in each row: positions restart, and no label reaches across a boundary
        batch["position_ids"] = torch.cat([torch.arange(10), torch.arange(12), torch.arange(10)]).repeat(2, 1)
        batch["labels"][:, [10, 22]] = IGNORE_INDEX
        batch.pop("attention_mask")
    return batch


@pytest.mark.parametrize(
    ("case", "packed"), [("frozen-head", False), ("frozen-head", True), ("lora-on-head", False), ("tied-full", False)]
)
def test_model_loss_and_every_gradient_match_whole_logits(case: str, packed: bool) -> None:
    """Through the model: position_ids reach the decoder on the chunked path too; a LoRA head (checkpointed chunks)
    and a trained tied embedding (the linear head's own gradient) get the same gradients as from whole logits."""
    model = _llama(tie=case == "tied-full")
    if case != "tied-full":
        targets = ["q_proj", "v_proj"] + (["lm_head"] if case == "lora-on-head" else [])
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    batch = _batch(3, packed=packed)
    whole_loss, whole = _loss_and_grads(model, 0, batch)
    chunked_loss, chunked = _loss_and_grads(model, 5, batch)
    assert CausalLMLoss(model, chunk_tokens=5).chunked
    assert chunked_loss == pytest.approx(whole_loss, rel=1e-6)
    assert chunked.keys() == whole.keys() and whole
    if case == "lora-on-head":
        assert any("lm_head.lora_B" in n for n in whole)
    if case == "tied-full":
        assert "model.embed_tokens.weight" in whole
    for name in whole:
        assert _close(chunked[name], whole[name], 1e-6), name


def test_packed_positions_change_the_loss() -> None:
    """Control for the packed case above: the positions are really used, so dropping them would be caught."""
    model = _llama()
    batch = _batch(3, packed=True)
    with torch.no_grad():
        packed = CausalLMLoss(model, chunk_tokens=5)(**batch)
        unpacked = CausalLMLoss(model, chunk_tokens=5)(**{k: v for k, v in batch.items() if k != "position_ids"})
    assert packed.item() != pytest.approx(unpacked.item(), rel=1e-4)


def test_no_label_token_gives_zero_loss_and_still_reaches_every_layer() -> None:
    """A rank whose batch has no label token must still run backward through every layer (FSDP's hooks)."""
    model = _llama()
    batch = _batch(4)
    batch["labels"][:] = IGNORE_INDEX
    loss = CausalLMLoss(model, chunk_tokens=5)(**batch)
    loss.backward()
    assert loss.item() == 0.0
    assert all(p.grad is not None and not p.grad.any() for n, p in model.named_parameters() if "lm_head" not in n)


def test_logit_softcapping_is_left_to_the_model() -> None:
    """Gemma-2 caps logits with tanh after the head: the chunked path would drop it, so its forward is used whole."""
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, final_logit_softcapping=0.05, attn_implementation="eager",
    )  # fmt: skip
    model = Gemma2ForCausalLM(config).float()
    batch = _batch(5)
    wrapped = CausalLMLoss(model, chunk_tokens=5)
    assert not wrapped.chunked
    with torch.no_grad():
        capped = full_loss_sum(model(input_ids=batch["input_ids"]).logits, batch["labels"])
        uncapped = chunked_loss_sum(
            model.model(input_ids=batch["input_ids"]).last_hidden_state, model.lm_head, batch["labels"], chunk_tokens=5
        )
        assert wrapped(**batch).item() == pytest.approx(capped.item(), rel=1e-6)
    assert capped.item() != pytest.approx(uncapped.item(), rel=1e-3)


def test_bf16_head_stays_close_to_whole_logits() -> None:
    g = torch.Generator().manual_seed(6)
    head = nn.Linear(HIDDEN, VOCAB, bias=False).to(torch.bfloat16).requires_grad_(False)
    hidden = torch.randn(2, 30, HIDDEN, generator=g).to(torch.bfloat16).requires_grad_()
    labels = _labels(g, 2, 30, masked=True)
    whole = full_loss_sum(head(hidden), labels)
    (grad_whole,) = torch.autograd.grad(whole, hidden)
    chunked = chunked_loss_sum(hidden, head, labels, chunk_tokens=8)
    (grad_chunked,) = torch.autograd.grad(chunked, hidden)
    assert grad_chunked.dtype == torch.bfloat16
    assert chunked.item() == pytest.approx(whole.item(), rel=1e-2)
    assert _close(grad_chunked.float(), grad_whole.float(), 2e-2)
