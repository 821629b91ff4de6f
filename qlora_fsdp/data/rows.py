"""Samples -> the rows a batch holds: cut to the context, packed or not, and padded per batch.

Rows are stored unpadded; `collate` pads a batch to its longest row rounded up to a multiple of 8 (or to
--context_length with --pad_to_context), so padding costs what the batch needs, not what the longest possible row
would. Padding is never learned and never attended to by a real token: an unpacked row is right-padded under its
attention mask; a packed row's padding is a segment of its own.

A packed row must train exactly as its samples would alone. Three things see to it:
- positions restart at 0 at every sample (RoPE sees each sample as if it began the row);
- a sample's first token is never a label, so no label is predicted from another sample's last token (unpacked,
  nothing predicts position 0 either: the label-token count is the same both ways);
- attention stops at every sample boundary. transformers does this itself when a batch comes with `position_ids`
  and *no* attention mask (masking_utils finds where the positions restart): SDPA and eager get a block-diagonal
  causal mask; flash attention uses its varlen kernel, which it only does for a batch of one row (`model_inputs`
  lays the rows end to end for it).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from qlora_fsdp.data.formats import IGNORE_INDEX, AnyExample, Sample, encode_examples, learned_tokens
from qlora_fsdp.data.images import ImageInputs
from qlora_fsdp.errors import UserError

IMAGE_PREFIX = "image:"
"""A batch's image inputs are under `image:NAME` (NAME as the processor names it: pixel_values, image_grid_thw)."""
DESIRABLE = "desirable"
"""A KTO batch's per-row labels (UnpairedRows): 1 for a desirable completion, 0 for an undesirable one."""
PAD_MULTIPLE = 8
"""Batches are padded to a multiple of this many tokens: tensor-core friendly, and fewer distinct shapes."""

def fit_sample(sample: Sample, context_length: int, *, split: bool) -> tuple[list[Sample], str, int]:
    """A sample as pieces no longer than the context, with something to learn: (pieces, "whole", "truncated"
    or "split", pieces dropped).

    Splitting cuts a long sample into pieces that start one token before the previous piece ends: a piece's first
    token is context only, so every token the whole sample would learn is learned exactly once.
    """
    ids, labels = sample
    if len(ids) <= context_length:
        how, pieces = "whole", [(ids, labels)]
    elif split:
        starts = range(0, len(ids) - 1, context_length - 1)
        how, pieces = "split", [(ids[s : s + context_length], labels[s : s + context_length]) for s in starts]
    else:
        how, pieces = "truncated", [(ids[:context_length], labels[:context_length])]
    kept = [piece for piece in pieces if learned_tokens(piece[1])]
    return kept, how, len(pieces) - len(kept)


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


def fit_pair(
    chosen: Sample, rejected: Sample, context_length: int, *, max_prompt_length: int = 0, keep_head: int = 0
) -> tuple[Sample, Sample, str]:
    """A preference pair's two sides within the context: (chosen, rejected, "whole" or "truncated").

    The replies are kept and the prompt is cut from the left, to --max_prompt_length (0: no limit of its own) and
    then to what the longer reply leaves of the context, each side keeping the same number of prompt tokens. The first
    `keep_head` tokens (the tokenizer's BOS) stay. A reply that alone outgrows the context keeps its beginning. A
    side's prompt is its tokens before the first label.
    """
    sides = []
    starts = [next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels)) for _, labels in
              (chosen, rejected)]  # fmt: skip
    reply = max(len(ids) - start for (ids, _), start in zip((chosen, rejected), starts, strict=True))
    budget = context_length - reply
    if max_prompt_length:
        budget = min(budget, max_prompt_length)
    cut = False
    for (ids, labels), start in zip((chosen, rejected), starts, strict=True):
        keep = min(start, max(budget, keep_head + 1))  # one prompt token at least: it predicts the reply's first
        head = min(keep_head, keep)
        take = [*range(head), *range(start - (keep - head), len(ids))][:context_length]
        cut |= len(take) < len(ids)
        sides.append(([ids[i] for i in take], [labels[i] for i in take]))
    return sides[0], sides[1], "truncated" if cut else "whole"


@dataclass(frozen=True)
class FitStats:
    """What fitting samples into the context did, so a silently truncated or shrunken dataset shows in the log."""

    rows: int
    """Examples given."""
    truncated: int
    """Samples longer than the context, cut to it."""
    split: int
    """Samples longer than the context, split into several (--packing_split)."""
    dropped: int
    """Samples (or split pieces) with nothing left to learn."""
    samples: int
    """Samples (and pieces) kept."""
    tokens: int
    """Tokens of the kept samples."""
    label_tokens: int
    """Tokens the loss learns in the kept samples (labels[1:] != -100, as the trainer counts them)."""
    identical: int = 0
    """Preference pairs whose two replies are the same, dropped."""
    empty: int = 0
    """Preference pairs with an empty reply, dropped."""
    images_too_long: int = 0
    """Rows with images longer than the context, dropped."""

    def describe(self, context_length: int) -> str:
        cut = f"{self.split} split" if self.split else f"{self.truncated} truncated"
        pairs = f", {self.identical} identical and {self.empty} empty pairs dropped" if self.identical or self.empty \
            else ""  # fmt: skip
        if self.images_too_long:
            pairs += f", {self.images_too_long} rows with images longer than the context dropped"
        nothing = self.dropped - self.identical - self.empty - self.images_too_long
        return (
            f"{self.rows} rows, {cut} at {context_length} tokens, {nothing} dropped (nothing left to learn){pairs}, "
            f"{self.samples} samples of {self.tokens} tokens, {self.label_tokens} label tokens"
        )


