"""qlora_fsdp.objectives.preference against TRL's own code (a test-only dependency).

On one fixed batch of pairs (prompts and replies of different lengths, right padding), the tiny Llama with a LoRA
adapter whose B matrices are non-zero (so the policy is not the reference), each objective's loss, rewards and
log-probs, and the loss's gradient on the adapter, equal what TRL computes on the same model and tokens, within 1e-5
in fp32. TRL's side is its trainers' real code: DPOTrainer._compute_loss (DPO, IPO; reference: the adapters
disabled, as for a new adapter), ORPOTrainer.get_batch_loss_metrics and CPOTrainer.get_batch_loss_metrics (SimPO:
loss_type simpo, cpo_alpha 0), each trainer built from the base model and the LoRA config, the B matrices then
drawn as if the adapter had trained. Our side runs CausalLMLoss with a 7-token head chunk (and whole logits).

Known difference, by design: ORPO's cross-entropy is over the chosen reply's tokens (the paper's), TRL's over the
prompt's and the reply's; the ORPO tests compare that term with a cross-entropy over the reply tokens instead, and
TRL's whole ORPO loss where the two coincide (one-token prompts). Measured on this batch: every difference is below
6e-6 absolute (the largest, IPO's loss of about 25) and the gradients agree to about 1e-6 relative.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import Trainer
from trl.trainer.dpo_trainer import DataCollatorForPreference

from qlora_fsdp.config.options import ObjectiveConfig
from qlora_fsdp.data import IGNORE_INDEX
from qlora_fsdp.data.rows import collate
from qlora_fsdp.objectives.loss import PER_ROW, CausalLMLoss
from qlora_fsdp.objectives.preference import DpoObjective
from qlora_fsdp.objectives.setup import make_objective
from tests.trl_parity import (
    FP32,
    PAD,
    TOL,
    assert_metrics,
    grad,
    last_metrics,
    lora_params,
    ours,
    rel,
    trl_trainer,
)

# (prompt, chosen, rejected) lengths: rows of different widths, chosen longer or shorter than rejected.
LENGTHS = ((5, 4, 6), (1, 7, 3), (9, 2, 5))
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")  # fmt: skip
Pair = tuple[list[int], list[int], list[int]]


def _pairs(lengths: tuple[tuple[int, int, int], ...] = LENGTHS, seed: int = 4) -> list[Pair]:
    """Random (prompt, chosen, rejected) token ids, off the special tokens (0-2). Seed 4: under the perturbed
    adapter DPO prefers the chosen side in 2 of the 3 pairs, ORPO and SimPO in 1, so no reward accuracy is 0 or 1."""
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(3, 500, (n,), generator=g).tolist() for n in sides) for sides in lengths]


def _our_batch(pairs: list[Pair], pair_index: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Our layout (data.rows.collate): 2B rows, chosen sides first, labels on the reply tokens only."""
    items = [
        {"input_ids": p + c, "labels": [IGNORE_INDEX] * len(p) + c, "rejected_input_ids": p + r,
         "rejected_labels": [IGNORE_INDEX] * len(p) + r, "pair_index": [i if pair_index is None else pair_index[i]]}
        for i, (p, c, r) in enumerate(pairs)
    ]  # fmt: skip
    return collate(items, pad_id=PAD, context_length=64, pad_to_context=False)


def _model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CausalLMLoss's arguments from our batch."""
    return {k: batch[k] for k in ("input_ids", "labels", "attention_mask")}


def _dpo_inputs(pairs: list[Pair]) -> dict[str, torch.Tensor]:
    """DPOTrainer's layout, by its own collator: input_ids, attention_mask, completion_mask."""
    return DataCollatorForPreference(pad_token_id=PAD)(
        [{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r} for p, c, r in pairs]
    )


