"""The peer every figure is compared with: what people write instead of qlora-fsdp, Hugging Face 4-bit loading + PEFT
LoRA + a plain torch AdamW loop in one process, configured like our runs (NF4 + double quant, the same LoRA)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def bnb_config(*, dtype: torch.dtype = torch.bfloat16):
    """The issue's peer config plus double quant (both sides store the same bytes); `dtype` stores and computes."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_storage=dtype, bnb_4bit_quant_type="nf4",
                              bnb_4bit_compute_dtype=dtype, bnb_4bit_use_double_quant=True)  # fmt: skip


def load_peer(path: str | Path, *, device: str, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """HF's own 4-bit loading onto `device` ("cpu" or "cuda"), `dtype` for the unquantized weights and compute."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, quantization_config=bnb_config(dtype=dtype), device_map=device,
                                                dtype=dtype, use_cache=False)  # fmt: skip


def add_lora(model: nn.Module, *, rank: int, alpha: float, dropout: float, checkpointing: bool) -> nn.Module:
    """PEFT LoRA on LLAMA_LINEARS (what `--lora_target_modules all` selects), else PEFT's defaults (fp32 adapters)."""
    from peft import LoraConfig, get_peft_model

    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout,
                                            target_modules=list(LLAMA_LINEARS), task_type="CAUSAL_LM"))  # fmt: skip


def dummy_batches(path: str | Path, *, batch_size: int, context_length: int, count: int) -> list[dict]:
    """The same rows our CLI trains on with `--dataset dummy` (no padding: every row fills the context)."""
    from qlora_fsdp.data.formats import load_examples, pad_token_id
    from qlora_fsdp.data.rows import collate, fit_examples
    from qlora_fsdp.model.hub import load_tokenizer

    tokenizer = load_tokenizer(Path(path))
    examples = load_examples("dummy", samples=batch_size * count)
    samples, _ = fit_examples(examples, tokenizer, context_length=context_length, train_on_inputs=False)
    items = [{"input_ids": ids, "labels": labels} for ids, labels in samples]
    return [collate(items[i * batch_size : (i + 1) * batch_size], pad_id=pad_token_id(tokenizer),
                    context_length=context_length, pad_to_context=True) for i in range(count)]  # fmt: skip


def train_steps(model: nn.Module, batches: list[dict], *, device: torch.device) -> Iterator[tuple[int, float]]:
    """One step per batch at our --lr 1e-5 and --grad_norm 0.3, synchronised; yields (tokens, seconds)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5, weight_decay=0.0)
    model.train()
    for batch in batches:
        start = time.perf_counter()
        out = model(**{k: batch[k].to(device) for k in ("input_ids", "attention_mask", "labels")})
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 0.3)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":  # a CPU step has finished when its calls return
            torch.cuda.synchronize(device)
        yield int(batch["attention_mask"].sum()), time.perf_counter() - start