def fit_examples(
    examples: list[AnyExample], tokenizer: Any, *, context_length: int, train_on_inputs: bool, split: bool = False
) -> tuple[list[Sample], FitStats]:
    """Examples in memory -> the samples a cache would hold for them, and the counts (for tools and tests; training
    reads them from the cache, which builds them with fit_sample one example at a time)."""
    kept: list[Sample] = []
    truncated = n_split = dropped = 0
    for sample in encode_examples(examples, tokenizer, train_on_inputs=train_on_inputs):
        pieces, how, lost = fit_sample(sample, context_length, split=split)
        kept += pieces
        truncated += how == "truncated"
        n_split += how == "split"
        dropped += lost
    stats = FitStats(
        rows=len(examples),
        truncated=truncated,
        split=n_split,
        dropped=dropped,
        samples=len(kept),
        tokens=sum(len(ids) for ids, _ in kept),
        label_tokens=sum(learned_tokens(labels) for _, labels in kept),
    )
    return kept, stats


class SampleRows(Dataset):
    """One sample per row: the samples at `indices` of a store (a list, or the cache's memory-mapped rows)."""

    def __init__(self, samples: Sequence[Sample], indices: np.ndarray, lengths: np.ndarray) -> None:
        self.samples, self.indices, self.lengths = samples, indices, lengths

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict[str, Any]:
        at = int(self.indices[index])
        ids, labels = self.samples[at]
        images = self.samples.images(at) if hasattr(self.samples, "images") else []
        return {"input_ids": ids, "labels": labels, **({"images": images} if images else {})}


class PackedRows(Dataset):
    """Several samples per row (--packing), laid end to end when the row is read: never stored padded."""

    def __init__(self, samples: Sequence[Sample], groups: list[list[int]], lengths: np.ndarray) -> None:
        self.samples, self.groups, self.lengths = samples, groups, lengths

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return packed_row([self.samples[sample] for sample in self.groups[index]])


class PairRows(Dataset):
    """One preference pair per row (--objective dpo, ipo, orpo, simpo): its chosen and rejected sides, and its
    index in the store (precomputed reference log-probs are looked up by it)."""

    def __init__(self, pairs: Sequence[tuple[Sample, Sample]], indices: np.ndarray, lengths: np.ndarray) -> None:
        self.pairs, self.indices, self.lengths = pairs, indices, lengths

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        at = int(self.indices[index])
        (chosen_ids, chosen_labels), (rejected_ids, rejected_labels) = self.pairs[at]
        images = self.pairs.images(at) if hasattr(self.pairs, "images") else []
        return {"input_ids": chosen_ids, "labels": chosen_labels, "rejected_input_ids": rejected_ids,
                "rejected_labels": rejected_labels, "pair_index": [at],
                **({"images": images} if images else {})}  # fmt: skip


class UnpairedRows(PairRows):
    """One labelled completion per row (--objective kto), as a pair of sequences: the completion, and its KL sequence
    (the row's prompt with the previous row's completion, the last row's for the first; cut to the context), and
    `desirable`. As TRL's KTOTrainer does, mismatched completions are fixed per row, so a row's KL sequence is the
    same whatever the ranks and batches; a precomputed reference holds both sequences' log-probs."""

    def __init__(self, pairs: Sequence[tuple[Sample, Sample]], indices: np.ndarray, lengths: np.ndarray, *,
                 context_length: int) -> None:  # fmt: skip
        super().__init__(pairs, indices, lengths)
        self.context_length = context_length

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        at = int(self.indices[index])
        (ids, labels), desirable = self._completion(at)
        other, other_labels = self._completion(int(self.indices[index - 1]))[0]
        start, other_start = _first_label(labels), _first_label(other_labels)
        kl_ids = [*ids[:start], *other[other_start:]][: self.context_length]
        kl_labels = [*labels[:start], *other_labels[other_start:]][: self.context_length]
        return {"input_ids": ids, "labels": labels, "rejected_input_ids": kl_ids, "rejected_labels": kl_labels,
                "pair_index": [at], DESIRABLE: [int(desirable)]}  # fmt: skip

    def _completion(self, at: int) -> tuple[Sample, bool]:
        chosen, rejected = self.pairs[at]
        return (chosen, True) if chosen[0] else (rejected, False)


def _first_label(labels: list[int]) -> int:
    return next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))


def packed_row(parts: list[Sample]) -> dict[str, list[int]]:
    """Samples laid end to end: labels -100 on each sample's first token, positions restarting at every sample."""
    row: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}
    for ids, labels in parts:
        row["input_ids"] += ids
        row["labels"] += [IGNORE_INDEX, *labels[1:]]
        row["position_ids"] += range(len(ids))
    return row


