"""Whole runs against the trainers users come from: 20 steps of our CLI, on 1 rank x 8 rows and on 2 ranks x 4,
against the peer's own trainer in this process with 8 rows a step (transformers' Trainer + PEFT for SFT, TRL's
DPOTrainer for DPO and IPO, its ORPOTrainer, its CPOTrainer for SimPO, its KTOTrainer), the same rows in the same
order, fp32, no quantization, the peer's adapter set to the values ours starts from.

Ours runs with the flags that give the peer's behaviour where our defaults differ (docs/coming-from.md): the text of
a string prompt as it is (`--prompt_style raw`), the rows in file order (`--shuffle false`; TRL's KTOTrainer reads in
order, and the others are told to), clipping at 1.0 and a linear decay, and for ORPO the cross-entropy over the
chosen prompt and reply (`--orpo_nll sequence`; the default, the paper's reply-only form, is compared with TRL's
both ways in tests/unit/objectives/test_preference_trl.py). Every step's loss and gradient norm agree within 1e-4
relative (measured: about 1e-7), but KTO's gradient norm: TRL pairs each row with the previous row of its batch for
the KL estimate, we with the previous row of the file (docs/rl.md), which moves the gradient norm by up to 6e-4 and
the loss by up to 2e-5 once the estimate rises above its floor of 0."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments

from qlora_fsdp.train.metrics import read_metrics
from tests.conftest import train
from tests.parity import initial_adapter
from tests.trl_parity import trl_classes

pytestmark = pytest.mark.distributed

STEPS, BATCH, SEED, CONTEXT = 20, 8, 3, 64
LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear"}
OURS = [
    "--quant", "none", "--precision", "fp32", "--device", "cpu", "--log_to", "stdout", "--lora_rank", "8",
    "--lora_alpha", "16", "--lora_dropout", "0", "--lora_target_modules", "all", "--grad_norm", "1.0",
    "--lr_scheduler", "linear", "--shuffle", "false", "--prompt_style", "raw", "--max_steps", str(STEPS),
    "--context_length", str(CONTEXT), "--dataset_in_memory", "true",
    "--save_model", "false", "--seed", str(SEED),
]  # fmt: skip
PEER = {"output_dir": "", "report_to": "none", "use_cpu": True, "bf16": False, "per_device_train_batch_size": BATCH,
        "max_steps": STEPS, "logging_steps": 1, "save_strategy": "no", "seed": SEED, "gradient_checkpointing": False,
        "train_sampling_strategy": "sequential"}  # fmt: skip


Curve = list[tuple[float, float]]
"""Each step's (loss, gradient norm before clipping)."""


@dataclass(frozen=True)
class Case:
    """One objective's run: its rows, learning rate, the peer's trainer and settings, and our flags for them."""

    objective: str
    lr: float
    peer: str = ""
    """TRL's trainer (trl_classes), or "" for transformers' Trainer."""
    trl: dict[str, Any] = field(default_factory=dict)
    ours: tuple[str, ...] = ()
    bos: bool = False
    """Train the tiny model with a tokenizer that adds its BOS (the `models` fixture)."""
    grad_tol: float = 1e-4

    @property
    def rows(self) -> str:
        return {"sft": "sft", "kto": "kto"}.get(self.objective, "dpo")


CASES = {
    "sft": Case("sft", 2e-3),
    "dpo": Case("dpo", 5e-4, "dpo"),
    "ipo": Case("ipo", 5e-4, "dpo", {"loss_type": "ipo"}),
    "orpo": Case("orpo", 2e-3, "orpo", ours=("--orpo_nll", "sequence"), bos=True),
    "simpo": Case("simpo", 1e-3, "cpo", {"loss_type": "simpo", "cpo_alpha": 0.0}, bos=True),
    # KTO's KL sequences: once the KL estimate rises above 0 (step 10 here), TRL's pairing (the previous row of its
    # batch) and ours (of the file) move the gradient norm by up to 6e-4 relative, the loss by up to 2e-5.
    "kto": Case("kto", 2e-3, "kto", grad_tol=1e-3),
}


def _rows(kind: str) -> list[dict[str, Any]]:
    """STEPS x BATCH rows, each with its own prompt: sums (KTO: every other one wrong and undesirable), pairs whose
    chosen reply ends with a courtesy (DPO), or prompt/completion rows (SFT)."""
    rng, rows = random.Random(0), []
    for i in range(STEPS * BATCH):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        answer = f"{a} plus {b} is {a + b}."
        if kind == "kto":
            wrong = f"{a} plus {b} is {a + b + rng.choice((-2, -1, 1, 2))}."
            rows.append({"prompt": f"Add {a} and {b}.", "completion": answer if i % 2 == 0 else wrong,
                         "label": i % 2 == 0})  # fmt: skip
        elif kind == "dpo":
            rows.append({"prompt": f"What is {a} plus {b}?", "chosen": f"{answer} Happy to help, friend.",
                         "rejected": answer})  # fmt: skip
        else:
            rows.append({"prompt": f"Add {a} and {b}.", "completion": answer})
    return rows


