"""Image-text models (Qwen2-VL, LLaVA) on 2 CPU ranks with text rows: loaded through transformers' image-text
classes (LLaVA from its pre-5 checkpoint names), the language model quantized and adapted, the vision tower and
projector left in full precision and frozen, checked against transformers' own model with PEFT's LoRA
(tests/parity.py)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file
from torch import nn

from qlora_fsdp.model.vision import vision_parts
from qlora_fsdp.quant.base import QuantizedLinear
from qlora_fsdp.train.metrics import read_metrics
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


def square_rows(directory: Path, colors: list[str], *, answers: list[str] | None = None, jitter: int = 0,
                noise: int = 0, seed: int = 0) -> Path:  # fmt: skip
    """TRL's image rows: a square of each color (28 x 28 PNG beside the file; each channel moved by up to `jitter`,
    and each pixel's by up to `noise` more, seeded) and the question about it, answered with its color (or with
    `answers`, in order)."""
    rng = random.Random(seed)
    rows = []
    for i, (color, answer) in enumerate(zip(colors, answers or colors, strict=True)):
        rgb = [v + rng.randint(-jitter, jitter) for v in COLORS[color]]
        pixels = [min(255, max(0, rgb[k % 3] + rng.randint(-noise, noise))) for k in range(28 * 28 * 3)]
        Image.frombytes("RGB", (28, 28), bytes(pixels)).save(directory / f"{i}-{color}.png")
        rows.append({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
                                  {"role": "assistant", "content": [{"type": "text", "text": f"It is {answer}."}]}],
                     "images": [f"{i}-{color}.png"]})  # fmt: skip
    path = directory / "squares.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def processor_example(processor: Any, row: dict, root: Path) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """What the family's own processor makes of a row (chat template, image tokens, pixels), as a batch of one, and
    its labels: the last reply's tokens and the end-of-turn token after it."""
    text = processor.apply_chat_template(row["messages"], tokenize=False)
    image = Image.open(root / row["images"][0]).convert("RGB")
    batch = dict(processor(text=[text], images=[image], add_special_tokens=False, return_tensors="pt"))
    ids = batch["input_ids"][0].tolist()
    reply = processor.tokenizer(row["messages"][-1]["content"][0]["text"], add_special_tokens=False)["input_ids"]
    end = len(ids) - 1 - ids[::-1].index(processor.tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    labels = torch.full_like(batch["input_ids"], -100)
    labels[0, end - len(reply) : end + 1] = batch["input_ids"][0, end - len(reply) : end + 1]
    return batch, labels


def reply_loss_sum(model: nn.Module, batch: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    logits = model(**batch, use_cache=False).logits
    return F.cross_entropy(logits[0, :-1].float(), labels[0, 1:], reduction="sum")


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


# Image rows: LLaVA's 28 x 28 image is 2 x 2 patches of 14 (4 tokens); Qwen2-VL merges its 2 x 2 patches into one;
# Gemma 3 pools its patches into 4 tokens that attend to each other both ways (token_type_ids); Idefics3 (SmolVLM)
# shuffles its 2 x 2 patches into 1 token between <fake_token_around_image> and <global-img> tokens.
IMAGE_ROWS = [("llava", "bnb", 2, "<image>", 4), ("qwen2_vl", "hqq", 1, "<|image_pad|>", 1),
              ("gemma3", "hqq", 2, "<image_soft_token>", 4), ("idefics3", "bnb", 1, "<image>", 1)]  # fmt: skip


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
    # Noisy pixels: a solid square's image tokens are all alike, and would hide how they attend to each other.
    data = square_rows(tmp_path_factory.mktemp("squares"), ["red", "blue"], noise=60)
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
    image_id = processor.tokenizer.convert_tokens_to_ids(image_token)
    peft_model.train()
    sums, counts = [], []
    for line in data.read_text().splitlines():
        batch, labels = processor_example(processor, json.loads(line), data.parent)
        assert batch["input_ids"][0].tolist().count(image_id) == tokens
        sums.append(reply_loss_sum(peft_model, batch, labels))
        counts.append(int((labels[0, 1:] != -100).sum()))
    loss = sum(sums) / sum(counts)
    loss.backward()

    assert first["label_tokens"] == sum(counts)
    assert first["loss"] == pytest.approx(loss.item(), rel=1e-5), f"loss: run {first['loss']}, reference {loss}"
    grad_norm = trainable_grad_norm(peft_model)
    assert first["grad_norm"] == pytest.approx(grad_norm, rel=1e-4), f"grad_norm: run {first['grad_norm']}, {grad_norm}"


LEARN_STEPS = 30
"""Steps of batch 4 (2 ranks x 2) to tell the colors apart on held-out squares, as calibrated below for both sides."""


@pytest.fixture(scope="module")
def color_llava(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """A LLaVA with random weights of std 0.2, not transformers' 0.02: with 0.02 its frozen head's logits stay
    within about +-1.3, so no adapter makes a reply likely (the loss stayed near 5.3 over 150 steps, images or
    not)."""
    root = tmp_path_factory.mktemp("color-llava")
    return build_vlm("llava", root / "llava", tokenizer_from=tiny_model, init_std=0.2)


def held_out_accuracy(model: nn.Module, processor: Any, rows_file: Path) -> float:
    """The fraction of rows whose own answer has the highest log-prob of the three colors' answers."""
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    right = 0
    for row in rows:
        scores = {}
        for color in COLORS:
            reply = {"role": "assistant", "content": [{"type": "text", "text": f"It is {color}."}]}
            batch, labels = processor_example(processor, {**row, "messages": [row["messages"][0], reply]},
                                              rows_file.parent)  # fmt: skip
            with torch.no_grad():
                scores[color] = -reply_loss_sum(model, batch, labels).item()
        right += row["messages"][-1]["content"][0]["text"] == f"It is {max(scores, key=scores.get)}."
    return right / len(rows)


def peer_accuracy(model: Path, train_rows: Path, held: Path, processor: Any) -> tuple[float, int]:
    """transformers' own 4-bit loading (bitsandbytes, the language model's linears) + PEFT's LoRA on them + AdamW,
    the run's settings (rank, alpha, lr, batch 4, LEARN_STEPS steps): the held-out accuracy, and the bytes of the
    loaded model's parameters and buffers (before the adapters)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForImageTextToText

    from benchmarks.peer import LLAMA_LINEARS, bnb_config

    quantization = bnb_config(dtype=torch.float32)
    quantization.llm_int8_skip_modules = ["model.vision_tower", "model.multi_modal_projector", "lm_head"]  # as ours
    base = AutoModelForImageTextToText.from_pretrained(model, quantization_config=quantization, dtype=torch.float32)
    resident = sum(t.numel() * t.element_size() for t in (*base.parameters(), *base.buffers()))
    targets = rf"model\.language_model\..*\.({'|'.join(LLAMA_LINEARS)})"
    config = PeftLoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=targets)
    peft_model = get_peft_model(base, config)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=0.01, weight_decay=0.0)
    rows = [json.loads(line) for line in train_rows.read_text().splitlines()]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(SEED)).tolist()
    peft_model.train()
    for step in range(LEARN_STEPS):
        examples = [processor_example(processor, rows[order[(4 * step + i) % len(rows)]], train_rows.parent)
                    for i in range(4)]  # fmt: skip
        total = sum(reply_loss_sum(peft_model, batch, labels) for batch, labels in examples)
        (total / sum(int((labels[0, 1:] != -100).sum()) for _, labels in examples)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return held_out_accuracy(peft_model.eval(), processor, held), resident


def test_images_matter(color_llava: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Squares of three colors (jittered, 16 each) with "What color is this square?" and "It is red." (or green, or
    blue): after LEARN_STEPS steps on 2 ranks (bnb, FSDP2) the right answer is the likeliest for at least 90% of 30
    held-out squares. The same run with each color's squares answered with every color equally (the images carry
    nothing) stays near chance (at most 50%). transformers + PEFT on the same model, rows and settings gets there in
    the same steps (calibration)."""
    from peft import PeftModel
    from transformers import AutoProcessor

    colors = [color for color in COLORS for _ in range(16)]
    names = list(COLORS)
    rotated = [names[(names.index(color) + i) % 3] for i, color in enumerate(colors)]  # 6/5/5 of each per color
    train_rows = square_rows(tmp_path_factory.mktemp("train"), colors, jitter=40, seed=1)
    shuffled = square_rows(tmp_path_factory.mktemp("shuffled"), colors, answers=rotated, jitter=40, seed=1)
    held = square_rows(tmp_path_factory.mktemp("held"), [c for c in COLORS for _ in range(10)], jitter=40, seed=2)
    processor = AutoProcessor.from_pretrained(color_llava)
    accuracy, outs = {}, {}
    for name, rows in (("images", train_rows), ("shuffled", shuffled)):
        out = outs[name] = tmp_path_factory.mktemp(f"learn-{name}")
        train(["--model", str(color_llava), "--quant", "bnb", "--dataset", str(rows), *COMMON, "--output_dir",
               str(out), "--batch_size", "2", "--max_steps", str(LEARN_STEPS)], nproc=2)  # fmt: skip
        base = quantized_base(color_llava, "bnb", out)
        trained = PeftModel.from_pretrained(dequantized_transformers_model(color_llava, base), out).eval()
        accuracy[name] = held_out_accuracy(trained, processor, held)
    accuracy["peer"], peer_bytes = peer_accuracy(color_llava, train_rows, held, processor)
    print(f"held-out accuracy after {LEARN_STEPS} steps: {accuracy}")
    # Memory: the ranks hold between them what transformers' 4-bit loading holds in one process (plus the fp32
    # adapters), each about half of it.
    first = next(r for r in read_metrics(outs["images"]) if "loss" in r)
    per_rank, adapters = first["param_bytes_per_rank"], 4 * first["trainable_parameters"]
    print(f"resident bytes per rank {per_rank} (adapters {adapters} in all), transformers 4-bit {peer_bytes}")
    assert sum(per_rank) - adapters <= 1.05 * peer_bytes and max(per_rank) <= 0.51 * sum(per_rank)
    assert accuracy["images"] >= 0.9, accuracy
    assert accuracy["shuffled"] <= 0.5, accuracy
    assert accuracy["peer"] >= 0.9, accuracy
    after_training(color_llava, outs["images"], held, tmp_path_factory.mktemp("merged") / "merged")


def after_training(model: Path, adapter: Path, held: Path, merged: Path) -> None:
    """The trained adapter answers about held-out squares through scripts/generate.py --image, on the base
    quantized as training quantized it; scripts/merge_adapter.py writes a whole VLM that transformers'
    image-text class loads, its vision tower and projector the base's own weights and its language model merged,
    and that answers the same."""
    from transformers import AutoModelForImageTextToText

    from scripts import generate, merge_adapter

    rows = [json.loads(line) for line in held.read_text().splitlines()]
    picks = [next(row for row in rows if row["messages"][-1]["content"][0]["text"] == f"It is {c}.") for c in COLORS]

    def answers(*flags: str) -> list[str]:
        said = []
        for row in picks:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                assert generate.main([*flags, "--image", str(held.parent / row["images"][0]), "--prompt", QUESTION,
                                      "--max_new_tokens", "8", "--precision", "fp32"]) == 0  # fmt: skip
            said.append(out.getvalue().strip().splitlines()[-1])
        return said

    expected = [f"It is {color}." for color in COLORS]
    assert answers("--model", str(model), "--adapter", str(adapter)) == expected
    assert merge_adapter.main(["--model", str(model), "--adapter", str(adapter), "--output", str(merged),
                               "--dtype", "fp32"]) == 0  # fmt: skip
    whole = AutoModelForImageTextToText.from_pretrained(merged, dtype=torch.float32).state_dict()
    base = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).state_dict()
    assert set(whole) == set(base)
    language = [k for k in base if k.startswith("model.language_model.layers.")]
    assert all(torch.equal(whole[k], base[k]) for k in base if k not in language)
    assert sum(not torch.equal(whole[k], base[k]) for k in language) == 14  # 7 adapted linears in each of 2 layers
    assert answers("--model", str(merged)) == expected


@pytest.mark.parametrize("resume_ranks", [2, 1], ids=["same-world-size", "1-rank"])
def test_image_rows_resume_exactly(vlms: dict[str, Path], tmp_path: Path, resume_ranks: int) -> None:
    """LLaVA on image rows (bnb, FSDP2): steps 3-4 after a resume from step 2 equal the uninterrupted 2-rank run's,
    on 2 ranks (dropout on: the random state is restored) and on 1 rank with the same global batch (2; dropout off,
    as docs/checkpoints.md says: another world size starts the random state afresh)."""
    from tests.conftest import stopped_at

    data = square_rows(tmp_path, ["red", "green", "blue", "red", "blue", "green"])
    flags = [*COMMON, "--model", str(vlms["llava"]), "--quant", "bnb", "--dataset", str(data), "--lora_dropout",
             "0.1" if resume_ranks == 2 else "0", "--save_steps", "2", "--max_steps", "4"]  # fmt: skip
    whole = tmp_path / "whole"
    train([*flags, "--output_dir", str(whole)], nproc=2)
    dropout = json.loads((whole / "adapter_config.json").read_text())["lora_dropout"]
    assert dropout == (0.1 if resume_ranks == 2 else 0.0)
    out = tmp_path / "resumed"
    stopped_at(whole, out, step=2)
    train([*flags, "--output_dir", str(out), "--resume_from", "auto", "--batch_size", str(2 // resume_ranks)],
          nproc=resume_ranks)  # fmt: skip
    resumed = [r for r in read_metrics(out) if "loss" in r]
    uninterrupted = [r for r in read_metrics(whole) if "loss" in r][2:]
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(resumed, uninterrupted, strict=True):
        for key, tolerance in (("loss", 1e-6), ("grad_norm", 1e-5)):
            assert math.isclose(a[key], b[key], rel_tol=tolerance), (a["step"], key, a[key], b[key])


def test_dpo_on_image_pairs_first_step_matches_transformers_with_peft(
    vlms: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """TRL's vision preference rows (images, prompt, chosen, rejected) train DPO on LLaVA (bnb, FSDP2, 2 ranks x 1
    pair). At step 1 the policy is the reference, so the loss is ln 2 and its gradient is that of
    -(beta / 2) x the mean over pairs of (log p(chosen) - log p(rejected)): its norm is computed here with
    transformers + PEFT on what LLaVA's processor makes of each side, as is the label-token count."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, set_peft_model_state_dict
    from transformers import AutoProcessor

    model, beta = vlms["llava"], 0.1
    root = tmp_path_factory.mktemp("image-pairs")
    squares = [json.loads(line) for line in square_rows(root, ["red", "blue"], noise=60).read_text().splitlines()]
    pairs = [{"images": row["images"], "prompt": row["messages"][:1],
              "chosen": [{"role": "assistant", "content": [{"type": "text", "text": f"It is {right}."}]}],
              "rejected": [{"role": "assistant", "content": [{"type": "text", "text": f"It is {wrong}."}]}]}
             for row, right, wrong in zip(squares, ["red", "blue"], ["green", "red"], strict=True)]  # fmt: skip
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    out = tmp_path_factory.mktemp("image-dpo")
    train(["--model", str(model), "--quant", "bnb", "--dataset", str(data), "--objective", "dpo", "--beta", str(beta),
           *COMMON, "--output_dir", str(out), "--max_steps", "1"], nproc=2)  # fmt: skip
    first = next(r for r in read_metrics(out) if "loss" in r)

    base = quantized_base(model, "bnb", out)
    peft_model = get_peft_model(dequantized_transformers_model(model, base), PeftLoraConfig.from_pretrained(out))
    set_peft_model_state_dict(peft_model, initial_adapter(model, "bnb", rank=RANK, alpha=ALPHA, seed=SEED))
    processor = AutoProcessor.from_pretrained(model)
    peft_model.train()
    margins, tokens = [], 0
    for pair in pairs:
        logp = {}
        for side in ("chosen", "rejected"):
            batch, labels = processor_example(processor, {"images": pair["images"],
                                                          "messages": pair["prompt"] + pair[side]}, root)  # fmt: skip
            logp[side] = -reply_loss_sum(peft_model, batch, labels)
            tokens += int((labels[0, 1:] != -100).sum())
        margins.append(logp["chosen"] - logp["rejected"])
    (-(beta / 2) * torch.stack(margins).mean()).backward()

    assert first["label_tokens"] == tokens
    assert first["loss"] == pytest.approx(math.log(2), rel=1e-6)
    grad_norm = trainable_grad_norm(peft_model)
    assert first["grad_norm"] == pytest.approx(grad_norm, rel=1e-4), f"grad_norm: run {first['grad_norm']}, {grad_norm}"
