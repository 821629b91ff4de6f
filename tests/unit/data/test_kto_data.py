"""KTO's labelled completions through the data path: the cache holds each on the side its label names, tokenized as
a preference pair's side with the same prompt and reply; each row's KL sequence is its prompt with the previous
row's completion (the first row's with the last's), cut to the context; evaluation's padding rows count for
nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from qlora_fsdp.data.cache import PREFERENCE, UNPAIRED, CacheSpec, open_cache
from qlora_fsdp.data.formats import IGNORE_INDEX
from qlora_fsdp.data.loader import EvalShard
from qlora_fsdp.data.rows import DESIRABLE, UnpairedRows, build_rows, collate
from qlora_fsdp.objectives.kto import KtoObjective
from qlora_fsdp.objectives.preference import reply_tokens
from qlora_fsdp.parallel.distributed import DistEnv

ROWS = [
    {"prompt": "Name a color.", "completion": "Blue.", "label": True},
    {"prompt": "Add 2 and 2.", "completion": "It is five, I think.", "label": False},
    {"prompt": "Say hi.", "completion": "Hi!", "label": True},
]


def _spec(dataset: Path, objective: str, context: int = 64) -> CacheSpec:
    return CacheSpec(dataset=str(dataset), dataset_samples=0, prompt_style="alpaca", context_length=context,
                     packing_split=False, train_on_inputs=False, objective=objective)  # fmt: skip


@pytest.fixture()
def caches(tiny_model: Path, tmp_path: Path):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    kto = tmp_path / "kto.jsonl"
    kto.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": r["prompt"], "chosen": r["completion"], "rejected": "No."}) + "\n"
                             for r in ROWS))  # fmt: skip
    return (open_cache(_spec(kto, UNPAIRED), tok, cache_dir=tmp_path / "c")[0],
            open_cache(_spec(pairs, PREFERENCE), tok, cache_dir=tmp_path / "c")[0])  # fmt: skip


def _split(sample: tuple[list[int], list[int]]) -> tuple[list[int], list[int]]:
    ids, labels = sample
    start = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
    return ids[:start], ids[start:]


def test_a_completion_is_stored_on_its_labels_side_as_a_pairs_side(caches) -> None:
    kto, pairs = caches
    assert kto.kind == UNPAIRED and kto.samples.pairs
    for at, row in enumerate(ROWS):
        chosen, rejected = kto.samples[at]
        stored, empty = (chosen, rejected) if row["label"] else (rejected, chosen)
        assert empty == ([], [])
        assert stored == pairs.samples[at][0]  # the prompt framed by --prompt_style, as DPO frames it


def test_each_rows_kl_sequence_is_its_prompt_with_the_previous_rows_completion(caches) -> None:
    kto, _ = caches
    rows, _ = build_rows(kto.samples, np.arange(3), kto.lengths, context_length=64, packing=False, kind=UNPAIRED)
    assert isinstance(rows, UnpairedRows)
    samples = [next(side for side in kto.samples[at] if side[0]) for at in range(3)]
    for index in range(3):
        item = rows[index]
        prompt, _ = _split(samples[index])
        _, previous = _split(samples[index - 1])  # row 0 takes row 2's
        assert (item["input_ids"], item["labels"]) == samples[index]
        assert item["rejected_input_ids"] == prompt + previous
        assert item["rejected_labels"] == [IGNORE_INDEX] * len(prompt) + previous
        assert item[DESIRABLE] == [int(ROWS[index]["label"])] and item["pair_index"] == [index]
    short = UnpairedRows(kto.samples, np.arange(3), kto.lengths[:3], context_length=len(_split(samples[0])[0]) + 2)
    assert len(short[0]["rejected_input_ids"]) == len(short[0]["rejected_labels"]) == short.context_length


def test_a_batch_carries_the_labels_and_an_evaluation_pad_row_counts_for_nothing(caches) -> None:
    kto, _ = caches
    rows, _ = build_rows(kto.samples, np.arange(3), kto.lengths, context_length=64, packing=False, kind=UNPAIRED)
    env = DistEnv(0, 0, 2, 2, torch.device("cpu"), "gloo")  # rank 0 of 2: rows 0 and 2, padded to batches of 4
    shard = EvalShard(rows, env, 4)
    batch = collate([shard[i] for i in range(len(shard))], pad_id=0, context_length=64, pad_to_context=False)
    assert batch["input_ids"].shape[0] == 8 and batch[DESIRABLE].tolist() == [1, 1, 1, 1]
    assert reply_tokens(batch).chunk(2)[0].tolist()[2:] == [0, 0]
    assert KtoObjective(None, beta=0.1).weights(batch) == (2,)  # type: ignore[arg-type]
