"""qlora_fsdp.data.loader: packed training loaders, per-batch padding, the held-out split and the evaluation shards."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from qlora_fsdp.config.options import DataConfig, EvalConfig
from qlora_fsdp.data import IGNORE_INDEX
from qlora_fsdp.data.loader import Batching, EvalShard, build_loaders, held_out
from qlora_fsdp.data.rows import PAD_MULTIPLE
from qlora_fsdp.errors import UserError
from qlora_fsdp.parallel.distributed import DistEnv


def cpu_env(rank: int, world_size: int) -> DistEnv:
    return DistEnv(rank, rank, world_size, world_size, torch.device("cpu"), "gloo")


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    return AutoTokenizer.from_pretrained(tiny_model)


def write_rows(path: Path, rows: range) -> str:
    """Rows of different lengths, each answer naming its row."""
    lines = [{"instruction": "Count " + "and more " * (i % 7), "output": f"Answer {i}"} for i in rows]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return str(path)


@pytest.fixture
def rows_file(tmp_path: Path) -> str:
    return write_rows(tmp_path / "rows.jsonl", range(40))


def loaders(data: DataConfig, tokenizer, ev: EvalConfig | None = None, *, rank: int = 0, world: int = 1, seed: int):
    return build_loaders(data, ev or EvalConfig(), tokenizer, cpu_env(rank, world), Batching(seed=seed))


def rows_of(loader: torch.utils.data.DataLoader, epoch: int = 0) -> list[tuple[int, ...]]:
    """Each row's real tokens (its padding, which depends on the batch it falls in, cut off)."""
    if hasattr(loader.sampler, "set_epoch"):
        loader.sampler.set_epoch(epoch)
    return [
        tuple(row[: int(mask.sum())].tolist())
        for batch in loader
        for row, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)
    ]


def answers(tokenizer, rows: list[tuple[int, ...]]) -> list[int]:
    """The row number each (unpacked) row's answer names."""
    return [int(re.findall(r"Answer (\d+)", tokenizer.decode(row))[-1]) for row in rows]


def test_packed_rows_reach_the_ranks_as_unpacked_rows_do(rows_file: str, tokenizer) -> None:
    """1 rank x batch 2 and 2 ranks x batch 1 see the same packed rows at each step, and rows carry positions."""
    cfg = DataConfig(dataset=rows_file, context_length=64, batch_size=2, packing=True)
    one, _ = loaders(cfg, tokenizer, seed=3)
    for batch in one:
        assert set(batch) == {"input_ids", "labels", "attention_mask", "position_ids"}
        # Padded to the batch's longest row rounded up to a multiple of 8, never past the context.
        longest = int(batch["attention_mask"].sum(1).max())
        width = batch["input_ids"].shape[1]
        assert batch["input_ids"].shape[0] == 2 and width % PAD_MULTIPLE == 0
        assert longest <= width < longest + PAD_MULTIPLE and width <= 64
        assert all(batch[k].shape == (2, width) for k in batch)
        assert (batch["labels"][batch["attention_mask"] == 0] == IGNORE_INDEX).all()
    # --pad_to_context (and --compile's fixed shapes) pad every batch to the context.
    fixed, _ = loaders(DataConfig(**{**vars(cfg), "pad_to_context": True}), tokenizer, seed=3)
    assert {batch["input_ids"].shape for batch in fixed} == {(2, 64)}
    half = DataConfig(dataset=rows_file, context_length=64, batch_size=1, packing=True)
    ranks = [loaders(half, tokenizer, rank=r, world=2, seed=3)[0] for r in range(2)]
    for epoch in (0, 1):
        single = rows_of(one, epoch)
        r0, r1 = (rows_of(loader, epoch) for loader in ranks)
        assert len(single) == 2 * len(r0) == 2 * len(r1) > 0
        assert all({single[2 * i], single[2 * i + 1]} == {r0[i], r1[i]} for i in range(len(r0)))