def _cpo_inputs(pairs: list[Pair]) -> dict[str, torch.Tensor]:
    """ORPOTrainer's and CPOTrainer's layout (what their tokenize_row makes), by their own collator."""
    from trl.experimental.utils import DPODataCollatorWithPadding

    features = []
    for p, c, r in pairs:
        row: dict[str, list[int]] = {"prompt_input_ids": p, "prompt_attention_mask": [1] * len(p)}
        for side, reply in (("chosen", c), ("rejected", r)):
            row |= {f"{side}_input_ids": p + reply, f"{side}_attention_mask": [1] * (len(p) + len(reply)),
                    f"{side}_labels": [IGNORE_INDEX] * len(p) + reply}  # fmt: skip
        features.append(row)
    return DPODataCollatorWithPadding(pad_token_id=PAD)(features)


# --- DPO and IPO: DPOTrainer._compute_loss ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dpo_trainers(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Trainer]:
    out = tmp_path_factory.mktemp("trl-dpo")
    # Conservative DPO (label smoothing e): TRL 1.16's DPOTrainer has no such loss type any more, but it combines
    # types: 2(1 - e) x sigmoid - (1 - 2e) x robust = -(1 - e) logsig(z) - e logsig(-z), robust being
    # (-(1 - e) logsig(z) + e logsig(-z)) / (1 - 2e).
    e = 0.1
    settings = {
        "dpo": {"beta": 0.5, "loss_type": "sigmoid"},
        "cdpo": {"beta": 0.5, "label_smoothing": e, "loss_type": ["sigmoid", "robust"],
                 "loss_weights": [2 * (1 - e), -(1 - 2 * e)]},
        "ipo": {"beta": 0.1, "loss_type": "ipo"},
    }  # fmt: skip
    return {case: trl_trainer("dpo", tiny_model, out / case, **kw) for case, kw in settings.items()}


DPO_CASES = {
    "dpo": ObjectiveConfig(objective="dpo", beta=0.5),
    "cdpo": ObjectiveConfig(objective="dpo", beta=0.5, label_smoothing=0.1),
    "ipo": ObjectiveConfig(objective="ipo", beta=0.1),
}


# The whole-logits path (chunk 0) once per trainer: it is the same for every objective.
@pytest.mark.parametrize(("case", "chunk"), [("dpo", 7), ("dpo", 0), ("cdpo", 7), ("ipo", 7)])
def test_dpo_and_ipo_equal_trl(dpo_trainers: dict[str, Trainer], case: str, chunk: int) -> None:
    """Loss, rewards, log-probs and the adapter's gradient. A reference other than the adapters-off model, a wrong
    per-token normalisation (IPO) or label-smoothing form, or misaligned rows would each break it."""
    trainer = dpo_trainers[case]
    model = trainer.model
    params = lora_params(model)
    pairs = _pairs()
    trl_loss = trainer._compute_loss(model, _dpo_inputs(pairs), return_outputs=False)
    trl_metrics = last_metrics(trainer)
    objective = make_objective(DPO_CASES[case], FP32)
    loss, _, metrics = ours(objective, CausalLMLoss(model, chunk_tokens=chunk), _our_batch(pairs))

    assert loss.item() == pytest.approx(trl_loss.item(), rel=TOL, abs=TOL)
    assert_metrics(metrics, trl_metrics, METRICS)
    assert abs(metrics["rewards/margins"]) > 1e-2  # the adapter moved the policy off the reference
    assert rel(grad(loss, params), grad(trl_loss, params)) < TOL


