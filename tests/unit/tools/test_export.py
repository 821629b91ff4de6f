"""Merge, export and generation against the model training builds, on the tiny random model.

The reference is the training-time model: skeleton + LoRA + weights streamed through the training backend, in one
process, as tests/distributed/options_worker.py's reference builds it, with a non-zero random adapter (a fresh
adapter's B is zero and would hide any merge error). Everything is fp32 compute so the tolerances mean something.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from qlora_fsdp.checkpoint.manifest import LayerDigests, training_manifest
from qlora_fsdp.config.options import build_config
from qlora_fsdp.data.formats import format_prompt
from qlora_fsdp.model.hub import load_tokenizer
from qlora_fsdp.model.lora import init_adapters, inject_lora, lora_layers
from qlora_fsdp.model.skeleton import build_skeleton
from qlora_fsdp.model.streaming import stream_weights
from qlora_fsdp.parallel.precision import PRECISIONS, quant_compute_dtype
from qlora_fsdp.quant import make_backend
from qlora_fsdp.quant.base import QuantizedLinear
from scripts import export_quantized, generate, merge_adapter
from scripts.make_tiny_model import build_tiny_model

PROMPTS = [
    'Give the opposite of "down".',
    "What day comes after Saturday?",
    "Find the largest number.",
    "Name a primary color.",
    "Translate 'cat' into French.",
    "What is two plus two?",
    "Write a word that rhymes with blue.",
    "Spell the word apple backwards.",
]


class Trained:
    """The training-time model for some flags, with a random non-zero adapter saved as train.py saves it (with
    `manifest`, beside train.py's manifest, made by the same functions from the same loading)."""

    def __init__(
        self,
        model_dir: Path,
        out: Path,
        *,
        quant: str,
        train_type: str = "lora",
        seed: int = 0,
        manifest: bool = False,
        flags: dict[str, str] | None = None,
    ) -> None:
        self.flags = {"model": str(model_dir), "quant": quant, "precision": "fp32", "train_type": train_type}
        self.flags |= flags or {}
        cfg = build_config({**self.flags, "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.0}).validate()
        mode = PRECISIONS[cfg.fsdp.precision]
        compute_dtype = quant_compute_dtype(mode, cfg.quant.compute_dtype)
        backend = make_backend(cfg.quant, storage_dtype=torch.uint8, compute_dtype=compute_dtype)
        skeleton = build_skeleton(cfg.model, backend=backend, param_dtype=mode.param_dtype)
        digests = LayerDigests(skeleton.model, skeleton.quantized)
        model = inject_lora(skeleton.model, cfg.lora, dtype=mode.param_dtype)
        stream_weights(skeleton, backend=backend, device=torch.device("cpu"))
        digests.add(skeleton.model)
        init_adapters(lora_layers(model), seed=seed, name="")
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for layer in lora_layers(model):
                b = layer.lora_B["default"].weight
                b.copy_(torch.randn(b.shape, generator=generator) * 0.05)
        self.model = model.eval()
        self.skeleton = skeleton
        self.adapter = out / f"adapter-{quant}-{train_type}"
        model.save_pretrained(str(self.adapter))
        self.manifest = training_manifest(
            cfg, model_path=model_dir, device=torch.device("cpu"), backend=backend, digests=digests
        )
        if manifest:
            self.manifest.write(self.adapter)
        self.tokenizer = load_tokenizer(model_dir)

    def packed(self) -> dict[str, torch.Tensor]:
        """Each quantized layer's packed bytes as training holds them, by module name (without PEFT's prefix)."""
        return {
            name.replace(".base_layer", ""): module.packed_bytes().clone()
            for name, module in self.skeleton.model.named_modules()
            if isinstance(module, QuantizedLinear)
        }


def batch(tokenizer, prompts: list[str] = PROMPTS) -> dict[str, torch.Tensor]:
    texts = [format_prompt(p) for p in prompts]
    tokenizer.padding_side = "left"
    return tokenizer(texts, add_special_tokens=False, return_tensors="pt", padding=True)


@torch.no_grad()
def logits(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits.float()


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tied embeddings and one shard: the layout of SmolLM2 (the head is not in the checkpoint)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-tied"), seed=1, tie_word_embeddings=True, num_shards=1)


def _merge(args: list[str]) -> None:
    assert merge_adapter.main(args) == 0


def _from_pretrained(path: Path, **kwargs):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kwargs)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


@pytest.mark.parametrize(
    ("quant", "train_type", "tied"),
    [("bnb", "lora", False), ("hqq", "lora", True), ("bnb", "dora", True)],
    ids=["bnb-lora", "hqq-lora-tied", "bnb-dora-tied"],
)
def test_original_merge_equals_peft_on_the_full_precision_base(
    tiny_model: Path, tied_model: Path, tmp_path: Path, quant: str, train_type: str, tied: bool
) -> None:
    """The merged model computes what PEFT computes from base + adapter: logits on 8 prompts, greedy tokens."""
    from peft import PeftModel

    base = tied_model if tied else tiny_model
    trained = Trained(base, tmp_path, quant=quant, train_type=train_type)
    out = tmp_path / "merged"
    _merge(["--model", str(base), "--adapter", str(trained.adapter), "--output", str(out), "--dtype", "fp32"])
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    merged = _from_pretrained(out, dtype=torch.float32)
    peft = PeftModel.from_pretrained(_from_pretrained(base, dtype=torch.float32), str(trained.adapter)).eval()
    inputs = batch(trained.tokenizer)
    expected = logits(peft, inputs)
    assert (logits(merged, inputs) - expected).abs().max().item() < 1e-4
    # The adapter really changes the model: a merge that dropped it would fail the check above.
    with peft.disable_adapter():
        assert (logits(peft, inputs) - expected).abs().max().item() > 1e-2
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": trained.tokenizer.pad_token_id}
    assert torch.equal(merged.generate(**inputs, **kwargs), peft.generate(**inputs, **kwargs))


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_dequantized_merge_equals_the_training_time_model(tiny_model: Path, tmp_path: Path, quant: str) -> None:
    trained = Trained(tiny_model, tmp_path, quant=quant)
    out = tmp_path / "merged"
    flags = ["--quant", quant, "--precision", "fp32", "--base_weights", "dequantized", "--dtype", "fp32"]
    _merge(["--model", str(tiny_model), "--adapter", str(trained.adapter), "--output", str(out), *flags])
    merged = _from_pretrained(out, dtype=torch.float32)
    inputs = batch(trained.tokenizer)
    expected = logits(trained.model, inputs)
    assert (logits(merged, inputs) - expected).abs().max().item() < 1e-3
    # ... and closer than a merge into the original weights, which ignores the quantization error.
    original = tmp_path / "original"
    _merge(
        ["--model", str(tiny_model), "--adapter", str(trained.adapter), "--output", str(original), "--dtype", "fp32"]
    )
    quantization_gap = (logits(_from_pretrained(original, dtype=torch.float32), inputs) - expected).abs().max()
    assert (logits(merged, inputs) - expected).abs().max() < quantization_gap / 10


@pytest.fixture(scope="module")
def bnb_export(tied_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Trained, Path]:
    """The tied model's training-time bnb model and export_quantized.py's export of it, for the tests that load it."""
    root = tmp_path_factory.mktemp("bnb-export")
    trained = Trained(tied_model, root, quant="bnb")
    out = root / "export"
    args = ["--model", str(tied_model), "--quant", "bnb", "--precision", "fp32", "--output", str(out)]
    assert export_quantized.main(args) == 0
    return trained, out


def bnb_layers(model: nn.Module) -> dict[str, nn.Module]:
    """bitsandbytes' own Linear4bit modules by name: what transformers' 4-bit loading built."""
    import bitsandbytes as bnb

    return {name: m for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def on_cpu_kernel(layers: dict[str, nn.Module]) -> list[bool]:
    """Per layer, whether bitsandbytes has repacked its weight for the CPU kernel (its eval forward does that once,
    on an AVX512-BF16 CPU, for input without grad; from then on matmul_4bit runs that kernel)."""
    return [bool(getattr(m.weight.quant_state, "packing_format_for_cpu", False)) for m in layers.values()]


def test_bnb_export_is_what_training_used(bnb_export: tuple[Trained, Path]) -> None:
    """Packed bytes identical to training's, loaded by transformers as 4-bit without quantizing again, and with the
    adapter the training-time forward.

    The forward comparison is exact math, so it keeps bitsandbytes on the path training takes (dequantize, fp32
    matmul): on an AVX512-BF16 CPU, Linear4bit's eval forward would switch to a bf16 kernel and be off by ~4e-3.
    Its capability switch is turned off here (a no-op on CPUs without native bf16); the test below checks the kernel.
    """
    from peft import PeftModel

    trained, out = bnb_export
    expected = trained.packed()
    files = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    for name, packed in expected.items():
        with safe_open(str(out / files[f"{name}.weight"]), framework="pt") as f:
            stored = f.get_tensor(f"{name}.weight")
        assert stored.dtype == torch.uint8 and torch.equal(stored.flatten(), packed), name
    assert json.loads((out / "config.json").read_text())["quantization_config"]["load_in_4bit"] is True

    model = _from_pretrained(out, dtype=torch.float32, device_map="cpu")
    loaded = bnb_layers(model)
    assert sorted(loaded) == sorted(expected)
    for name, module in loaded.items():
        assert torch.equal(module.weight.data.view(torch.uint8).flatten(), expected[name]), name
        module.support_avx512bf16_for_cpu = False
    peft = PeftModel.from_pretrained(model, str(trained.adapter)).eval()
    inputs = batch(trained.tokenizer)
    assert (logits(peft, inputs) - logits(trained.model, inputs)).abs().max().item() < 1e-5
    assert not any(on_cpu_kernel(loaded)), "bitsandbytes took its CPU kernel: this comparison is not exact math"


# bitsandbytes' CPU kernel rounds activations and absmax to bf16 (8 significant bits: up to 2^-8 = 0.4% each);
# measured on this model: 0.23% of the largest logit. 1% of it leaves room for a few roundings to add up.
KERNEL_TOLERANCE = 1e-2


def test_bnb_export_on_the_cpu_kernel_stays_close(bnb_export: tuple[Trained, Path]) -> None:
    """What generate.py gives a user of an AVX512-BF16 CPU from the export: transformers' 4-bit loading + PEFT in
    eval mode without grad, which runs bitsandbytes' bf16 CPU kernel, stays within KERNEL_TOLERANCE of the largest
    training-time logit."""
    import bitsandbytes.functional as bnbf

    from qlora_fsdp.tools.config import GenerateConfig, build_tool_config
    from qlora_fsdp.tools.generate import load_for_generation

    if not bnbf.has_avx512bf16():
        pytest.skip(
            "bitsandbytes finds no AVX512-BF16 here, so its CPU kernel is not registered and Linear4bit never "
            "switches to it; the exact test covers this CPU"
        )
    trained, out = bnb_export
    flags = {"model": str(out), "adapter": str(trained.adapter), "precision": "fp32", "prompt": PROMPTS[0]}
    model, _ = load_for_generation(*build_tool_config(GenerateConfig, flags))
    loaded = bnb_layers(model)
    assert loaded and all(m.support_avx512bf16_for_cpu for m in loaded.values())
    inputs = batch(trained.tokenizer)
    got = logits(model, inputs)
    assert all(on_cpu_kernel(loaded)), "bitsandbytes kept its plain-torch path: the kernel went untested"
    want = logits(trained.model, inputs)
    error = (got - want).abs().max().item()
    assert error < KERNEL_TOLERANCE * want.abs().max().item()
    # Not exact: the kernel is what the exact test above must turn off.
    assert error > 1e-5


def test_hqq_export_is_what_training_used_in_hqqs_own_format(tied_model: Path, tmp_path: Path) -> None:
    """Integer W_q identical to training's bytes, the key layout of HQQ's own HQQLinear.state_dict(), loaded by
    HQQ's own loader, and with the adapter the training-time forward."""
    from hqq.core.quantize import BaseQuantizeConfig, HQQLinear
    from hqq.models.hf.base import AutoHQQHFModel
    from peft import PeftModel

    trained = Trained(tied_model, tmp_path, quant="hqq")
    out = tmp_path / "export"
    args = ["--model", str(tied_model), "--quant", "hqq", "--precision", "fp32", "--output", str(out)]
    assert export_quantized.main(args) == 0
    saved = torch.load(out / "qmodel.pt", weights_only=True)
    expected = trained.packed()
    reference = HQQLinear(nn.Linear(128, 128, bias=False), BaseQuantizeConfig(nbits=4, group_size=64), device="cpu")
    reference.encoded_state_dict = False
    for name, packed in expected.items():
        assert saved[name]["W_q"].dtype == torch.uint8, name
        assert torch.equal(saved[name]["W_q"].flatten().view(torch.uint8), packed), name
        assert set(saved[name]) == set(reference.state_dict()), name

    model = AutoHQQHFModel.from_quantized(str(out), compute_dtype=torch.float32, device="cpu")
    assert sorted(n for n, m in model.named_modules() if isinstance(m, HQQLinear)) == sorted(expected)
    peft = PeftModel.from_pretrained(model, str(trained.adapter)).eval()
    inputs = batch(trained.tokenizer)
    assert (logits(peft, inputs) - logits(trained.model, inputs)).abs().max().item() < 1e-5


def exported_base_reloaded(out: Path, quant: str) -> dict[str, torch.Tensor]:
    """The export at `out` loaded back as a training base with --quant `quant` (its own settings, the file's):
    each quantized layer's packed bytes by module name."""
    from qlora_fsdp.config.options import ModelConfig, QuantConfig
    from qlora_fsdp.model.formats import checkpoint_format
    from qlora_fsdp.model.streaming import load_model

    settled = checkpoint_format(out).quant_settings(QuantConfig(quant=quant), frozenset())
    backend = make_backend(settled, storage_dtype=torch.uint8, compute_dtype=torch.float32)
    skeleton = load_model(ModelConfig(model=str(out)), backend=backend, device=torch.device("cpu"),
                          param_dtype=torch.float32)  # fmt: skip
    return {n: m.packed_bytes() for n, m in skeleton.model.named_modules() if isinstance(m, QuantizedLinear)}


def test_an_exported_bnb_base_trains_on_as_it_is(bnb_export: tuple[Trained, Path]) -> None:
    """export_quantized.py's bnb output is a pre-quantized checkpoint: loaded back with --quant bnb every layer
    holds the bytes training held, with no second rounding."""
    trained, out = bnb_export
    expected = trained.packed()
    reloaded = exported_base_reloaded(out, "bnb")
    assert sorted(reloaded) == sorted(expected)
    assert all(torch.equal(reloaded[n], expected[n]) for n in expected)


def test_an_exported_hqq_base_trains_on_as_it_is(tied_model: Path, tmp_path: Path) -> None:
    """export_quantized.py's HQQ output (qmodel.pt) loads back with --quant hqq holding training's bytes; with
    --quant none it is HQQ's exact dequantization, which the training-time layers compute too."""
    from qlora_fsdp.config.options import ModelConfig
    from qlora_fsdp.model.streaming import load_model

    trained = Trained(tied_model, tmp_path, quant="hqq")
    out = tmp_path / "export"
    args = ["--model", str(tied_model), "--quant", "hqq", "--precision", "fp32", "--output", str(out)]
    assert export_quantized.main(args) == 0
    expected = trained.packed()
    reloaded = exported_base_reloaded(out, "hqq")
    assert sorted(reloaded) == sorted(expected)
    assert all(torch.equal(reloaded[n], expected[n]) for n in expected)
    plain = load_model(ModelConfig(model=str(out)), backend=None, device=torch.device("cpu"), param_dtype=torch.float32)
    layer = "model.layers.0.mlp.down_proj"
    weight = plain.model.get_submodule(layer).weight
    training = trained.skeleton.model.get_submodule(f"{layer}.base_layer")  # under its LoRA wrapper
    assert torch.equal(weight, training.dequantize())


def test_generate_answers_as_the_model_does(tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """generate.py on base + adapter (training-time quantized) prints the model's own greedy continuation of the
    training prompt, and --chat answers each input line the same way."""
    trained = Trained(tiny_model, tmp_path, quant="hqq")
    inputs = batch(trained.tokenizer, PROMPTS[:1])
    with torch.no_grad():
        out = trained.model.generate(**inputs, max_new_tokens=6, do_sample=False)
    expected = trained.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()
    args = ["--model", str(tiny_model), "--adapter", str(trained.adapter), "--quant", "hqq", "--precision", "fp32"]
    assert generate.main([*args, "--prompt", PROMPTS[0], "--max_new_tokens", "6"]) == 0
    assert capsys.readouterr().out.strip() == expected

    from qlora_fsdp.tools.config import GenerateConfig, build_tool_config
    from qlora_fsdp.tools.generate import run_generate

    cfg, options = build_tool_config(
        GenerateConfig,
        {"model": str(tiny_model), "adapter": str(trained.adapter), "quant": "hqq", "precision": "fp32",
         "chat": "true", "max_new_tokens": "6"},
    )  # fmt: skip
    stdout = io.StringIO()
    run_generate(cfg, options, stdin=io.StringIO(f"{PROMPTS[0]}\n\n{PROMPTS[0]}\nexit\nnot read\n"), stdout=stdout)
    assert stdout.getvalue().splitlines() == [expected, expected]
