"""qlora_fsdp.loader: packed training loaders, the held-out split and the evaluation shards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from qlora_fsdp.config import DataConfig, EvalConfig
from qlora_fsdp.data import IGNORE_INDEX, load_examples
from qlora_fsdp.distributed import DistEnv
from qlora_fsdp.errors import UserError
from qlora_fsdp.loader import build_dataloader, build_eval_loader, eval_shard, split_examples


def cpu_env(rank: int, world_size: int) -> DistEnv:
    return DistEnv(rank, rank, world_size, world_size, torch.device("cpu"), "gloo")


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture
def rows_file(tmp_path: Path) -> str:
    """40 rows of different lengths, each answer naming its row."""
    rows = [{"instruction": "Count " + "and more " * (i % 7), "output": f"Answer {i}"} for i in range(40)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def rows_of(loader: torch.utils.data.DataLoader, epoch: int = 0) -> list[tuple[int, ...]]:
    if hasattr(loader.sampler, "set_epoch"):
        loader.sampler.set_epoch(epoch)
    return [tuple(row.tolist()) for batch in loader for row in batch["input_ids"]]


def test_packed_rows_reach_the_ranks_as_unpacked_rows_do(rows_file: str, tokenizer) -> None:
    """1 rank x batch 2 and 2 ranks x batch 1 see the same packed rows at each step, and rows carry positions."""
    cfg = DataConfig(dataset=rows_file, context_length=64, batch_size=2, packing=True)
    one = build_dataloader(cfg, tokenizer, cpu_env(0, 1), seed=3)
    batch = next(iter(one))
    assert set(batch) == {"input_ids", "labels", "attention_mask", "position_ids"}
    assert batch["input_ids"].shape == (2, 64)
    half = DataConfig(dataset=rows_file, context_length=64, batch_size=1, packing=True)
    ranks = [build_dataloader(half, tokenizer, cpu_env(r, 2), seed=3) for r in range(2)]
    for epoch in (0, 1):
        single = rows_of(one, epoch)
        r0, r1 = (rows_of(loader, epoch) for loader in ranks)
        assert len(single) == 2 * len(r0) == 2 * len(r1) > 0
        assert all({single[2 * i], single[2 * i + 1]} == {r0[i], r1[i]} for i in range(len(r0)))


def test_split_is_seeded_disjoint_and_keeps_order(rows_file: str) -> None:
    examples = load_examples(rows_file)
    train, held = split_examples(examples, 0.25, seed=1)
    assert len(held) == 10 and len(train) == 30
    assert sorted(map(examples.index, train + held)) == list(range(40))
    assert [examples.index(e) for e in held] == sorted(examples.index(e) for e in held)
    assert split_examples(examples, 0.25, seed=1) == (train, held)
    assert split_examples(examples, 0.25, seed=2)[1] != held
    assert split_examples(examples, 0.0, seed=1) == (examples, [])
    with pytest.raises(UserError, match=r"--eval_split 0.99 of 40 rows leaves none to train on"):
        split_examples(examples, 0.99, seed=1)


def test_eval_split_rows_are_the_ones_training_leaves_out(rows_file: str, tokenizer) -> None:
    data = DataConfig(dataset=rows_file, context_length=128, batch_size=1)
    train = set(rows_of(build_dataloader(data, tokenizer, cpu_env(0, 1), seed=5, eval_split=0.25)))
    held = rows_of(build_eval_loader(data, EvalConfig(eval_split=0.25), tokenizer, cpu_env(0, 1), seed=5))
    everything = set(rows_of(build_dataloader(data, tokenizer, cpu_env(0, 1), seed=5)))
    assert len(train) == 30 and len(held) == len(set(held)) == 10
    assert train.isdisjoint(held) and train | set(held) == everything
    capped = build_eval_loader(data, EvalConfig(eval_split=0.25, eval_samples=4), tokenizer, cpu_env(0, 1), seed=5)
    assert rows_of(capped) == held[:4]
    assert build_eval_loader(data, EvalConfig(), tokenizer, cpu_env(0, 1), seed=5) is None


def test_eval_dataset_errors_name_the_eval_flag(tmp_path: Path, tokenizer) -> None:
    data = DataConfig(dataset="unused", context_length=64)
    with pytest.raises(UserError, match=r"^--eval_dataset .*missing\.jsonl: no such file"):
        missing = EvalConfig(eval_dataset=str(tmp_path / "missing.jsonl"))
        build_eval_loader(data, missing, tokenizer, cpu_env(0, 1), seed=0)


@pytest.mark.parametrize(("rows", "world_size", "batch_size"), [(7, 2, 2), (7, 2, 3), (5, 3, 1), (1, 2, 2)])
def test_eval_shards_hold_each_row_once_in_equal_batch_counts(rows: int, world_size: int, batch_size: int) -> None:
    items = [{"input_ids": torch.full((4,), i), "labels": torch.full((4,), i)} for i in range(rows)]
    shards = [eval_shard(items, cpu_env(r, world_size), batch_size) for r in range(world_size)]
    assert len({len(s) for s in shards}) == 1 and len(shards[0]) % batch_size == 0
    real = [int(row["input_ids"][0]) for shard in shards for row in shard if (row["labels"] != IGNORE_INDEX).any()]
    assert sorted(real) == list(range(rows))
    blanks = [row for shard in shards for row in shard if (row["labels"] == IGNORE_INDEX).all()]
    assert len(blanks) == len(shards[0]) * world_size - rows
