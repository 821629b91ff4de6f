"""Image-text models (Qwen2-VL, LLaVA) on 2 CPU ranks with text rows: loaded through transformers' image-text
classes (LLaVA from its pre-5 checkpoint names), the language model quantized and adapted, the vision tower and
projector left in full precision and frozen, checked against transformers' own model with PEFT's LoRA
(tests/parity.py)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from qlora_fsdp.metrics import read_metrics
from qlora_fsdp.quant.base import QuantizedLinear
from qlora_fsdp.vision import vision_parts
from tests import parity
from tests.conftest import train
from tests.distributed.test_moe_e2e import ROWS
from tests.parity import (
    check_quantized_like,
    dequantized_transformers_model,
    initial_adapter,
    label_loss_sum,
    quantized_base,
    trainable_grad_norm,
)
from tests.vlm_models import FAMILIES, build_vlm

pytestmark = pytest.mark.distributed

STEPS = 2
RANK, ALPHA, SEED, CONTEXT = 8, 16, 7, 96
COMMON = [
    "--precision", "fp32", "--context_length", str(CONTEXT), "--lr", "0.01", "--lora_rank", str(RANK),
    "--lora_alpha", str(ALPHA), "--lora_dropout", "0", "--lora_target_modules", "all", "--lr_scheduler", "constant",
    "--device", "cpu", "--log_to", "stdout", "--seed", str(SEED), "--batch_size", "1", "--max_steps", str(STEPS),
]  # fmt: skip
# Each family with one backend and one FSDP version: the vision units are wrapped by both versions.
COMBOS = [("qwen2_vl", "bnb", 2), ("llava", "hqq", 1)]
COLORS = {"red": (255, 0, 0), "green": (0, 160, 0), "blue": (0, 0, 255)}
QUESTION = "What color is this square?"


def square_rows(directory: Path, colors: list[str]) -> Path:
    """TRL's image rows: a solid square of each color (28 x 28 PNG, beside the file) and the question about it."""
    rows = []
    for i, color in enumerate(colors):
        Image.new("RGB", (28, 28), COLORS[color]).save(directory / f"{i}-{color}.png")
        rows.append({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
                                  {"role": "assistant", "content": [{"type": "text", "text": f"It is {color}."}]}],
                     "images": [f"{i}-{color}.png"]})  # fmt: skip
    path = directory / "squares.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@dataclass
class Run:
    family: str
    quant: str
    model: Path
    data: Path
    out: Path

    @property
    def steps(self) -> list[dict]:
        return [r for r in read_metrics(self.out) if "loss" in r]