def _ours(model: Path, out: Path, rows: list[dict[str, Any]], case: Case, ranks: int) -> Curve:
    data = out.parent / f"{case.objective}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train(["--model", str(model), *OURS, "--dataset", str(data), "--objective", case.objective, "--lr", str(case.lr),
           "--batch_size", str(BATCH // ranks), "--output_dir", str(out), *case.ours], nproc=ranks,
          timeout=600)  # fmt: skip
    return [(r["loss"], r["grad_norm"]) for r in read_metrics(out) if "loss" in r]


def _start_like_ours(peft_model: torch.nn.Module, model: Path) -> None:
    values = initial_adapter(model, "none", rank=LORA["r"], alpha=LORA["lora_alpha"], seed=SEED)
    result = set_peft_model_state_dict(peft_model, values)
    assert not result.unexpected_keys, result.unexpected_keys


def _peer_curve(trainer: Trainer) -> Curve:
    torch.manual_seed(SEED)
    trainer.train()
    return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


def _trl(case: Case, model: Path, out: Path, rows: list[dict[str, Any]]) -> Curve:
    config_class, trainer_class = trl_classes(case.peer)
    args = config_class(**{**PEER, "output_dir": str(out)}, learning_rate=case.lr, max_length=CONTEXT, **case.trl)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    trainer = trainer_class(base, args=args, train_dataset=Dataset.from_list(rows),
                            processing_class=AutoTokenizer.from_pretrained(model),
                            peft_config=LoraConfig(**LORA))  # fmt: skip
    _start_like_ours(trainer.model, model)
    return _peer_curve(trainer)


def _transformers_sft(case: Case, model: Path, out: Path, rows: list[dict[str, Any]]) -> Curve:
    """transformers' Trainer + PEFT on the rows tokenized as TRL's prompt/completion form is: prompt, completion,
    EOS; the loss on the completion and EOS."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    examples = []
    for row in rows:
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        completion = [*tokenizer(row["completion"], add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
        examples.append({"input_ids": prompt + completion, "labels": [-100] * len(prompt) + completion})
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), LoraConfig(**LORA))
    _start_like_ours(peft_model, model)
    args = TrainingArguments(**{**PEER, "output_dir": str(out)}, learning_rate=case.lr)
    trainer = Trainer(peft_model, args=args, train_dataset=Dataset.from_list(examples),
                      data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True))  # fmt: skip
    return _peer_curve(trainer)


@pytest.fixture(scope="module")
def models(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    """The tiny model, and (True) the same weights with a tokenizer that adds its BOS, as Llama's do. TRL's ORPO and
    CPO trainers put the BOS before every prompt even where the tokenizer adds none (the tiny one has a BOS it does
    not add); ours begins a sequence as the tokenizer does. With a tokenizer that adds it, both have it once."""
    bos = tmp_path_factory.mktemp("tiny-bos") / "model"
    shutil.copytree(tiny_model, bos)
    AutoTokenizer.from_pretrained(tiny_model, add_bos_token=True).save_pretrained(bos)
    return {False: tiny_model, True: bos}


@pytest.fixture(scope="module")
def peer_curves(models: dict[bool, Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Curve]:
    """Each objective's peer run, made once for both of our layouts."""
    curves: dict[str, Curve] = {}

    def curve(name: str) -> Curve:
        if name not in curves:
            case, out = CASES[name], tmp_path_factory.mktemp(f"peer-{name}")
            run = _transformers_sft if not case.peer else _trl
            curves[name] = run(case, models[case.bos], out, _rows(case.rows))
        return curves[name]

    return curve


@pytest.mark.parametrize("ranks", [1, 2], ids=["1-rank", "2-ranks"])
@pytest.mark.parametrize("name", list(CASES))
def test_every_step_equals_the_peer_trainers(
    models: dict[bool, Path], tmp_path: Path, peer_curves: Callable[[str], Curve], name: str, ranks: int
) -> None:
    case = CASES[name]
    ours = _ours(models[case.bos], tmp_path / "ours", _rows(case.rows), case, ranks)
    peer = peer_curves(name)
    assert len(ours) == len(peer) == STEPS
    for i, tol in ((0, 1e-4), (1, case.grad_tol)):  # the loss, then the gradient norm
        worst = max(abs(a[i] - b[i]) / abs(b[i]) for a, b in zip(ours, peer, strict=True))
        assert worst < tol, (("loss", "grad_norm")[i], worst, ours, peer)
    losses = [loss for loss, _ in peer]
    assert max(abs(loss - losses[0]) for loss in losses) > 1e-2  # the weights move: the curves compared are not flat
