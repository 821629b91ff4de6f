"""qlora_fsdp.data.rows: what packed rows hold, splitting, per-batch padding, and attention that stops at every
sample boundary."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from qlora_fsdp.data import IGNORE_INDEX
from qlora_fsdp.data.formats import encode_examples, learned_tokens, load_examples, pad_token_id
from qlora_fsdp.data.rows import (
    PAD_MULTIPLE,
    PackedRows,
    assign_rows,
    build_rows,
    collate,
    fit_examples,
    fit_sample,
    model_inputs,
)
from tests.conftest import DATASET

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def examples():
    return load_examples(str(DATASET))


def segments(row: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
    """(start, end) of each run of positions counting up from 0, read from the row alone."""
    starts = (row["position_ids"] == 0).nonzero().flatten().tolist()
    return list(zip(starts, [*starts[1:], len(row["position_ids"])], strict=True))


def pack(examples, tokenizer, *, context_length: int) -> tuple[PackedRows, str, int]:
    """The examples' samples packed into rows (unpadded), the log line on how full they are, and the label tokens."""
    samples, stats = fit_examples(examples, tokenizer, context_length=context_length, train_on_inputs=False)
    lengths = np.array([len(ids) for ids, _ in samples], dtype=np.int64)
    rows, line = build_rows(samples, np.arange(len(samples)), lengths, context_length=context_length, packing=True)
    assert isinstance(rows, PackedRows)
    return rows, line, stats.label_tokens


def padded(rows, tokenizer, *, context_length: int, pad_to_context: bool = False) -> dict[str, torch.Tensor]:
    return collate(
        list(rows), pad_id=pad_token_id(tokenizer), context_length=context_length, pad_to_context=pad_to_context
    )


def test_rows_hold_every_sample_once_with_restarting_positions(tokenizer, examples) -> None:
    context = 256
    samples = encode_examples(examples, tokenizer, train_on_inputs=False)
    assert max(len(ids) for ids, _ in samples) <= context  # nothing to truncate here
    rows, line, label_tokens = pack(examples, tokenizer, context_length=context)
    real = sum(len(ids) for ids, _ in samples)
    assert sum(len(rows[i]["input_ids"]) for i in range(len(rows))) == real  # rows are stored unpadded
    assert int(rows.lengths.sum()) == real

    # Each row as a batch of its own (padded to its length rounded up to a multiple of 8), and every row padded to
    # the context (--pad_to_context): the padding is a segment of its own either way.
    for pad_to_context in (False, True):
        seen = []
        labelled = 0
        for i in range(len(rows)):
            batch = padded([rows[i]], tokenizer, context_length=context, pad_to_context=pad_to_context)
            row = {k: v[0] for k, v in batch.items()}
            n_real = len(rows[i]["input_ids"])
            width = context if pad_to_context else min(context, -(-n_real // PAD_MULTIPLE) * PAD_MULTIPLE)
            assert all(t.shape == (width,) and t.dtype == torch.long for t in row.values())
            labelled += int((row["labels"] != IGNORE_INDEX).sum())
            for start, end in segments(row):
                ids, labels = row["input_ids"][start:end].tolist(), row["labels"][start:end].tolist()
                assert row["position_ids"][start:end].tolist() == list(range(end - start))
                # Nothing is learned at a sample's first token: no label is predicted across a boundary.
                assert labels[0] == IGNORE_INDEX
                if row["attention_mask"][start:end].all():
                    seen.append((ids, labels[1:]))
                else:  # the padding at the end of the row: a segment of its own, never learned
                    assert not row["attention_mask"][start:end].any() and start == n_real and end == width
                    assert set(labels) == {IGNORE_INDEX}
        assert sorted(seen) == sorted((ids, labels[1:]) for ids, labels in samples)
        assert labelled == label_tokens == sum(learned_tokens(labels) for _, labels in samples)

    efficiency = real / (len(rows) * context)
    assert f"{len(samples)} samples packed into {len(rows)} rows, efficiency {efficiency:.1%}" in line
    assert len(rows) < len(samples) / 3  # the short bundled rows really share rows


def test_split_pieces_learn_each_token_of_a_long_sample_exactly_once() -> None:
    ids = list(range(100, 130))
    labels = [IGNORE_INDEX] * 5 + ids[5:]
    pieces, how, dropped = fit_sample((ids, labels), 8, split=True)
    assert (how, dropped) == ("split", 0)
    assert all(len(p_ids) <= 8 for p_ids, _ in pieces)
    # Each piece repeats the token before it as context: dropping that first token gives the sample back.
    assert pieces[0][0] + [t for p_ids, _ in pieces[1:] for t in p_ids[1:]] == ids
    # What the pieces learn (labels after their first token) is what the sample learns, in order, once.
    assert [t for _, p_labels in pieces for t in p_labels[1:]] == labels[1:]

    cut, how, dropped = fit_sample((ids, labels), 8, split=False)
    assert cut == [(ids[:8], labels[:8])] and (how, dropped) == ("truncated", 0)
    assert fit_sample((ids, labels), 30, split=True) == ([(ids, labels)], "whole", 0)

    # A piece with nothing to learn is dropped, not packed.
    tail_masked = ids[:15], labels[:8] + [IGNORE_INDEX] * 7
    pieces, _, dropped = fit_sample(tail_masked, 8, split=True)
    assert len(pieces) == 1 and dropped == 1


def test_assign_rows_fits_every_sample_once_deterministically() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(2, 64) for _ in range(500)]
    rows = assign_rows(lengths, 64)
    assert sorted(i for row in rows for i in row) == list(range(500))
    assert all(sum(lengths[i] for i in row) <= 64 for row in rows)
    assert all(row == sorted(row) for row in rows)
    assert assign_rows(lengths, 64) == rows
    # Best-fit decreasing uses at most 11/9 of the optimum plus one row; the optimum needs at least sum / 64.
    assert len(rows) <= 11 / 9 * math.ceil(sum(lengths) / 64) + 1


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request: pytest.FixtureRequest, tiny_model: Path) -> torch.nn.Module:
    # No KV cache, as in training (model.py turns it off): transformers reads packed positions only without one.
    return AutoModelForCausalLM.from_pretrained(
        tiny_model, attn_implementation=request.param, dtype=torch.float32, use_cache=False
    )