def build_rows(
    samples: Sequence[Any], indices: np.ndarray, lengths: np.ndarray, *, context_length: int, packing: bool,
    kind: str = "sft",
) -> tuple[SampleRows | PackedRows | PairRows, str]:
    """The rows of the samples (or pairs, or labelled completions: `kind`) at `indices` (each no longer than the
    context), and a line on how full they are."""
    if kind == "unpaired":
        return UnpairedRows(samples, indices, lengths[indices], context_length=context_length), ""
    if kind != "sft":
        return PairRows(samples, indices, lengths[indices]), ""
    if not packing:
        return SampleRows(samples, indices, lengths[indices]), ""
    groups = [[int(indices[i]) for i in row] for row in assign_rows(lengths[indices].tolist(), context_length)]
    packed = np.array([sum(int(lengths[s]) for s in row) for row in groups], dtype=np.int64)
    efficiency = packed.sum() / (len(groups) * context_length)
    line = f"; {len(indices)} samples packed into {len(groups)} rows, efficiency {efficiency:.1%} (real / row tokens)"
    return PackedRows(samples, groups, packed), line


def collate(
    items: list[dict[str, Any]],
    *,
    pad_id: int,
    context_length: int,
    pad_to_context: bool,
    images: ImageInputs | None = None,
) -> dict[str, torch.Tensor]:
    """A batch padded to its longest row rounded up to PAD_MULTIPLE (at most the context), or to the context.

    attention_mask marks the real tokens (the trainer counts them; a packed batch goes to the model without it,
    and its padding is a segment of its own: positions from 0, no labels). A batch of preference pairs is 2B rows,
    the B chosen sides then the B rejected ones, so one forward runs both; `pair_index` holds the pairs' indices (and
`desirable` KTO's labels, its rows being pairs of a completion and its KL sequence).
    Rows with images add the model's image inputs for all of them, in row order (`images`, the model's processor).
    """
    if "rejected_input_ids" in items[0]:
        # Both sides of a pair show the same images.
        sides = [{"input_ids": item[f"{side}input_ids"], "labels": item[f"{side}labels"],
                  "images": item.get("images", [])} for side in ("", "rejected_") for item in items]  # fmt: skip
        batch = collate(sides, pad_id=pad_id, context_length=context_length, pad_to_context=pad_to_context,
                        images=images)  # fmt: skip
        per_pair = {key: torch.tensor([item[key][0] for item in items], dtype=torch.long)
                    for key in ("pair_index", DESIRABLE) if key in items[0]}  # fmt: skip
        return batch | per_pair
    longest = max(len(item["input_ids"]) for item in items)
    width = context_length if pad_to_context else min(context_length, -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE)
    batch: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "attention_mask": []}
    packed = "position_ids" in items[0]
    if packed:
        batch["position_ids"] = []
    for item in items:
        real = len(item["input_ids"])
        n_pad = width - real
        batch["input_ids"].append([*item["input_ids"], *[pad_id] * n_pad])
        batch["labels"].append([*item["labels"], *[IGNORE_INDEX] * n_pad])
        batch["attention_mask"].append([1] * real + [0] * n_pad)
        if packed:
            batch["position_ids"].append([*item["position_ids"], *range(n_pad)])
    out = {key: torch.tensor(value, dtype=torch.long) for key, value in batch.items()}
    rows_images = [list(item.get("images", ())) for item in items]
    if any(rows_images):
        if images is None:
            raise UserError("a batch holds rows with images, but no image processor was given to the loader")
        out |= {f"{IMAGE_PREFIX}{k}": v for k, v in images.batch_inputs(out["input_ids"], rows_images).items()}
    return out


def all_dropped_error(rows: int, context_length: int, *, without_reply: bool) -> UserError:
    if without_reply:
        return UserError(f"all {rows} rows were dropped: no conversation has an assistant turn to learn")
    return UserError(
        f"all {rows} rows were dropped: within --context_length {context_length} none has a token "
        "the loss can learn (the prompts fill it); use a larger --context_length"
    )


def model_inputs(batch: dict[str, torch.Tensor], device: torch.device, *, varlen: bool) -> dict[str, Any]:
    """The model's keyword arguments for a batch: input_ids, attention_mask, labels, position_ids.

    A packed batch (it has position_ids) goes without an attention mask, which is what makes transformers build
    per-sample attention from the positions. With flash attention (`varlen`), which does so only for a batch of one
    row, its rows are laid end to end: the last logit of a row then meets the next row's first label, which is -100.
    """
    out = {k: batch[k].to(device) for k in ("input_ids", "attention_mask", "labels") if k in batch}
    out |= {k.removeprefix(IMAGE_PREFIX): v.to(device) for k, v in batch.items() if k.startswith(IMAGE_PREFIX)}
    if "position_ids" not in batch:
        return {**out, "position_ids": None}
    out["position_ids"] = batch["position_ids"].to(device)
    out["attention_mask"] = None
    if varlen:
        out = {k: None if v is None else v.reshape(1, -1) for k, v in out.items()}
    return out