@pytest.fixture(scope="module")
def vlms(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlm")
    return {f: build_vlm(f, root / f, tokenizer_from=tiny_model, seed=i) for i, f in enumerate(FAMILIES)}


@pytest.fixture(scope="module", params=COMBOS, ids=[f"{f}-{q}-fsdp{v}" for f, q, v in COMBOS])
def vlm_run(request: pytest.FixtureRequest, vlms: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Run:
    family, quant, version = request.param
    data = tmp_path_factory.mktemp("vlm-data") / "two_rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    out = tmp_path_factory.mktemp(f"vlm-{family}-{quant}")
    train(["--model", str(vlms[family]), "--quant", quant, "--fsdp_version", str(version), "--dataset", str(data),
           *COMMON, "--output_dir", str(out)], nproc=2)  # fmt: skip
    return Run(family, quant, vlms[family], data, out)


def test_first_step_matches_transformers_with_peft(vlm_run: Run) -> None:
    """Step 1's loss and gradient norm are those of transformers' image-text model + PEFT, unsharded, on the
    dequantized language model and the checkpoint's own vision tower."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, set_peft_model_state_dict

    base = quantized_base(vlm_run.model, vlm_run.quant, vlm_run.out)
    check_quantized_like(base, vlm_run.out)
    config = PeftLoraConfig.from_pretrained(vlm_run.out)
    peft_model = get_peft_model(dequantized_transformers_model(vlm_run.model, base), config)
    initial = initial_adapter(vlm_run.model, vlm_run.quant, rank=RANK, alpha=ALPHA, seed=SEED)
    incompatible = set_peft_model_state_dict(peft_model, {k: v.clone() for k, v in initial.items()})
    assert not incompatible.unexpected_keys, incompatible.unexpected_keys
    assert not [k for k in incompatible.missing_keys if "lora_" in k], incompatible.missing_keys
    first = vlm_run.steps[0]
    assert sum(p.numel() for p in peft_model.parameters() if p.requires_grad) == first["trainable_parameters"]

    peft_model.train()
    batches = parity.step_batches(vlm_run.model, vlm_run.data, context=CONTEXT, rows=2)
    sums, counts = zip(*(label_loss_sum(peft_model, batch) for batch in batches), strict=True)
    loss = sum(sums) / sum(counts)
    loss.backward()
    grad_norm = trainable_grad_norm(peft_model)

    assert first["label_tokens"] == sum(counts)
    assert first["loss"] == pytest.approx(loss.item(), rel=1e-5), f"loss: run {first['loss']}, reference {loss}"
    assert first["grad_norm"] == pytest.approx(grad_norm, rel=1e-4), f"grad_norm: run {first['grad_norm']}, {grad_norm}"


def test_vision_tower_stays_full_precision_and_frozen(vlm_run: Run) -> None:
    """Only the language model's linears were quantized and adapted; the vision tower and projector hold the
    checkpoint's own weights, and PEFT's adapter config excludes them."""
    from transformers import AutoModelForImageTextToText

    base = quantized_base(vlm_run.model, vlm_run.quant, vlm_run.out)
    parts = vision_parts(base.model)
    assert parts is not None and parts.tower and base.quantized
    assert all(n.startswith(f"{parts.language}.") for n in base.quantized), base.quantized
    reference = AutoModelForImageTextToText.from_pretrained(vlm_run.model, dtype=torch.float32)
    vision = [p for p in (*parts.tower, *parts.projector) if p]
    linears = [(n, m) for n, m in base.model.named_modules() if n.startswith(tuple(f"{p}." for p in vision))]
    linears = [(n, m) for n, m in linears if isinstance(m, torch.nn.Linear)]
    assert linears and not any(isinstance(m, QuantizedLinear) for _, m in linears)
    for name, module in linears:
        assert torch.equal(module.weight, reference.get_submodule(name).weight), name

    saved = load_file(vlm_run.out / "adapter_model.safetensors")
    language = f"base_model.model.{parts.language}."
    assert saved and all(key.startswith(language) for key in saved), sorted(saved)[:3]
    exclude = json.loads((vlm_run.out / "adapter_config.json").read_text())["exclude_modules"]
    assert all(re.fullmatch(exclude, name) for name, _ in linears)
    assert not re.fullmatch(exclude, f"{parts.language}.layers.0.self_attn.q_proj")


# Image rows: LLaVA's 28 x 28 image is 2 x 2 patches of 14 (4 tokens); Qwen2-VL merges its 2 x 2 patches into one.
IMAGE_ROWS = [("llava", "bnb", 2, "<image>", 4), ("qwen2_vl", "hqq", 1, "<|image_pad|>", 1)]


@pytest.mark.parametrize(("family", "quant", "version", "image_token", "tokens"), IMAGE_ROWS,
                         ids=[f"{f}-{q}-fsdp{v}" for f, q, v, _, _ in IMAGE_ROWS])  # fmt: skip
def test_image_rows_first_step_matches_transformers_with_peft(
    vlms: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
    family: str,
    quant: str,
    version: int,
    image_token: str,
    tokens: int,
) -> None:
    """On rows with images (2 ranks): step 1's loss and gradient norm are transformers' + PEFT's on what the
    family's own processor makes of each row (its chat template, its image tokens, its pixels, and Qwen2-VL's
    M-RoPE positions from them); the labels are each reply's tokens and the end-of-turn token, counted on the
    processor's ids."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, set_peft_model_state_dict
    from transformers import AutoProcessor

    if family == "qwen2_vl":
        pytest.importorskip("torchvision", reason="Qwen2-VL's processor needs torchvision (the torch 2.11 set has it)")
    model = vlms[family]
    data = square_rows(tmp_path_factory.mktemp("squares"), ["red", "blue"])
    out = tmp_path_factory.mktemp("vlm-images")
    train(["--model", str(model), "--quant", quant, "--fsdp_version", str(version), "--dataset", str(data), *COMMON,
           "--output_dir", str(out)], nproc=2)  # fmt: skip
    first = next(r for r in read_metrics(out) if "loss" in r)

    base = quantized_base(model, quant, out)
    check_quantized_like(base, out)
    peft_model = get_peft_model(dequantized_transformers_model(model, base), PeftLoraConfig.from_pretrained(out))
    initial = initial_adapter(model, quant, rank=RANK, alpha=ALPHA, seed=SEED)
    set_peft_model_state_dict(peft_model, {k: v.clone() for k, v in initial.items()})
    processor = AutoProcessor.from_pretrained(model)
    eot = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    peft_model.train()
    sums, counts = [], []
    for line in data.read_text().splitlines():
        row = json.loads(line)
        text = processor.apply_chat_template(row["messages"], tokenize=False)
        image = Image.open(data.parent / row["images"][0]).convert("RGB")
        batch = processor(text=[text], images=[image], add_special_tokens=False, return_tensors="pt")
        ids = batch["input_ids"][0].tolist()
        assert ids.count(processor.tokenizer.convert_tokens_to_ids(image_token)) == tokens
        reply = processor.tokenizer(row["messages"][1]["content"][0]["text"], add_special_tokens=False)["input_ids"]
        end = len(ids) - 1 - ids[::-1].index(eot)  # the last turn's end-of-turn token
        labels = torch.full_like(batch["input_ids"], -100)
        labels[0, end - len(reply) : end + 1] = batch["input_ids"][0, end - len(reply) : end + 1]
        logits = peft_model(**batch, use_cache=False).logits
        sums.append(torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], reduction="sum"))
        counts.append(int((labels[0, 1:] != -100).sum()))
    loss = sum(sums) / sum(counts)
    loss.backward()

    assert first["label_tokens"] == sum(counts)
    assert first["loss"] == pytest.approx(loss.item(), rel=1e-5), f"loss: run {first['loss']}, reference {loss}"
    grad_norm = trainable_grad_norm(peft_model)
    assert first["grad_norm"] == pytest.approx(grad_norm, rel=1e-4), f"grad_norm: run {first['grad_norm']}, {grad_norm}"
