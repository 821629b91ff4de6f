"""Batches of unpadded rows: per-batch padding, --group_by_length's order, and streamed rows (one pass, every row
once across the ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from qlora_fsdp.config.options import DataConfig, EvalConfig, build_config
from qlora_fsdp.data.formats import IGNORE_INDEX, load_examples
from qlora_fsdp.data.loader import GROUP_WINDOW, Batching, LengthGroupedSampler, build_loaders
from qlora_fsdp.data.rows import collate, fit_examples
from qlora_fsdp.data.stream import PACK_BUFFER, StreamRows
from qlora_fsdp.errors import UserError
from qlora_fsdp.parallel.distributed import DistEnv

DATASET = Path(__file__).resolve().parents[3] / "data" / "alpaca_tiny.jsonl"


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    return AutoTokenizer.from_pretrained(tiny_model)


def _env(rank: int = 0, world_size: int = 1) -> DistEnv:
    return DistEnv(rank, rank, world_size, world_size, torch.device("cpu"), "gloo")


def test_collate_pads_to_the_longest_row_rounded_to_eight_and_at_most_the_context() -> None:
    rows = [{"input_ids": [5] * n, "labels": [7] * n} for n in (3, 13, 9)]
    batch = collate(rows, pad_id=0, context_length=100, pad_to_context=False)
    assert batch["input_ids"].shape == (3, 16)
    assert batch["attention_mask"].sum(1).tolist() == [3, 13, 9]
    assert (batch["labels"][batch["attention_mask"] == 0] == IGNORE_INDEX).all()
    assert (batch["input_ids"][batch["attention_mask"] == 0] == 0).all()
    assert collate(rows, pad_id=0, context_length=14, pad_to_context=False)["input_ids"].shape == (3, 14)
    assert collate(rows, pad_id=0, context_length=100, pad_to_context=True)["input_ids"].shape == (3, 100)


def test_a_packed_rows_padding_is_a_segment_of_its_own() -> None:
    row = {"input_ids": [4, 5, 6], "labels": [IGNORE_INDEX, 5, 6], "position_ids": [0, 1, 0]}
    batch = collate([row], pad_id=0, context_length=64, pad_to_context=False)
    assert batch["position_ids"].tolist() == [[0, 1, 0, 0, 1, 2, 3, 4]]


def test_unpacked_batches_are_at_least_half_real_tokens_at_1024(tokenizer) -> None:
    """The issue's bar on the bundled data at --context_length 1024: padding to the context left about 5% real
    tokens; per-batch padding at batch 4 leaves more than half (and --group_by_length nearly all)."""
    efficiency = {}
    for group in (False, True):
        data = DataConfig(dataset=str(DATASET), context_length=1024, batch_size=4, group_by_length=group)
        loader, _ = build_loaders(data, EvalConfig(), tokenizer, _env(), Batching(seed=0))
        batches = list(loader)
        efficiency[group] = sum(int(b["attention_mask"].sum()) for b in batches) / sum(
            b["input_ids"].numel() for b in batches
        )
    fixed = sum(len(ids) for ids, _ in fit_examples(load_examples(str(DATASET)), tokenizer, context_length=1024,
                                                     train_on_inputs=False)[0]) / (400 * 1024)  # fmt: skip
    assert fixed < 0.1
    assert efficiency[False] >= 0.5
    assert efficiency[True] > efficiency[False]


def _global_batches(lengths: np.ndarray, world_size: int, batch_size: int, epoch: int = 0) -> list[set[int]]:
    per_rank = []
    for rank in range(world_size):
        sampler = LengthGroupedSampler(lengths, world_size=world_size, rank=rank, batch_size=batch_size, seed=3)
        sampler.set_epoch(epoch)
        order = list(sampler)
        assert len(order) == len(sampler)
        per_rank.append([order[i : i + batch_size] for i in range(0, len(order), batch_size)])
    return [set().union(*step) for step in zip(*per_rank, strict=True)]


def test_grouped_order_is_the_same_at_every_world_size_for_the_global_batch() -> None:
    lengths = np.random.default_rng(0).integers(10, 500, size=1000)
    one = _global_batches(lengths, 1, 8)
    assert _global_batches(lengths, 2, 4) == one
    assert _global_batches(lengths, 4, 2) == one
    seen = [i for step in one for i in step]
    assert len(seen) == len(set(seen)) == 1000 // 8 * 8  # each row at most once, the tail dropped
    assert _global_batches(lengths, 1, 8, epoch=1) != one  # each epoch reshuffles


def test_grouped_batches_hold_similar_lengths_in_shuffled_order() -> None:
    lengths = np.random.default_rng(1).integers(10, 500, size=GROUP_WINDOW * 8 * 4)
    batches = _global_batches(lengths, 2, 4)
    spread = np.mean([np.ptp(lengths[list(b)]) for b in batches])
    random_spread = np.mean([np.ptp(lengths[i : i + 8]) for i in range(0, len(lengths), 8)])
    assert spread < 0.2 * random_spread
    longest = [max(lengths[list(b)]) for b in batches]
    assert longest != sorted(longest, reverse=True)  # the batches of a window are shuffled


def _rows_file(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": f"row {i} " + "word " * (i % 7)}) + "\n" for i in range(n)))
    return path


def _stream(path: Path, tokenizer, rank: int, world_size: int, **kw) -> StreamRows:
    args = dict(samples=0, prompt_style="alpaca", context_length=64, train_on_inputs=False, packing=False,
                packing_split=False)  # fmt: skip
    return StreamRows(str(path), tokenizer, rank=rank, world_size=world_size, **{**args, **kw})


def test_a_pass_of_the_stream_holds_every_row_once_across_the_ranks(tmp_path: Path, tokenizer) -> None:
    path = _rows_file(tmp_path, 11)
    texts = [
        tokenizer.decode(row["input_ids"][:-1])
        for r in range(2)
        for row in _stream(path, tokenizer, r, 2).rows_of_pass()
    ]
    assert sorted(texts) == sorted(json.loads(line)["text"] for line in path.read_text().splitlines())
    ranks = [
        [tokenizer.decode(r["input_ids"][:3]) for r in _stream(path, tokenizer, k, 2).rows_of_pass()] for k in (0, 1)
    ]
    assert [len(r) for r in ranks] == [6, 5]  # row i on rank i % 2


def test_the_stream_starts_a_new_pass_when_one_ends(tmp_path: Path, tokenizer) -> None:
    path = _rows_file(tmp_path, 3)
    stream = iter(_stream(path, tokenizer, 0, 2))
    first = [next(stream)["input_ids"] for _ in range(4)]
    assert first[2:] == first[:2]


def test_packed_stream_rows_hold_every_sample_once(tmp_path: Path, tokenizer) -> None:
    path = _rows_file(tmp_path, PACK_BUFFER + 50)  # two buffers
    plain = list(_stream(path, tokenizer, 0, 1).samples_of_pass())
    packed = list(_stream(path, tokenizer, 0, 1, packing=True).rows_of_pass())
    assert all(len(r["input_ids"]) <= 64 for r in packed)
    assert sum(len(r["input_ids"]) for r in packed) == sum(len(ids) for ids, _ in plain)
    assert len(packed) < len(plain) / 3
    starts = sum(r["position_ids"].count(0) for r in packed)
    assert starts == len(plain)


def test_fewer_rows_than_ranks_is_an_error_on_every_rank_not_a_hang(tmp_path: Path, tokenizer) -> None:
    path = _rows_file(tmp_path, 1)
    for rank in (0, 1):
        with pytest.raises(UserError, match="1 rows for 2 ranks"):
            list(_stream(path, tokenizer, rank, 2).rows_of_pass())


def test_a_bad_row_stops_every_rank_not_only_the_one_it_is_dealt_to(tmp_path: Path, tokenizer) -> None:
    path = _rows_file(tmp_path, 4)
    rows = path.read_text().splitlines()
    path.write_text("\n".join([rows[0], json.dumps({"text": 5}), *rows[2:]]) + "\n")  # row 2: rank 1's
    for rank in (0, 1):
        with pytest.raises(UserError, match=f"^--dataset {path} row 2: field 'text' must be a string"):
            list(_stream(path, tokenizer, rank, 2).rows_of_pass())


def test_a_wrong_path_is_refused_before_any_row_is_read(tmp_path: Path, tokenizer) -> None:
    with pytest.raises(UserError, match="no such file"):
        _stream(tmp_path / "nope.jsonl", tokenizer, 0, 1)


@pytest.mark.parametrize(
    "flags, message",
    [
        ({}, "--dataset_streaming true needs --max_steps N"),
        ({"max_steps": 3, "eval_split": 0.1}, "needs --eval_dataset instead of --eval_split"),
        ({"max_steps": 3, "group_by_length": True}, "needs no --group_by_length"),
    ],
)
def test_streaming_flags_that_cannot_work_are_refused(flags: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        build_config({"model": "m", "dataset_streaming": True, **flags}, None).validate()


def test_config_refuses_a_negative_process_count() -> None:
    with pytest.raises(UserError, match="--dataset_num_proc must be >= 0"):
        build_config({"model": "m", "dataset_num_proc": -1}, None).validate()