def test_packed_row_logits_equal_each_sample_run_alone(model, tokenizer, examples) -> None:
    rows, _, _ = pack(examples[:60], tokenizer, context_length=192)
    batch = padded([rows[0], rows[1]], tokenizer, context_length=192)  # padded to the longer row, as in training
    model.eval()

    def logits(inputs: dict) -> torch.Tensor:
        args = {k: inputs[k] for k in ("input_ids", "attention_mask", "position_ids")}
        with torch.no_grad():
            return model(**args).logits

    packed = logits(model_inputs(batch, CPU, varlen=False))
    # The layout flash attention gets (rows end to end, batch 1) must mean the same thing.
    laid_end_to_end = logits(model_inputs(batch, CPU, varlen=True)).view_as(packed)
    # Control: the same rows with an ordinary all-ones mask, which lets attention cross sample boundaries.
    crossing = logits({**model_inputs(batch, CPU, varlen=False), "attention_mask": torch.ones_like(batch["input_ids"])})

    checked = crossed = 0
    for r in range(2):
        for start, end in segments({"position_ids": batch["position_ids"][r]}):
            with torch.no_grad():
                alone = model(input_ids=batch["input_ids"][r : r + 1, start:end]).logits[0]
            torch.testing.assert_close(packed[r, start:end], alone, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(laid_end_to_end[r, start:end], alone, rtol=1e-5, atol=1e-5)
            crossed += start > 0 and (crossing[r, start:end] - alone).abs().max() > 1e-3
            checked += 1
    assert checked > 4 and crossed == checked - 2, "the control should differ wherever a sample is not first"


def test_model_inputs_leaves_unpacked_batches_alone() -> None:
    batch = {k: torch.ones(2, 8, dtype=torch.long) for k in ("input_ids", "labels", "attention_mask")}
    inputs = model_inputs(batch, CPU, varlen=True)
    assert inputs["position_ids"] is None
    assert all(torch.equal(inputs[k], batch[k]) for k in batch)
    packed = model_inputs({**batch, "position_ids": torch.arange(8).repeat(2, 1)}, CPU, varlen=True)
    assert packed["attention_mask"] is None
    assert packed["input_ids"].shape == packed["labels"].shape == packed["position_ids"].shape == (1, 16)
