"""The unsharded reference that 2-rank runs are compared with: transformers' own model of the checkpoint with the
bytes training quantized dequantized into its weights, and PEFT's LoRA set to the adapter values training starts
from.

Of this project's code the reference uses only loading/quantizing, the adapter initialisation (under the keys PEFT
names them by) and the tokenization and padding; the forward, the loss and the gradients are transformers' and
PEFT's.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from qlora_fsdp.checkpoint.manifest import intra_op_threads, layer_digests, read_manifest
from qlora_fsdp.config.options import LoraConfig, ModelConfig, QuantConfig
from qlora_fsdp.data.formats import IGNORE_INDEX, load_examples, pad_token_id
from qlora_fsdp.data.rows import collate, fit_examples
from qlora_fsdp.model.hub import load_tokenizer
from qlora_fsdp.model.lora import adapter_keys, init_adapters, inject_lora, lora_layers
from qlora_fsdp.model.skeleton import Skeleton, build_skeleton
from qlora_fsdp.model.streaming import load_model
from qlora_fsdp.quant import make_backend
from qlora_fsdp.quant.base import QuantizedLinear
from qlora_fsdp.quant.experts import QuantizedExperts

CPU = torch.device("cpu")


def make_quant_backend(quant: str):
    return make_backend(QuantConfig(quant=quant), storage_dtype=torch.uint8, compute_dtype=torch.float32)


def initial_adapter(model: Path, quant: str, *, rank: int, alpha: float, seed: int) -> dict[str, torch.Tensor]:
    """The adapter training starts from (--lora_target_modules all), under the keys PEFT saves it by.

    Built as trainer._build_model builds it (skeleton on meta, inject_lora, adapter_keys), and initialised as it is
    once each unit has loaded: init_adapters on the unit's adapters, drawn from (seed, unit name), B zero. Only the
    adapters are given memory here; the base stays on meta.
    """
    skeleton = build_skeleton(
        ModelConfig(model=str(model)), backend=make_quant_backend(quant), param_dtype=torch.float32, adapt_experts=True
    )
    lora = LoraConfig(lora_rank=rank, lora_alpha=alpha, lora_dropout=0.0, lora_target_modules="all")
    peft_model = inject_lora(skeleton.model, lora, dtype=torch.float32)
    keys = adapter_keys(peft_model)
    inside: set[int] = set()
    for name, layer in skeleton.units.items():
        layers = lora_layers(layer)
        for adapter in layers:
            adapter.to_empty(device=CPU)
            inside.add(id(adapter))
        init_adapters(layers, seed=seed, name=name)
    outside = [m for m in lora_layers(peft_model) if id(m) not in inside]
    for adapter in outside:
        adapter.to_empty(device=CPU)
    init_adapters(outside, seed=seed, name="")
    values = {}
    for module, names in keys.items():
        for attr, key in names.items():
            values[key] = getattr(module, attr).detach().clone()
    return values


def quantized_base(model: Path, quant: str, out: Path) -> Skeleton:
    """The model as the run at `out` quantized it, whole, in this process (with the run's intra-op threads: HQQ's
    optimizer on the CPU gives other bytes with another thread count)."""
    manifest = read_manifest(out)
    assert manifest is not None
    with intra_op_threads(manifest.cpu_threads):
        return load_model(
            ModelConfig(model=str(model)), backend=make_quant_backend(quant), device=CPU, param_dtype=torch.float32
        )


def check_quantized_like(base: Skeleton, out: Path) -> None:
    """The premise of every comparison: this process holds the bytes the ranks at `out` trained on."""
    manifest = read_manifest(out)
    assert manifest is not None
    assert sorted(manifest.layers) == sorted(base.quantized)
    differ = [n for n in base.quantized if layer_digests(base.model.get_submodule(n)) != manifest.layers[n]]
    assert not differ, f"the reference quantized other bytes than training did: {differ[:3]}"


def dequantized_transformers_model(model_path: Path, base: Skeleton) -> nn.Module:
    """transformers' own model of the checkpoint (fp32, built by the auto class its config names) with every
    quantized weight replaced by its dequantization: each quantized linear's into its `weight`, each expert's into
    its slice of the fused `gate_up_proj`/`down_proj`. Every quantized layer is placed (checked)."""
    from transformers import AutoConfig

    from qlora_fsdp.model.vision import auto_model_class

    config = AutoConfig.from_pretrained(model_path)
    model = auto_model_class(config, where=str(model_path)).from_pretrained(model_path, dtype=torch.float32)
    experts = {n: m for n, m in base.model.named_modules() if isinstance(m, QuantizedExperts)}
    inside = tuple(f"{n}." for n in experts)
    placed = 0
    with torch.no_grad():
        for name, module in experts.items():
            fused = model.get_submodule(name)
            for attr, layers in (("gate_up_proj", module.gate_up), ("down_proj", module.down)):
                weight = module.fused(attr)  # in transformers' layout, transposed where its is
                assert getattr(fused, attr).shape == weight.shape, (name, attr)
                getattr(fused, attr).copy_(weight)
                placed += sum(isinstance(layer, QuantizedLinear) for layer in layers)
        for name, module in base.model.named_modules():
            if isinstance(module, QuantizedLinear) and not (inside and name.startswith(inside)):
                target = model.get_submodule(name).weight
                assert target.shape == (module.out_features, module.in_features), name
                target.copy_(module.dequantize())
                placed += 1
    assert placed == len(base.quantized)
    return model


def step_batches(model: Path, data: Path, *, context: int, rows: int) -> list[dict[str, torch.Tensor]]:
    """The rows tokenized and masked as training does, each padded as a batch of one (what each rank gets); all
    `rows` fit the context whole (checked)."""
    tokenizer = load_tokenizer(model)
    samples, stats = fit_examples(load_examples(str(data)), tokenizer, context_length=context, train_on_inputs=False)
    assert stats.samples == rows and not stats.truncated and not stats.dropped, stats
    pad = pad_token_id(tokenizer)
    return [
        collate([{"input_ids": ids, "labels": labels}], pad_id=pad, context_length=context, pad_to_context=False)
        for ids, labels in samples
    ]


def label_loss_sum(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over the label tokens of `batch`, from the model's whole logits, and their
    count."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    labels = batch["labels"][:, 1:]
    loss = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss, int((labels != IGNORE_INDEX).sum())


def trainable_grad_norm(model: nn.Module) -> float:
    """The 2-norm of every trainable parameter's gradient, as training logs grad_norm."""
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None for g in grads), "an adapter of the reference is not in its graph"
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()


def trained_adapter_model(model: Path, out: Path, quant: str) -> nn.Module:
    """PEFT's model of the adapter the run at `out` saved, in eval mode, on transformers' model holding the weights
    training computed with: the base quantized as the run quantized it (checked), dequantized."""
    from peft import PeftModel

    base = quantized_base(model, quant, out)
    check_quantized_like(base, out)
    reference = dequantized_transformers_model(model, base)
    del base
    return PeftModel.from_pretrained(reference, str(out)).eval()
