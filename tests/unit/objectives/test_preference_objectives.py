"""The preference objectives on a fresh adapter (LoRA B = 0, so the policy is the base model): each loss equals its
formula on the base model's log-probs, computed here from transformers' own logits."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from qlora_fsdp.config.options import ObjectiveConfig
from qlora_fsdp.data import IGNORE_INDEX
from qlora_fsdp.data.rows import collate
from qlora_fsdp.objectives.base import Forward, combined_loss
from qlora_fsdp.objectives.loss import CausalLMLoss
from qlora_fsdp.objectives.setup import make_objective
from qlora_fsdp.parallel.precision import PRECISIONS


@pytest.fixture(scope="module")
def models(tiny_model: Path) -> tuple[torch.nn.Module, CausalLMLoss]:
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    peft = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0),
    )
    return base.eval(), CausalLMLoss(peft, chunk_tokens=5).eval()


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    """3 pairs, prompts of 4-6 tokens, replies of 2-7."""
    gen = torch.Generator().manual_seed(3)
    items = []
    for prompt, chosen, rejected in ((4, 3, 7), (6, 2, 2), (5, 5, 3)):
        ids = torch.randint(0, vocab, (prompt + max(chosen, rejected),), generator=gen).tolist()
        other = torch.randint(0, vocab, (rejected,), generator=gen).tolist()
        c, r = ids[: prompt + chosen], ids[:prompt] + other
        items.append({"input_ids": c, "labels": [IGNORE_INDEX] * prompt + c[prompt:], "rejected_input_ids": r,
                      "rejected_labels": [IGNORE_INDEX] * prompt + other, "pair_index": [len(items)]})  # fmt: skip
    return collate(items, pad_id=0, context_length=64, pad_to_context=False)


def _base_logps(base: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed reply log-probs, reply tokens) per sequence, from the base model's whole logits."""
    with torch.no_grad():
        logits = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    labels = batch["labels"][:, 1:]
    mask = labels != IGNORE_INDEX
    token = torch.gather(logits[:, :-1].log_softmax(-1), 2, labels.clamp(min=0)[..., None]).squeeze(-1)
    return (token * mask).sum(1), mask.sum(1)


def _loss(model: CausalLMLoss, name: str, batch: dict[str, torch.Tensor], **settings: float) -> tuple[float, dict]:
    objective = make_objective(ObjectiveConfig(objective=name, **settings),
                               Forward(torch.device("cpu"), PRECISIONS["fp32"]))  # fmt: skip
    with torch.no_grad():
        parts, metrics = objective.loss_sum(model, batch)
    weights = torch.tensor(objective.weights(batch), dtype=torch.float64)
    logged = objective.logged(metrics.tolist(), weights.tolist())
    return combined_loss(parts.double(), weights).item(), logged


def test_dpo_and_ipo_start_at_their_reference_values(models, tiny_model: Path) -> None:
    base, model = models
    batch = _batch(base.config.vocab_size)
    loss, logged = _loss(model, "dpo", batch)
    assert abs(loss - math.log(2)) < 1e-6
    assert logged["rewards/chosen"] == logged["rewards/rejected"] == logged["rewards/accuracies"] == 0.0
    loss, _ = _loss(model, "ipo", batch, beta=0.3)
    assert abs(loss - (1 / 0.6) ** 2) < 1e-5
    logps, _ = _base_logps(base, batch)
    chosen, rejected = logps.chunk(2)
    assert abs(logged["logps/chosen"] - chosen.mean().item()) < 1e-4
    assert abs(logged["logps/rejected"] - rejected.mean().item()) < 1e-4


def test_orpo_and_simpo_are_their_formulas_on_the_base_log_probs(models) -> None:
    base, model = models
    batch = _batch(base.config.vocab_size)
    logps, tokens = _base_logps(base, batch)
    average = logps / tokens
    chosen, rejected = average.double().chunk(2)
    beta, gamma = 2.0, 0.7
    simpo = -F.logsigmoid(beta * (chosen - rejected) - gamma).mean().item()
    loss, logged = _loss(model, "simpo", batch, beta=beta, simpo_gamma=gamma)
    assert abs(loss - simpo) < 1e-5, (loss, simpo)
    assert abs(logged["rewards/chosen"] - beta * chosen.mean().item()) < 1e-5
    lam = 0.25
    odds = (chosen - rejected) - (torch.log1p(-chosen.exp()) - torch.log1p(-rejected.exp()))
    nll = -logps.chunk(2)[0].double().sum().item() / tokens.chunk(2)[0].sum().item()  # per chosen reply token
    orpo = nll - lam * F.logsigmoid(odds).mean().item()
    loss, logged = _loss(model, "orpo", batch, orpo_lambda=lam)
    assert abs(loss - orpo) < 1e-5, (loss, orpo)
    assert abs(logged["log_odds_chosen"] - odds.mean().item()) < 1e-5


def test_the_reference_is_the_base_model_once_the_adapter_moved(models) -> None:
    """A non-zero B moves the policy; the reference forward (adapters off) must still be the base model, which a
    reference computed with the adapters on would not be (its rewards would stay 0)."""
    base, model = models
    batch = _batch(base.config.vocab_size)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 1.0, generator=torch.Generator().manual_seed(len(name)))
    try:
        _, logged = _loss(model, "dpo", batch, beta=0.5)
        logps, _ = _base_logps(base, batch)
        policy = torch.tensor([logged["logps/chosen"], logged["logps/rejected"]])
        reference = torch.stack([part.mean() for part in logps.chunk(2)])
        rewards = torch.tensor([logged["rewards/chosen"], logged["rewards/rejected"]])
        assert (policy - reference).abs().min() > 1e-2  # the adapter moved the policy
        assert torch.allclose(rewards, 0.5 * (policy - reference), atol=1e-5)
    finally:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.zero_()


def test_log1mexp_has_finite_gradients_up_to_certainty() -> None:
    """ORPO's log(1 - exp(p)) of an average log-prob p: a reply certain to within rounding (p -> 0) and a very
    unlikely one keep a finite loss and gradient (the unselected branch of a plain where would make 0/0)."""
    from qlora_fsdp.objectives.preference import log1mexp

    x = torch.tensor([-1e-9, 0.0, -0.3, -2.0, -60.0], dtype=torch.float32, requires_grad=True)
    y = log1mexp(x)
    y.sum().backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    exact = torch.log(-torch.expm1(x.detach()[2:].double()))
    assert torch.allclose(y[2:].double(), exact, rtol=1e-6)


def test_every_objective_the_config_accepts_is_built() -> None:
    """Each built-in spec's run class builds an objective of its own."""
    from qlora_fsdp.objectives.base import Objective
    from qlora_fsdp.objectives.specs import OBJECTIVES

    forward = Forward(torch.device("cpu"), PRECISIONS["fp32"])
    built = {name: make_objective(ObjectiveConfig(objective=name), forward) for name in OBJECTIVES}
    assert all(isinstance(objective, Objective) for objective in built.values())
    assert len({type(objective) for objective in built.values()}) == len(OBJECTIVES)