def test_label_smoothing_matches_cpo_sigmoid_formula(
    dpo_trainers: dict[str, Trainer], tiny_model: Path, tmp_path: Path
) -> None:
    """Conservative DPO also equals the formula TRL keeps in CPOTrainer.cpo_loss (loss_type sigmoid), fed the
    log-ratios against TRL's DPO reference: pair by pair, not only on average."""
    trainer = dpo_trainers["cdpo"]
    model, pairs = trainer.model, _pairs()
    cpo = trl_trainer("cpo", tiny_model, tmp_path, loss_type="sigmoid", beta=0.5, label_smoothing=0.1, cpo_alpha=0.0)
    with torch.no_grad():
        logps = -CausalLMLoss(model, chunk_tokens=7)(**_model_inputs(_our_batch(pairs)), request=PER_ROW)
        ref_chosen, ref_rejected = trainer.compute_ref_log_probs(model, _dpo_inputs(pairs))
    chosen, rejected = logps[:3] - ref_chosen, logps[3:] - ref_rejected
    trl_losses, trl_chosen_rewards, trl_rejected_rewards = cpo.cpo_loss(chosen, rejected)
    ours = DpoObjective(FP32, beta=0.5, label_smoothing=0.1).loss(chosen, rejected, torch.ones(6))
    torch.testing.assert_close(ours, trl_losses, rtol=TOL, atol=TOL)
    torch.testing.assert_close(trl_chosen_rewards, 0.5 * chosen)
    torch.testing.assert_close(trl_rejected_rewards, 0.5 * rejected)
    unsmoothed = DpoObjective(FP32, beta=0.5).loss(chosen, rejected, torch.ones(6))
    assert (ours - unsmoothed).abs().min() > 100 * TOL  # the smoothing changes every pair's loss, far past TOL


def test_precomputed_reference_equals_trl(dpo_trainers: dict[str, Trainer]) -> None:
    """--precompute_reference: the pairs' reference log-probs looked up by pair_index (here out of order, in a
    table of more pairs) give TRL's loss; chosen and rejected swapped, or pairs misindexed, they would not."""
    trainer = dpo_trainers["dpo"]
    model, pairs = trainer.model, _pairs()
    trl_loss = trainer._compute_loss(model, _dpo_inputs(pairs), return_outputs=False).item()
    trl_metrics = last_metrics(trainer)
    index = [5, 0, 3]
    with torch.no_grad():
        ref_chosen, ref_rejected = trainer.compute_ref_log_probs(model, _dpo_inputs(pairs))
    table = torch.full((6, 2), float("nan"))
    table[index] = torch.stack([ref_chosen, ref_rejected], dim=1)
    objective = make_objective(DPO_CASES["dpo"], FP32, reference=lambda pair_index: table[pair_index])
    loss, _, metrics = ours(objective, CausalLMLoss(model, chunk_tokens=7), _our_batch(pairs, index))
    assert loss.item() == pytest.approx(trl_loss, rel=TOL, abs=TOL)
    assert_metrics(metrics, trl_metrics, METRICS)


