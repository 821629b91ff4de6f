"""qlora_fsdp.objectives.grpo against TRL 1.16's GRPOTrainer._compute_loss (a test-only dependency), on its own code.

Fixed completions (prompts and completions of different lengths), advantages of both signs and, for the clipped
cases, per-token log-probs of the sampling policy that differ from the current ones (as after a step of
--num_iterations > 1), the tiny Llama with a LoRA adapter whose B matrices are non-zero: for every loss type, with
beta 0 and beta > 0 (the reference the adapters-off model, computed by TRL with its adapter disabled), the loss,
TRL's metrics (kl, clip ratios) and the loss's gradient on the adapter equal TRL's within 1e-5 in fp32. TRL pads
prompts on the left and we on the right: the tiny Llama's rotary positions make the two layouts the same model.

Measured: every difference is below 2e-7 absolute; gradients agree to 7e-7 relative.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer
from trl import GRPOConfig, GRPOTrainer

from qlora_fsdp.data import IGNORE_INDEX
from qlora_fsdp.data.rows import collate
from qlora_fsdp.objectives.grpo import ADVANTAGES, OLD_LOGPS, GrpoObjective
from qlora_fsdp.objectives.loss import CausalLMLoss
from qlora_fsdp.objectives.specs import GRPO_LOSS_TYPES as LOSS_TYPES
from tests.trl_parity import FP32, PAD, TOL, grad, lora_params, ours, perturb, rel

# (prompt, completion) lengths: the widths differ on both sides.
LENGTHS = ((5, 4), (1, 7), (9, 2), (3, 5))
ADVANTAGE_VALUES = (1.3, -0.7, 0.4, -1.1)
MAX_COMPLETION = 8
EPSILON, EPSILON_HIGH = 0.2, 0.28
Completion = tuple[list[int], list[int]]


def _completions(seed: int = 2) -> list[Completion]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(3, 500, (p,), generator=g).tolist(), torch.randint(3, 500, (c,), generator=g).tolist())
            for p, c in LENGTHS]  # fmt: skip


def _trl_inputs(rows: list[Completion]) -> dict[str, torch.Tensor]:
    """TRL's layout: prompts padded on the left, completions on the right."""
    width_p, width_c = (max(len(r[i]) for r in rows) for i in (0, 1))
    prompt_ids = torch.tensor([[PAD] * (width_p - len(p)) + p for p, _ in rows])
    prompt_mask = torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p, _ in rows])
    completion_ids = torch.tensor([c + [PAD] * (width_c - len(c)) for _, c in rows])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (width_c - len(c)) for _, c in rows])
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": torch.tensor(ADVANTAGE_VALUES),
            "num_items_in_batch": completion_mask.sum()}  # fmt: skip


def _our_batch(rows: list[Completion]) -> dict[str, torch.Tensor]:
    items = [{"input_ids": p + c, "labels": [IGNORE_INDEX] * len(p) + c} for p, c in rows]
    batch = collate(items, pad_id=PAD, context_length=64, pad_to_context=False)
    return {**batch, ADVANTAGES: torch.tensor(ADVANTAGE_VALUES)}


def _to_ours(per_completion: torch.Tensor, rows: list[Completion], width: int) -> torch.Tensor:
    """TRL's [rows, completion width] per-token values placed at our label positions [rows, width - 1]."""
    out = torch.zeros(len(rows), width - 1)
    for i, (p, c) in enumerate(rows):
        out[i, len(p) - 1 : len(p) - 1 + len(c)] = per_completion[i, : len(c)]
    return out


