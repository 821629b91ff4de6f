"""Sample packing: tokenized samples laid end to end in rows of exactly --context_length.

A packed row must train exactly as its samples would alone. Three things see to it:
- positions restart at 0 at every sample (RoPE sees each sample as if it began the row);
- a sample's first token is never a label, so no label is predicted from another sample's last token (unpacked,
  nothing predicts position 0 either: the label-token count is the same both ways);
- attention stops at every sample boundary. transformers does this itself when a batch comes with `position_ids`
  and *no* attention mask (masking_utils finds where the positions restart): SDPA and eager get a block-diagonal
  causal mask; flash attention uses its varlen kernel, which it only does for a batch of one row (`model_inputs`
  lays the rows end to end for it).
The space left at the end of a row is padding: a segment of its own (positions from 0, no labels), so no real token
attends to it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import torch

from qlora_fsdp.data import (
    IGNORE_INDEX,
    Example,
    Sample,
    all_dropped_error,
    encode_examples,
    learned_tokens,
    pad_token_id,
)

FLASH_ATTENTION = "flash_attention_2"


@dataclass(frozen=True)
class PackStats:
    """What packing did: rows given, what was cut, and how full the packed rows are."""

    rows: int
    """Examples given."""
    truncated: int
    """Samples longer than the context, cut to it (without --packing_split)."""
    split: int
    """Samples longer than the context, split into several (with --packing_split)."""
    dropped: int
    """Samples (or split pieces) with nothing left to learn."""
    samples: int
    """Samples (and pieces) packed."""
    packed_rows: int
    real_tokens: int
    total_label_tokens: int
    context_length: int

    @property
    def efficiency(self) -> float:
        """Real tokens / row tokens: the share of the rows that is not padding."""
        return self.real_tokens / (self.packed_rows * self.context_length)


def fit_samples(samples: list[Sample], context_length: int, *, split: bool) -> tuple[list[Sample], int, int, int]:
    """Samples no longer than the context: (kept, truncated, split, dropped).

    Splitting cuts a long sample into pieces that start one token before the previous piece ends: a piece's first
    token is context only, so every token the whole sample would learn is learned exactly once.
    """
    kept: list[Sample] = []
    truncated = n_split = dropped = 0
    for ids, labels in samples:
        if len(ids) <= context_length:
            pieces = [(ids, labels)]
        elif split:
            n_split += 1
            starts = range(0, len(ids) - 1, context_length - 1)
            pieces = [(ids[s : s + context_length], labels[s : s + context_length]) for s in starts]
        else:
            truncated += 1
            pieces = [(ids[:context_length], labels[:context_length])]
        for piece in pieces:
            if learned_tokens(piece[1]):
                kept.append(piece)
            else:
                dropped += 1
    return kept, truncated, n_split, dropped


def assign_rows(lengths: list[int], context_length: int) -> list[list[int]]:
    """Sample indices per row, by best-fit decreasing: longest samples first, each into the fullest row it fits.

    Deterministic (ties go by index), so every rank packs the same rows; within a row samples keep dataset order.
    """
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row index) of rows with room, sorted
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        at = bisect.bisect_left(free, (length, -1))
        if at == len(free):
            row, room = len(rows), context_length
            rows.append([])
        else:
            room, row = free.pop(at)
        rows[row].append(index)
        if room - length > 1:  # a sample needs two tokens to learn one
            bisect.insort(free, (room - length, row))
    return [sorted(row) for row in rows]


def packed_row(parts: list[Sample], context_length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One row: input_ids, labels (-100 on each sample's first token and on padding), position_ids restarting at
    every sample, attention_mask marking the real tokens (for counting; the model gets none, see the module doc)."""
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    for sample_ids, sample_labels in parts:
        ids += sample_ids
        labels += [IGNORE_INDEX, *sample_labels[1:]]
        positions += range(len(sample_ids))
    real, n_pad = len(ids), context_length - len(ids)
    return {
        "input_ids": torch.tensor(ids + [pad_id] * n_pad, dtype=torch.long),
        "labels": torch.tensor(labels + [IGNORE_INDEX] * n_pad, dtype=torch.long),
        "position_ids": torch.tensor([*positions, *range(n_pad)], dtype=torch.long),
        "attention_mask": torch.tensor([1] * real + [0] * n_pad, dtype=torch.long),
    }


def pack_examples(
    examples: list[Example], tokenizer: Any, *, context_length: int, train_on_inputs: bool, split: bool
) -> tuple[list[dict[str, torch.Tensor]], PackStats]:
    """Packed rows of exactly context_length from the examples, and what packing did to them."""
    samples = encode_examples(examples, tokenizer, train_on_inputs=train_on_inputs)
    kept, truncated, n_split, dropped = fit_samples(samples, context_length, split=split)
    if not kept:
        raise all_dropped_error(examples, context_length)
    pad_id = pad_token_id(tokenizer)
    rows = assign_rows([len(ids) for ids, _ in kept], context_length)
    items = [packed_row([kept[i] for i in row], context_length, pad_id) for row in rows]
    stats = PackStats(
        rows=len(examples),
        truncated=truncated,
        split=n_split,
        dropped=dropped,
        samples=len(kept),
        packed_rows=len(items),
        real_tokens=sum(len(ids) for ids, _ in kept),
        total_label_tokens=sum(learned_tokens(labels) for _, labels in kept),
        context_length=context_length,
    )
    return items, stats


def model_inputs(batch: dict[str, torch.Tensor], device: torch.device, *, varlen: bool) -> dict[str, Any]:
    """The model's keyword arguments for a batch: input_ids, attention_mask, labels, position_ids.

    A packed batch (it has position_ids) goes without an attention mask, which is what makes transformers build
    per-sample attention from the positions. With flash attention (`varlen`), which does so only for a batch of one
    row, its rows are laid end to end: the last logit of a row then meets the next row's first label, which is -100.
    """
    out = {k: batch[k].to(device) for k in ("input_ids", "attention_mask", "labels") if k in batch}
    if "position_ids" not in batch:
        return {**out, "position_ids": None}
    out["position_ids"] = batch["position_ids"].to(device)
    out["attention_mask"] = None
    if varlen:
        out = {k: None if v is None else v.reshape(1, -1) for k, v in out.items()}
    return out


def attention_implementation(*, packing: bool, device: torch.device, dtype: torch.dtype) -> str:
    """flash_attention_2 for packed rows on a GPU where flash-attn is installed (it needs bf16/fp16), else sdpa."""
    if not packing or device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return "sdpa"
    from transformers.utils import is_flash_attn_2_available

    return FLASH_ATTENTION if is_flash_attn_2_available() else "sdpa"
