"""Mixture-of-experts QLoRA end to end: Mixtral, Qwen2-MoE (shared expert) and Qwen3-MoE on 2 CPU ranks, bnb and
HQQ, FSDP2 and FSDP1 (pairwise, see COMBOS), checked against transformers' own model with PEFT's own LoRA on its
fused experts.

The reference is one unsharded process: the transformers model of the checkpoint with the bytes training quantized
(checked layer by layer against the run's manifest) dequantized into its weights, and PEFT's LoRA built from the
run's adapter_config.json (target_modules, and target_parameters for the fused experts), set to the adapter values
training starts from. Of this project's code it uses only loading/quantizing, the adapter initialisation (with the
keys PEFT names them by) and the tokenization and padding; the forward, the loss and the gradients are
transformers' and PEFT's.

Qwen2-MoE's attention has biases, which no other family here has: with HQQ they are what its 2-rank runs test.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from qlora_fsdp.model.skeleton import Skeleton
from qlora_fsdp.quant.experts import QuantizedExperts
from qlora_fsdp.train.metrics import read_metrics
from tests import parity
from tests.conftest import train
from tests.moe_models import FAMILIES
from tests.parity import (
    check_quantized_like,
    dequantized_transformers_model,
    initial_adapter,
    label_loss_sum,
    quantized_base,
    trainable_grad_norm,
)

pytestmark = pytest.mark.distributed

STEPS = 12
RANK, ALPHA, SEED, CONTEXT = 8, 16, 7, 96
# Exactly two rows: 2 ranks x batch 1 take the whole file in every step, whatever order the sampler draws. Both fit
# the context whole (checked), and their prompts are unlabelled: 10 and 11 label tokens with the tiny tokenizer.
ROWS = [
    {"instruction": "Write a sentence about the animal and the color.", "input": "ant, white",
     "output": "The ant is white."},
    {"instruction": "Repeat the word 5 times.", "input": "bat", "output": "bat bat bat bat bat"},
]  # fmt: skip
COMMON = [
    "--precision", "fp32", "--context_length", str(CONTEXT), "--lr", "0.01", "--lora_rank", str(RANK),
    "--lora_alpha", str(ALPHA), "--lora_dropout", "0", "--lora_target_modules", "all", "--lr_scheduler", "constant",
    "--device", "cpu", "--log_to", "stdout", "--seed", str(SEED), "--batch_size", "1", "--max_steps", str(STEPS),
    "--router_aux_loss_coef", "0",  # the loss is the cross-entropy alone, as the reference computes it
]  # fmt: skip
EXPERT_PARAMETERS = ["experts.down_proj", "experts.gate_up_proj"]

# Pairwise, not the full 3 x 2 x 2 product: every family with each backend, every family under each FSDP version,
# every backend under each version. The three meet only in pairs: a family's layout (its experts, shared expert,
# attention biases) is quantized by the backend and wrapped by FSDP, and the backend's storage is sharded by FSDP;
# no code path reads all three at once, so the other six runs would repeat what these show.
COMBOS = [
    (FAMILIES[0], "bnb", 2), (FAMILIES[0], "hqq", 1),
    (FAMILIES[1], "bnb", 1), (FAMILIES[1], "hqq", 2),
    (FAMILIES[2], "bnb", 2), (FAMILIES[2], "hqq", 1),
]  # fmt: skip


@dataclass
class Run:
    family: str
    quant: str
    version: int
    model: Path
    data: Path
    out: Path

    @property
    def steps(self) -> list[dict]:
        return [r for r in read_metrics(self.out) if "loss" in r]

    @property
    def final_eval(self) -> dict:
        return [r for r in read_metrics(self.out) if "eval_loss" in r][-1]


_RUNS: dict[tuple[str, str, int], Path | str] = {}
"""Each combination's output directory, or why its launch failed."""


@pytest.fixture(scope="module")
def two_rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("moe-data") / "two_rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return path