@pytest.fixture(scope="module")
def grpo_trainers(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[float, Trainer]:
    """A trainer per sampling temperature (TRL builds it into the model's fused head), each a fresh adapter made
    non-zero by the same draw."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert tokenizer.pad_token_id == PAD
    trainers = {}
    for temperature in sorted({case[-1] for case in CASES}):
        args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl-grpo")), report_to="none", use_cpu=True,
                          bf16=False, per_device_train_batch_size=4, num_generations=4, seed=0,
                          max_completion_length=MAX_COMPLETION, epsilon=EPSILON, epsilon_high=EPSILON_HIGH,
                          temperature=temperature)  # fmt: skip
        lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = GRPOTrainer(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                                  reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                                  train_dataset=Dataset.from_dict({"prompt": ["Hello"] * 4}),
                                  processing_class=tokenizer, peft_config=lora)  # fmt: skip
        perturb(trainer.model)
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # what Trainer's training loop sets for each step
        trainers[temperature] = trainer
    return trainers


def _trl_logps(trainer: Trainer, inputs: dict[str, torch.Tensor], *, adapters: bool) -> torch.Tensor:
    model = trainer.model
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        if adapters:
            return trainer._get_per_token_logps_and_entropies(model, ids, mask, inputs["completion_ids"].shape[1])[0]
        with model.disable_adapter():
            return trainer._get_per_token_logps_and_entropies(model, ids, mask, inputs["completion_ids"].shape[1])[0]


CASES = [*((loss_type, beta, stale, 1.0) for loss_type in LOSS_TYPES for beta, stale in ((0.0, True), (0.04, False))),
         ("dapo", 0.04, True, 0.7), ("grpo", 0.0, True, 1.3)]


@pytest.mark.parametrize(("loss_type", "beta", "stale", "temperature"), CASES)
def test_grpo_loss_equals_trl(grpo_trainers: dict[float, Trainer], loss_type: str, beta: float, stale: bool,
                              temperature: float) -> None:  # fmt: skip
    """Loss, metrics and the adapter's gradient. `stale`: the completions were sampled under other log-probs (the
    current ones shifted by up to 0.5 per token, so ratios fall outside the clip range on both sides); otherwise the
    ratio is 1 and the loss is the advantages' (and the KL term's). Log-probs are of the logits / the sampling
    temperature, as TRL takes them."""
    trainer, rows = grpo_trainers[temperature], _completions()
    trainer.loss_type, trainer.beta = loss_type, beta
    inputs = _trl_inputs(rows)
    batch = _our_batch(rows)
    if stale:
        g = torch.Generator().manual_seed(3)
        shift = torch.rand(inputs["completion_ids"].shape, generator=g) - 0.5
        old = _trl_logps(trainer, inputs, adapters=True) + shift
        inputs["old_per_token_logps"] = old
        batch[OLD_LOGPS] = _to_ours(old, rows, batch["input_ids"].shape[1])
    if beta:
        inputs["ref_per_token_logps"] = _trl_logps(trainer, inputs, adapters=False)
    trainer._metrics["train"].clear()
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    objective = GrpoObjective(FP32, loss_type=loss_type, beta=beta, epsilon=EPSILON, epsilon_high=EPSILON_HIGH,
                              max_completion_length=MAX_COMPLETION, temperature=temperature)  # fmt: skip
    loss, _, metrics = ours(objective, CausalLMLoss(trainer.model, chunk_tokens=5), batch)

    assert loss.item() == pytest.approx(trl_loss.item(), rel=TOL, abs=TOL)
    for name, value in metrics.items():
        assert value == pytest.approx(trl_metrics[name], rel=TOL, abs=TOL), name
    assert loss_type == "cispo" or {"clip_ratio/low_min", "clip_ratio/high_max"} <= set(metrics)
    if stale and loss_type != "cispo":
        assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0  # both sides clip
        # The extremes are per completion: the most high-clipped completion is above the mean, as TRL's is.
        assert metrics["clip_ratio/high_max"] > metrics["clip_ratio/high_mean"]
    if beta:
        assert metrics["kl"] > 1e-3  # the adapter moved the policy off the reference
    params = lora_params(trainer.model)
    assert rel(grad(loss, params), grad(trl_loss, params)) < TOL
