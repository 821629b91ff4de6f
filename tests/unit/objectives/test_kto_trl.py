"""qlora_fsdp.objectives.kto against TRL 1.16's KTOTrainer (a test-only dependency), on its own code.

One fixed batch of labelled completions (prompts and completions of different lengths, desirable and undesirable
mixed), the tiny Llama with a LoRA adapter whose B matrices are non-zero (so the policy is not the reference):
the loss, TRL's metrics (rewards, log-probs, margins and the KL estimate) and the loss's gradient on the adapter
equal KTOTrainer._compute_loss's within 1e-5 in fp32, our KL sequences made by data.rows.UnpairedRows and TRL's by
its rule (each row's prompt with the previous row's completion, the first row's with the last's:
`add_kl_completion_ids` in KTOTrainer._prepare_dataset).

Measured: every difference is below 4e-6 absolute (on values up to about 60), gradients agree to 7e-7 relative.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Trainer
from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

from qlora_fsdp.config.options import ObjectiveConfig
from qlora_fsdp.data import IGNORE_INDEX
from qlora_fsdp.data.rows import UnpairedRows, collate
from qlora_fsdp.objectives.kto import KtoObjective
from qlora_fsdp.objectives.loss import CausalLMLoss
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

# (prompt, completion) lengths and labels: desirable and undesirable rows of different widths.
ROWS = ((5, 4, True), (1, 7, False), (9, 2, True), (3, 5, False), (6, 3, False))
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")
Row = tuple[list[int], list[int], bool]


def _rows(seed: int = 9) -> list[Row]:
    """Seed 9: the KL sequences' mean log-ratio is 0.21 under the perturbed adapter (seed 3: -0.18, clamped to 0)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(3, 500, (p,), generator=g).tolist(), torch.randint(3, 500, (c,), generator=g).tolist(),
             label) for p, c, label in ROWS]  # fmt: skip


def _our_batch(rows: list[Row]) -> dict[str, torch.Tensor]:
    """Our layout, by UnpairedRows over a store of two-sided rows (a desirable completion on the chosen side, an
    undesirable one on the rejected side), in order."""
    store = []
    for prompt, completion, desirable in rows:
        sample = (prompt + completion, [IGNORE_INDEX] * len(prompt) + completion)
        store.append((sample, ([], [])) if desirable else (([], []), sample))
    lengths = np.array([len(p) + len(c) for p, c, _ in rows])
    dataset = UnpairedRows(store, np.arange(len(rows)), lengths, context_length=64)
    return collate([dataset[i] for i in range(len(rows))], pad_id=PAD, context_length=64, pad_to_context=False)


def _trl_inputs(rows: list[Row]) -> dict[str, torch.Tensor]:
    completions = [c for _, c, _ in rows]
    kl = [completions[-1], *completions[:-1]]
    examples = [{"prompt_ids": p, "completion_ids": c, "KL_completion_ids": k, "label": label}
                for (p, c, label), k in zip(rows, kl, strict=True)]  # fmt: skip
    return DataCollatorForUnpairedPreference(pad_token_id=PAD)(examples)


CASES = {
    "default": ({}, {}),
    "weighted": ({"beta": 0.5, "desirable_weight": 1.33, "undesirable_weight": 0.8},
                 {"beta": 0.5, "desirable_weight": 1.33, "undesirable_weight": 0.8}),
}  # fmt: skip


@pytest.fixture(scope="module")
def kto_trainers(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Trainer]:
    out = tmp_path_factory.mktemp("trl-kto")
    return {case: trl_trainer("kto", tiny_model, out / case, loss_type="kto", **trl) for case, (_, trl) in
            CASES.items()}  # fmt: skip


@pytest.mark.parametrize(("case", "chunk", "seed"), [("default", 7, 9), ("default", 0, 9), ("weighted", 7, 9),
                                                    ("default", 7, 3)])  # fmt: skip
def test_kto_equals_trl(kto_trainers: dict[str, Trainer], case: str, chunk: int, seed: int) -> None:
    """Loss, metrics and the adapter's gradient, with the KL estimate above 0 and clamped to it (seed 3). A KL
    sequence paired with another completion than TRL's, a KL estimate over other rows, a reference other than the
    adapters-off model or a swapped label would each break it."""
    trainer = kto_trainers[case]
    model = trainer.model
    params = lora_params(model)
    rows = _rows(seed)
    trl_loss = trainer._compute_loss(model, _trl_inputs(rows), return_outputs=False)
    trl_metrics = last_metrics(trainer)
    objective = make_objective(ObjectiveConfig(objective="kto", **CASES[case][0]), FP32)
    loss, _, metrics = ours(objective, CausalLMLoss(model, chunk_tokens=chunk), _our_batch(rows))

    assert loss.item() == pytest.approx(trl_loss.item(), rel=TOL, abs=TOL)
    assert_metrics(metrics, trl_metrics, METRICS)
    assert metrics["kl"] > 0.1 if seed == 9 else metrics["kl"] == 0.0
    assert abs(metrics["rewards/margins"]) > 1e-2  # the adapter moved the policy off the reference
    assert rel(grad(loss, params), grad(trl_loss, params)) < TOL


def test_control_kl_from_matched_completions_is_not_trl(kto_trainers: dict[str, Trainer]) -> None:
    """The KL parity is not vacuous: an estimate from the rows' own completions (no mismatch) changes the loss far
    past the tolerance."""
    trainer = kto_trainers["default"]
    model, rows = trainer.model, _rows()
    trl_loss = trainer._compute_loss(model, _trl_inputs(rows), return_outputs=False).item()
    batch = _our_batch(rows)
    half = batch["input_ids"].shape[0] // 2
    for key in ("input_ids", "labels", "attention_mask"):
        batch[key] = torch.cat([batch[key][:half], batch[key][:half]])
    wrong, _, _ = ours(KtoObjective(FP32, beta=0.1), CausalLMLoss(model, chunk_tokens=7), batch)
    assert abs(wrong.item() - trl_loss) > 100 * TOL