def test_split_is_seeded_and_sized() -> None:
    held = held_out(40, 0.25, seed=1)
    assert held.dtype == bool and held.shape == (40,) and held.sum() == 10
    assert (held_out(40, 0.25, seed=1) == held).all()
    assert (held_out(40, 0.25, seed=2) != held).any()
    assert not held_out(40, 0.0, seed=1).any()
    assert held_out(40, 0.001, seed=1).sum() == 1  # at least one
    with pytest.raises(UserError, match=r"--eval_split 0.99 of 40 rows leaves none to train on"):
        held_out(40, 0.99, seed=1)


def test_eval_split_rows_are_the_ones_training_leaves_out(rows_file: str, tokenizer) -> None:
    data = DataConfig(dataset=rows_file, context_length=128, batch_size=1)
    train_loader, eval_loader = loaders(data, tokenizer, EvalConfig(eval_split=0.25), seed=5)
    train, held = set(rows_of(train_loader)), rows_of(eval_loader)
    everything = set(rows_of(loaders(data, tokenizer, seed=5)[0]))
    assert len(train) == 30 and len(held) == len(set(held)) == 10
    assert train.isdisjoint(held) and train | set(held) == everything
    # The held-out examples are the ones the seed chose, evaluated in dataset order.
    assert answers(tokenizer, held) == np.flatnonzero(held_out(40, 0.25, seed=5)).tolist()
    _, capped = loaders(data, tokenizer, EvalConfig(eval_split=0.25, eval_samples=4), seed=5)
    assert rows_of(capped) == held[:4]
    assert loaders(data, tokenizer, seed=5)[1] is None


def test_eval_split_of_a_mixture_holds_out_examples_of_every_source(tmp_path: Path, tokenizer) -> None:
    """Examples are numbered over all sources: the split leaves no example in both sets, and none in neither."""
    first, second = write_rows(tmp_path / "a.jsonl", range(20)), write_rows(tmp_path / "b.jsonl", range(20, 40))
    data = DataConfig(dataset=f"{first},{second}", context_length=128, batch_size=1)
    train_loader, eval_loader = loaders(data, tokenizer, EvalConfig(eval_split=0.25), seed=5)
    train, held = answers(tokenizer, rows_of(train_loader)), answers(tokenizer, rows_of(eval_loader))
    assert held == np.flatnonzero(held_out(40, 0.25, seed=5)).tolist()
    assert sorted(train + held) == list(range(40))


def test_eval_dataset_errors_name_the_eval_flag(tmp_path: Path, rows_file: str, tokenizer) -> None:
    data = DataConfig(dataset=rows_file, context_length=64)
    with pytest.raises(UserError, match=r"^--eval_dataset .*missing\.jsonl: no such file"):
        loaders(data, tokenizer, EvalConfig(eval_dataset=str(tmp_path / "missing.jsonl")), seed=0)


@pytest.mark.parametrize(("rows", "world_size", "batch_size"), [(7, 2, 2), (7, 2, 3), (5, 3, 1), (1, 2, 2)])
def test_eval_shards_hold_each_row_once_in_equal_batch_counts(rows: int, world_size: int, batch_size: int) -> None:
    items = [{"input_ids": [i] * 4, "labels": [i] * 4} for i in range(rows)]
    datasets = [EvalShard(items, cpu_env(r, world_size), batch_size) for r in range(world_size)]
    assert len({len(d) for d in datasets}) == 1 and len(datasets[0]) % batch_size == 0
    shards = [[d[i] for i in range(len(d))] for d in datasets]
    real = [row["input_ids"][0] for shard in shards for row in shard if any(x != IGNORE_INDEX for x in row["labels"])]
    assert sorted(real) == list(range(rows))
    blanks = [row for shard in shards for row in shard if all(x == IGNORE_INDEX for x in row["labels"])]
    assert len(blanks) == len(shards[0]) * world_size - rows