def test_control_reference_with_adapters_on_is_not_trl(dpo_trainers: dict[str, Trainer]) -> None:
    """The parity above is not vacuous: a reference run with the adapters on (the policy itself) gives log 2 for
    every pair, far from TRL's loss, and so would a test whose adapter did nothing."""
    trainer = dpo_trainers["dpo"]
    model, pairs = trainer.model, _pairs()
    trl_loss = trainer._compute_loss(model, _dpo_inputs(pairs), return_outputs=False).item()
    lm = CausalLMLoss(model, chunk_tokens=7)
    batch = _our_batch(pairs)

    class AdaptersOn(DpoObjective):
        def reference_logps(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            with torch.no_grad():
                return -self.forward(model, batch, PER_ROW)

    wrong, _, metrics = ours(AdaptersOn(FP32, beta=0.5), lm, batch)
    assert wrong.item() == pytest.approx(math.log(2), abs=1e-6)
    assert metrics["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert abs(wrong.item() - trl_loss) > 1e3 * TOL
    right, _, _ = ours(make_objective(DPO_CASES["dpo"], FP32), lm, batch)
    assert right.item() == pytest.approx(trl_loss, rel=TOL, abs=TOL)


# --- ORPO: ORPOTrainer ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def orpo_trainer(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Trainer:
    return trl_trainer("orpo", tiny_model, tmp_path_factory.mktemp("trl-orpo"), beta=0.2)


ORPO = ObjectiveConfig(objective="orpo", orpo_lambda=0.2)
ORPO_METRICS = (*METRICS, "log_odds_ratio", "log_odds_chosen")


@pytest.mark.parametrize("chunk", [7, 0], ids=["chunked", "whole"])
def test_orpo_odds_ratio_and_metrics_equal_trl(orpo_trainer: Trainer, chunk: int) -> None:
    """The odds-ratio term, rewards, average log-probs and log-odds equal TRL's; the cross-entropy term is over the
    chosen reply's tokens (the paper's), where TRL's concatenated_forward takes prompt and reply: it is checked
    against a cross-entropy over the reply tokens of the same logits, and shown to differ from TRL's here."""
    model, pairs = orpo_trainer.model, _pairs()
    inputs = _cpo_inputs(pairs)
    trl_loss, trl_metrics = orpo_trainer.get_batch_loss_metrics(model, inputs)
    _, parts, metrics = ours(make_objective(ORPO, FP32), CausalLMLoss(model, chunk_tokens=chunk), _our_batch(pairs))

    # TRL: loss = nll - mean(lambda x log sigmoid(log odds)); its odds-ratio term is loss - nll. Its nll is over
    # prompt and reply tokens (concatenated_forward: "orpo chosen nll loss is computed over the full prompt and
    # response"), ours over the chosen reply's tokens alone, as the paper's: that part is compared with a
    # cross-entropy over the reply tokens of TRL's model's own logits instead.
    assert parts[0].item() == pytest.approx(trl_loss.item() - trl_metrics["nll_loss"], rel=TOL, abs=TOL)
    assert_metrics(metrics, trl_metrics, ORPO_METRICS)
    with torch.no_grad():
        logits = model(inputs["chosen_input_ids"], attention_mask=inputs["chosen_attention_mask"]).logits
    reply_nll = nn.CrossEntropyLoss()(logits[:, :-1].flatten(0, 1), inputs["chosen_labels"][:, 1:].flatten())
    assert parts[1].item() == pytest.approx(reply_nll.item(), rel=TOL, abs=TOL)
    assert abs(parts[1].item() - trl_metrics["nll_loss"]) > 1e-2  # TRL's NLL also counts the prompt tokens


@pytest.mark.parametrize("chunk", [7, 0], ids=["chunked", "whole"])
def test_orpo_nll_sequence_equals_trl_whole_loss(orpo_trainer: Trainer, chunk: int) -> None:
    """--orpo_nll sequence: the cross-entropy over the chosen side's prompt and reply tokens, as TRL's, so the whole
    loss, its metrics and its gradient on the adapter equal TRL's on prompts of several tokens."""
    model, pairs = orpo_trainer.model, _pairs()
    params = lora_params(model)
    trl_loss, trl_metrics = orpo_trainer.get_batch_loss_metrics(model, _cpo_inputs(pairs))
    config = ObjectiveConfig(objective="orpo", orpo_lambda=0.2, orpo_nll="sequence")
    loss, _, metrics = ours(make_objective(config, FP32), CausalLMLoss(model, chunk_tokens=chunk), _our_batch(pairs))
    assert loss.item() == pytest.approx(trl_loss.item(), rel=TOL, abs=TOL)
    assert_metrics(metrics, trl_metrics, ORPO_METRICS)
    assert rel(grad(loss, params), grad(trl_loss, params)) < TOL
    reply_only, _, _ = ours(make_objective(ORPO, FP32), CausalLMLoss(model, chunk_tokens=chunk), _our_batch(pairs))
    assert abs(reply_only.item() - trl_loss.item()) > 1e-2  # the default (the paper's) is another loss here


@pytest.fixture(scope="module")
def confident_orpo_trainer(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Trainer:
    """ORPO's trainer on a model made confident: its (frozen) head's weight x 20."""
    trainer = trl_trainer("orpo", tiny_model, tmp_path_factory.mktemp("trl-orpo-confident"), beta=0.2)
    with torch.no_grad():
        trainer.model.get_output_embeddings().weight.mul_(20.0)
    return trainer


def _greedy_pairs(model: nn.Module, pairs: list[Pair]) -> list[Pair]:
    """Each pair's prompt with replies the model is sure of: chosen, its greedy continuation; rejected, the same
    from its second-best first token. On the confident model their average log-probs lie on both sides of -log 2,
    where log1mexp changes branch, and the log-odds differ much from the log-prob difference."""

    def greedy(ids: list[int], n: int, first_rank: int) -> list[int]:
        ids = list(ids)
        with torch.no_grad():
            for k in range(n):
                logits = model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.topk(first_rank + 1).indices[-1]) if k == 0 else int(logits.argmax()))
        return ids[-n:]

    return [(p, greedy(p, len(c), 0), greedy(p, len(r), 1)) for p, c, r in pairs]


@pytest.mark.parametrize("confident", [False, True], ids=["random-replies", "confident"])
def test_orpo_equals_trl_loss_when_the_prompt_is_one_token(
    orpo_trainer: Trainer, confident_orpo_trainer: Trainer, confident: bool
) -> None:
    """With one-token prompts TRL's NLL (every token but the first) is over the reply tokens alone, as ours: then
    TRL's whole ORPO loss and its gradient on the adapter equal ours. Random replies have average log-probs near
    -6, where the odds are nearly the probabilities; the confident model's greedy replies test log1mexp and the
    odds where they matter."""
    trainer = confident_orpo_trainer if confident else orpo_trainer
    model, pairs = trainer.model, _pairs(((1, 4, 6), (1, 7, 3), (1, 2, 5)))
    if confident:
        pairs = _greedy_pairs(model, pairs)
    params = lora_params(model)
    batch, lm = _our_batch(pairs), CausalLMLoss(model, chunk_tokens=7)
    trl_loss, trl_metrics = trainer.get_batch_loss_metrics(model, _cpo_inputs(pairs))
    loss, _, metrics = ours(make_objective(ORPO, FP32), lm, batch)
    assert loss.item() == pytest.approx(trl_loss.item(), rel=TOL, abs=TOL)
    assert_metrics(metrics, trl_metrics, ORPO_METRICS)
    assert rel(grad(loss, params), grad(trl_loss, params)) < TOL
    if confident:  # the regime it is there for
        with torch.no_grad():
            average = -lm(**_model_inputs(batch), request=PER_ROW) / (batch["labels"][:, 1:] != IGNORE_INDEX).sum(1)
        assert (average > -math.log(2)).any() and (average < -math.log(2)).any()  # both branches of log1mexp
        assert abs(metrics["log_odds_chosen"] - metrics["rewards/margins"] / 0.2) > 0.1  # odds far from probs


# --- SimPO: CPOTrainer, loss_type simpo --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def simpo_trainers(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[float, Trainer]:
    out = tmp_path_factory.mktemp("trl-simpo")
    simpo = {"loss_type": "simpo", "cpo_alpha": 0.0, "beta": 2.0, "simpo_gamma": 0.5}
    return {e: trl_trainer("cpo", tiny_model, out / str(e), label_smoothing=e, **simpo) for e in (0.0, 0.1)}


@pytest.mark.parametrize(("label_smoothing", "chunk"), [(0.0, 7), (0.0, 0), (0.1, 7)])
def test_simpo_equals_trl(simpo_trainers: dict[float, Trainer], label_smoothing: float, chunk: int) -> None:
    """Loss (on log-probs averaged over each reply's tokens, less gamma), rewards, log-probs and gradient."""
    trainer = simpo_trainers[label_smoothing]
    model, pairs = trainer.model, _pairs()
    params = lora_params(model)
    trl_loss, trl_metrics = trainer.get_batch_loss_metrics(model, _cpo_inputs(pairs))
    config = ObjectiveConfig(objective="simpo", beta=2.0, simpo_gamma=0.5, label_smoothing=label_smoothing)
    loss, _, metrics = ours(make_objective(config, FP32), CausalLMLoss(model, chunk_tokens=chunk), _our_batch(pairs))
    assert loss.item() == pytest.approx(trl_loss.item(), rel=TOL, abs=TOL)
    assert_metrics(metrics, trl_metrics, METRICS)
    assert rel(grad(loss, params), grad(trl_loss, params)) < TOL