@pytest.fixture(scope="module", params=COMBOS, ids=[f"{f}-{q}-fsdp{v}" for f, q, v in COMBOS])
def moe_run(
    request: pytest.FixtureRequest,
    moe_models: dict[str, Path],
    two_rows: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Run:
    """12 steps on 2 ranks x batch 1 over the two rows, evaluated on them at the end; each combination once."""
    family, quant, version = request.param
    model = moe_models[family]
    if request.param not in _RUNS:
        out = tmp_path_factory.mktemp(f"moe-{family}-{quant}-v{version}")
        args = ["--model", str(model), "--quant", quant, "--fsdp_version", str(version), "--dataset", str(two_rows),
                "--eval_dataset", str(two_rows), *COMMON, "--output_dir", str(out)]  # fmt: skip
        try:
            train(args, nproc=2)
            _RUNS[request.param] = out
        except AssertionError as exc:  # kept, so the combination's other tests do not launch it again
            _RUNS[request.param] = str(exc)
    done = _RUNS[request.param]
    if isinstance(done, str):
        pytest.fail(done)
    return Run(family, quant, version, model, two_rows, done)


# ---------------------------------------------------------------------------------------------------------------
# The unsharded reference
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Reference:
    base: Skeleton
    """The model as training quantized it, whole, in this process."""
    initial: dict[str, torch.Tensor]
    """PEFT key -> the adapter tensor training starts from."""


_REFERENCES: dict[tuple[str, str], Reference] = {}


def reference(run: Run) -> Reference:
    key = (run.family, run.quant)
    if key not in _REFERENCES:
        initial = initial_adapter(run.model, run.quant, rank=RANK, alpha=ALPHA, seed=SEED)
        assert any(".experts." in key for key in initial), "no adapter on the experts"
        _REFERENCES[key] = Reference(quantized_base(run.model, run.quant, run.out), initial)
    ref = _REFERENCES[key]
    check_quantized_like(ref.base, run.out)
    return ref


def transformers_base(run: Run, base: Skeleton) -> nn.Module:
    model = dequantized_transformers_model(run.model, base)
    assert any(isinstance(m, QuantizedExperts) for m in base.model.modules()), "no quantized experts"
    return model


def step_batches(run: Run) -> list[dict[str, torch.Tensor]]:
    return parity.step_batches(run.model, run.data, context=CONTEXT, rows=2)


# ---------------------------------------------------------------------------------------------------------------
# The acceptance points
# ---------------------------------------------------------------------------------------------------------------


def test_first_step_matches_transformers_with_peft(moe_run: Run) -> None:
    """Step 1's loss and gradient norm are those of transformers + PEFT, unsharded, on the dequantized base.

    B starts at zero, so the loss checks the base (dequantized weights, routing, the shared expert) and the gradient
    norm, all of it dL/dB, checks how each expert's A meets its tokens. A wrong A layout shows there: rolling the
    experts' A rows by one expert in the reference (each expert given its neighbour's rows), tried by hand on
    Qwen2-MoE bnb FSDP2, moved grad_norm by 4.4e-4 relative (4x the tolerance; the runs agree to ~1e-7). B's column
    layout cannot show at step 1 (a permutation of B's columns leaves the norm alone):
    test_saved_adapter_gives_the_run_eval_loss catches it (reading B's columns per expert contiguously instead of
    strided moved the eval loss by 7e-2).
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, set_peft_model_state_dict

    ref = reference(moe_run)
    config = PeftLoraConfig.from_pretrained(moe_run.out)
    # Qwen2-MoE's shared expert is saved by its weights (qlora_fsdp/model/adapter_config.py), the experts by name.
    assert sorted(p for p in config.target_parameters if not p.endswith(".weight")) == EXPERT_PARAMETERS
    peft_model = get_peft_model(transformers_base(moe_run, ref.base), config)
    incompatible = set_peft_model_state_dict(peft_model, {k: v.clone() for k, v in ref.initial.items()})
    assert not incompatible.unexpected_keys, incompatible.unexpected_keys
    assert not [k for k in incompatible.missing_keys if "lora_" in k], incompatible.missing_keys
    first = moe_run.steps[0]
    assert sum(p.numel() for p in peft_model.parameters() if p.requires_grad) == first["trainable_parameters"]

    peft_model.train()
    sums, counts = zip(*(label_loss_sum(peft_model, batch) for batch in step_batches(moe_run)), strict=True)
    loss = sum(sums) / sum(counts)
    loss.backward()
    grad_norm = trainable_grad_norm(peft_model)

    assert first["label_tokens"] == sum(counts)
    assert first["loss"] == pytest.approx(loss.item(), rel=1e-5), f"loss: run {first['loss']}, reference {loss}"
    assert first["grad_norm"] == pytest.approx(grad_norm, rel=1e-4), (
        f"grad_norm: run {first['grad_norm']}, reference {grad_norm}"
    )


def test_loss_falls(moe_run: Run) -> None:
    losses = [r["loss"] for r in moe_run.steps]
    assert len(losses) == STEPS
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first, f"loss did not fall: first 3 mean {first:.4f}, last 3 mean {last:.4f}"


def test_experts_are_quantized(moe_run: Run) -> None:
    """The base model as the ranks hold it against the same model in bf16 (2 bytes x transformers' parameters).

    param_bytes_per_rank counts the adapters too, which the bf16 figure does not: they are taken out (fp32,
    trainable_parameters x 4 bytes). The fp32 embeddings, head, norms and routers stay in. Unquantized experts would
    put this over 0.9 in bf16 (786,432 of the 0.88M parameters), and over 1.8 as this fp32 run keeps them.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(moe_run.model))
    bf16_bytes = 2 * sum(p.numel() for p in model.parameters())
    first = moe_run.steps[0]
    resident = sum(first["param_bytes_per_rank"])
    base = resident - 4 * first["trainable_parameters"]
    assert base <= 0.6 * bf16_bytes, (
        f"base resident {base} bytes (with adapters {resident}), bf16 model {bf16_bytes}: {base / bf16_bytes:.3f}"
    )


def test_saved_adapter_gives_the_run_eval_loss(moe_run: Run) -> None:
    """The trained adapter, loaded by PEFT itself onto the dequantized transformers model, computes the loss the run
    evaluated its final weights to: the saved keys and both experts' A and B layouts are PEFT's."""
    from peft import PeftModel, get_peft_model_state_dict

    ref = reference(moe_run)
    saved = load_file(moe_run.out / "adapter_model.safetensors")
    loaded = PeftModel.from_pretrained(transformers_base(moe_run, ref.base), moe_run.out).eval()
    state = get_peft_model_state_dict(loaded)
    assert set(saved) == set(state), f"missing {set(state) - set(saved)}, unexpected {set(saved) - set(state)}"
    for key, tensor in saved.items():
        assert torch.equal(state[key].to(tensor.dtype), tensor), key
    assert any(".experts." in key and "lora_B" in key and tensor.abs().sum() > 0 for key, tensor in saved.items())

    with torch.no_grad():
        sums, counts = zip(*(label_loss_sum(loaded, batch) for batch in step_batches(moe_run)), strict=True)
    final = moe_run.final_eval
    assert final["step"] == STEPS and final["eval_tokens"] == sum(counts)
    loss = (sum(sums) / sum(counts)).item()
    assert final["eval_loss"] == pytest.approx(loss, rel=1e-5), f"eval_loss: run {final['eval_loss']}, PEFT {loss}"
