"""qlora_fsdp.data: file formats, row errors, prompt templates, label masking, truncation and rank sharding."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from qlora_fsdp import data
from qlora_fsdp.config import ConfigError, DataConfig, build_config
from qlora_fsdp.data import (
    DATASET_NAMES,
    IGNORE_INDEX,
    PROMPT_STYLES,
    Example,
    load_examples,
    tokenize_examples,
)
from qlora_fsdp.distributed import DistEnv
from qlora_fsdp.errors import UserError
from qlora_fsdp.loader import build_dataloader

ROWS = [
    {"instruction": "Name a color.", "output": "Blue."},
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
    {"instruction": "Say hi.", "input": "", "output": "Hi there!"},
]
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\nName a color.\n\n### Response:\n"
)
ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 3\n\n### Response:\n"
)


def _cpu_env(rank: int, world_size: int) -> DistEnv:
    return DistEnv(rank, rank, world_size, world_size, torch.device("cpu"), "gloo")


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A tiny byte-level BPE: any text encodes, and it trains in milliseconds without the hub."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [ALPACA_NO_INPUT, ALPACA_WITH_INPUT, *(r["output"] for r in ROWS), "row number one two three"] * 5
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # from_pylist takes its columns from the first row only; name every key so later rows keep theirs.
    columns = list(dict.fromkeys(key for row in rows for key in row))
    pq.write_table(pa.table({c: [row.get(c) for row in rows] for c in columns}), path)
    return path


def _split_rows(rows: list[dict], split: str) -> list[dict]:
    """What datasets.load_dataset returns for `split`: all rows, or the first N for "train[:N]"."""
    limit = split.partition("[:")[2].rstrip("]")
    return rows[: int(limit)] if limit else rows


def _ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# --- local formats -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["json_list", "json_lines", "jsonl", "parquet"])
def test_local_formats_load_the_same_examples(tmp_path: Path, fmt: str) -> None:
    if fmt == "json_list":
        path = tmp_path / "d.json"
        path.write_text(json.dumps(ROWS, indent=2))
    elif fmt == "parquet":
        path = _write_parquet(tmp_path / "d.parquet", ROWS)
    else:
        path = _write_jsonl(tmp_path / ("d.json" if fmt == "json_lines" else "d.jsonl"), ROWS)
    examples = load_examples(str(path))
    assert examples[0] == Example(ALPACA_NO_INPUT, "Blue.")
    assert examples[1] == Example(ALPACA_WITH_INPUT, "5")
    assert "### Input" not in examples[2].prompt  # empty input is the same as no input
    assert [e.response for e in examples] == ["Blue.", "5", "Hi there!"]


def test_samples_keeps_first_rows(tmp_path: Path) -> None:
    rows = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(10)]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    assert [e.response for e in load_examples(str(path), samples=3)] == ["a0", "a1", "a2"]
    assert len(load_examples(str(path), samples=0)) == 10


def test_load_examples_leaves_the_sample_limit_to_the_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    """--dataset_samples is validated by the config and applied by the loader alone (it knows whether it counts rows
    or examples): load_examples hands the value over and returns the loader's examples as they are."""
    asked: list[int] = []

    def loader(samples: int, prompt_style: str) -> list[Example]:
        asked.append(samples)
        return [Example(f"q{i}", f"a{i}") for i in range(5)]

    monkeypatch.setitem(data._NAMED_DATASETS, "stub", loader)
    assert len(load_examples("stub", samples=3)) == 5  # not cut a second time
    assert len(load_examples("stub", samples=-1)) == 5  # not validated a second time
    assert asked == [3, -1]
    with pytest.raises(ConfigError, match="--dataset_samples must be >= 0"):
        build_config({"model": "m", "dataset_samples": -1}).validate()


def test_samples_stops_before_bad_rows(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [ROWS[0], {"instruction": "no output"}])
    assert len(load_examples(str(path), samples=1)) == 1
    with pytest.raises(UserError, match="row 2"):
        load_examples(str(path))


# --- row errors --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        (
            "data.jsonl",
            json.dumps(ROWS[0]) + "\n" + json.dumps({"instruction": "x"}) + "\n",
            r"data\.jsonl row 2: missing field 'output' \(each row needs string 'instruction' and 'output'",
        ),
        (
            "data.json",
            json.dumps([ROWS[0], ROWS[1], {"instruction": "x", "input": 7, "output": "y"}]),
            r"data\.json row 3: field 'input' must be a string, got int",
        ),
        (
            "data.jsonl",
            json.dumps(ROWS[0]) + "\n\n" + '{"instruction": "x", "output": }\n',
            r"data\.jsonl line 3: not valid JSON",
        ),
        (
            "data.json",
            "[\n" + json.dumps(ROWS[0]) + ",\n{oops}\n]",
            r"data\.json line 3: not valid JSON",
        ),
        (
            "data.jsonl",
            json.dumps(ROWS[0]) + "\n\n" + json.dumps({"output": "y"}) + "\n",
            r"data\.jsonl row 2 \(line 3\): missing field 'instruction'",
        ),
        ("data.jsonl", json.dumps(["not", "an", "object"]) + "\n", r"data\.jsonl row 1: expected an object, got list"),
        ("data.jsonl", json.dumps({"instruction": "x", "output": None}) + "\n", r"row 1: null field 'output'"),
    ],
)
def test_bad_rows_name_file_row_and_field_in_one_line(tmp_path: Path, name: str, content: str, expected: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(UserError, match=expected) as info:
        load_examples(str(path))
    assert "\n" not in str(info.value)


def test_parquet_missing_column_names_row_and_field(tmp_path: Path) -> None:
    path = _write_parquet(tmp_path / "d.parquet", [{"instruction": "a"}, {"instruction": "b"}])
    with pytest.raises(UserError, match=r"d\.parquet row 1: missing field 'output'"):
        load_examples(str(path))


def test_parquet_null_input_counts_as_absent(tmp_path: Path) -> None:
    path = _write_parquet(tmp_path / "d.parquet", [ROWS[1], {"instruction": "Name a color.", "output": "Blue."}])
    assert load_examples(str(path))[1] == Example(ALPACA_NO_INPUT, "Blue.")


def test_non_utf8_file_is_a_user_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"instruction": "caf\u00e9", "output": "x"}\n'.encode("latin-1"))
    with pytest.raises(UserError, match="not UTF-8"):
        load_examples(str(path))


def test_empty_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(UserError, match="no rows"):
        load_examples(str(path))


# --- names and paths ---------------------------------------------------------------------------------------------


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope" / "train.jsonl"
    with pytest.raises(UserError, match="no such file") as info:
        load_examples(str(path))
    assert str(path) in str(info.value)


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(UserError, match="unknown dataset 'alpacca'") as info:
        load_examples("alpacca")
    for name in DATASET_NAMES:
        assert name in str(info.value)
    with pytest.raises(UserError, match=r"unknown dataset 'yahma/alpaca-cleaned'.*alpaca_sample"):
        load_examples("yahma/alpaca-cleaned")  # hub ids are not accepted, only the registered names


def test_directory_is_not_a_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not a file"):
        load_examples(str(tmp_path))


def test_unsupported_file_type(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    path.write_text("instruction,output\n")
    with pytest.raises(UserError, match="unsupported file type"):
        load_examples(str(path))


def test_offline_hub_dataset_is_one_line_user_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets
    import huggingface_hub.constants

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # Both libraries read these variables at import time, so flip their flags too; an empty cache means
    # a previously downloaded copy cannot make the test pass without reaching the hub code path.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "ds_cache")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub_cache"))
    with pytest.raises(UserError) as info:
        load_examples("alpaca_sample")
    message = str(info.value)
    assert "\n" not in message
    assert "'alpaca_sample'" in message
    assert "could not be reached" in message
    assert ".jsonl" in message


def test_hub_loaders_map_rows_to_examples(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hub itself is unreachable here; a stand-in load_dataset checks each loader's repo, split and format."""
    import datasets

    hub = {
        "yahma/alpaca-cleaned": [ROWS[0], ROWS[1]],
        "timdettmers/openassistant-guanaco": [
            {"text": "### Human: Hi### Assistant: Hello!### Human: Bye?### Assistant:  See you. "},
            {"text": "no assistant turn here"},
        ],
        "knowrohit07/know_sql": [{"context": "CREATE TABLE t (x INT)", "question": "How many?", "answer": "SELECT 1"}],
        "microsoft/orca-math-word-problems-200k": [{"question": "1+1?", "answer": "2"}],
    }
    calls: list[tuple[str, str]] = []

    def fake_load_dataset(repo: str, *, split: str) -> list[dict]:
        calls.append((repo, split))
        return _split_rows(hub[repo], split)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_examples("alpaca_sample") == [Example(ALPACA_NO_INPUT, "Blue."), Example(ALPACA_WITH_INPUT, "5")]
    assert load_examples("alpaca", samples=1, prompt_style="qna") == [
        Example("Question: Name a color.\nAnswer: ", "Blue.")
    ]
    assert load_examples("guanaco") == [
        Example("### Human: Hi### Assistant: Hello!### Human: Bye?### Assistant: ", "See you.")
    ]
    (sql,) = load_examples("sql")
    assert "CREATE TABLE t (x INT)" in sql.prompt and "How many?" in sql.prompt and sql.response == "SELECT 1"
    assert load_examples("orca_math") == [Example("Question: 1+1?\nAnswer: ", "2")]
    assert calls == [
        ("yahma/alpaca-cleaned", "train[:128]"),
        ("yahma/alpaca-cleaned", "train[:1]"),
        ("timdettmers/openassistant-guanaco", "train"),
        ("knowrohit07/know_sql", "validation"),
        ("microsoft/orca-math-word-problems-200k", "train"),
    ]


def test_guanaco_samples_counts_rows_not_examples(monkeypatch: pytest.MonkeyPatch) -> None:
    """--dataset_samples N reads the first N hub rows; a row without an Assistant turn is skipped, not replaced."""
    import datasets

    rows = [
        {"text": "### Human: A### Assistant: 1"},
        {"text": "no assistant turn here"},
        {"text": "### Human: B### Assistant: 2"},
        {"text": "### Human: C### Assistant: 3"},
    ]

    monkeypatch.setattr(datasets, "load_dataset", lambda repo, *, split: _split_rows(rows, split))
    assert [e.response for e in load_examples("guanaco", samples=3)] == ["1", "2"]
    assert [e.response for e in load_examples("guanaco")] == ["1", "2", "3"]


def test_hub_row_with_wrong_type_is_a_user_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda repo, *, split: [{"question": "q", "answer": 3}])
    with pytest.raises(UserError, match="orca_math row 1: field 'answer' must be a string"):
        load_examples("orca_math")


# --- prompt styles -----------------------------------------------------------------------------------------------


def test_prompt_styles_text(tmp_path: Path) -> None:
    path = str(_write_jsonl(tmp_path / "d.jsonl", ROWS[:2]))
    assert PROMPT_STYLES == ("alpaca", "guanaco", "qna", "chat")
    guanaco = load_examples(path, prompt_style="guanaco")
    assert [e.prompt for e in guanaco] == [
        "### Human: Name a color. ### Assistant: ",
        "### Human: Add the numbers.\n2 and 3 ### Assistant: ",
    ]
    qna = load_examples(path, prompt_style="qna")
    assert [e.prompt for e in qna] == [
        "Question: Name a color.\nAnswer: ",
        "Question: Add the numbers.\n2 and 3\nAnswer: ",
    ]
    assert [e.prompt for e in load_examples(path, prompt_style="alpaca")] == [ALPACA_NO_INPUT, ALPACA_WITH_INPUT]
    assert [e.response for e in qna] == ["Blue.", "5"]


def test_unknown_prompt_style(tmp_path: Path) -> None:
    path = str(_write_jsonl(tmp_path / "d.jsonl", ROWS))
    with pytest.raises(UserError, match=r"unknown prompt style 'chatml'.*alpaca, guanaco, qna, chat"):
        load_examples(path, prompt_style="chatml")


# --- dummy -------------------------------------------------------------------------------------------------------


def test_dummy_is_long_deterministic_and_honours_samples(tokenizer: PreTrainedTokenizerFast) -> None:
    full = load_examples("dummy")
    assert len(full) == 512
    assert full == load_examples("dummy")
    assert len({e.response for e in full[:16]}) == 16  # rows differ from each other
    few = load_examples("dummy", samples=3)
    assert few == full[:3]
    items, stats = tokenize_examples(few, tokenizer, context_length=2048, train_on_inputs=False)
    assert stats.truncated == 3  # every row fills a 2048-token context
    assert all(int(item["attention_mask"].sum()) == 2048 for item in items)


# --- tokenization ------------------------------------------------------------------------------------------------


def test_prompt_tokens_and_padding_are_masked(tokenizer: PreTrainedTokenizerFast) -> None:
    ex = Example("Question: Name a color.\nAnswer: ", "Blue.")
    prompt_ids, response_ids = _ids(tokenizer, ex.prompt), _ids(tokenizer, ex.response)
    n_prompt, n_real = len(prompt_ids), len(prompt_ids) + len(response_ids) + 1
    length = n_real + 5
    (item,), stats = tokenize_examples([ex], tokenizer, context_length=length, train_on_inputs=False)

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert pad != eos
    for key in ("input_ids", "labels", "attention_mask"):
        assert item[key].dtype == torch.long and item[key].shape == (length,)
    assert item["input_ids"].tolist() == prompt_ids + response_ids + [eos] + [pad] * 5
    assert item["labels"].tolist() == [IGNORE_INDEX] * n_prompt + response_ids + [eos] + [IGNORE_INDEX] * 5
    assert item["attention_mask"].tolist() == [1] * n_real + [0] * 5
    assert stats.rows == 1 and stats.truncated == 0 and stats.dropped == 0
    assert stats.total_label_tokens == len(response_ids) + 1  # position 0 is a prompt token: unlabelled anyway


def test_train_on_inputs_labels_prompt_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    ex = Example("Question: Name a color.\nAnswer: ", "Blue.")
    (item,), stats = tokenize_examples([ex], tokenizer, context_length=64, train_on_inputs=True)
    n_real = int(item["attention_mask"].sum())
    assert item["labels"][:n_real].tolist() == item["input_ids"][:n_real].tolist()
    assert (item["labels"][n_real:] == IGNORE_INDEX).all()
    assert stats.total_label_tokens == n_real - 1  # nothing predicts position 0


def test_label_tokens_are_the_tokens_the_loss_is_computed_on(tokenizer: PreTrainedTokenizerFast) -> None:
    """The logits at t predict labels[t + 1] (the trainer's labels[:, 1:]), so a labelled position 0 is never learned:
    the data log's count must match the trainer's label_tokens, and a row labelled only there has nothing to learn."""
    examples = [Example("Q: ", "A"), Example("Question: hi\nAnswer: ", "Blue."), Example("", "")]
    for train_on_inputs in (True, False):
        items, stats = tokenize_examples(examples, tokenizer, context_length=32, train_on_inputs=train_on_inputs)
        assert (stats.rows, stats.dropped, len(items)) == (3, 1, 2)  # Example("", "") is eos alone, at position 0
        batch = next(iter(torch.utils.data.DataLoader(items, batch_size=len(items))))
        assert stats.total_label_tokens == int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        # With train_on_inputs position 0 is labelled, so counting every label would over-count by one per row.
        assert (batch["labels"][:, 0] != IGNORE_INDEX).all() == train_on_inputs


def test_truncation_counts_and_drops_rows_with_nothing_to_learn(tokenizer: PreTrainedTokenizerFast) -> None:
    short = Example("Question: hi\nAnswer: ", "Blue.")
    long_response = Example("Question: hi\nAnswer: ", "row number one two three " * 20)
    long_prompt = Example("Question: " + "row number one two three " * 20, "Blue.")
    n_prompt = len(_ids(tokenizer, short.prompt))
    length = n_prompt + 8
    assert len(_ids(tokenizer, long_prompt.prompt)) > length

    items, stats = tokenize_examples(
        [short, long_response, long_prompt], tokenizer, context_length=length, train_on_inputs=False
    )
    assert (stats.rows, stats.truncated, stats.dropped, stats.kept) == (3, 2, 1, 2)
    assert len(items) == 2
    cut = items[1]
    assert cut["attention_mask"].tolist() == [1] * length  # truncated from the right, no padding
    assert (
        cut["input_ids"].tolist()
        == (_ids(tokenizer, long_response.prompt) + _ids(tokenizer, long_response.response))[:length]
    )
    assert stats.total_label_tokens == sum(int((it["labels"][1:] != IGNORE_INDEX).sum()) for it in items)

    # The same long-prompt row is kept when the prompt is learned too.
    _, stats_inputs = tokenize_examples([long_prompt], tokenizer, context_length=length, train_on_inputs=True)
    assert stats_inputs.dropped == 0 and stats_inputs.truncated == 1


def test_all_rows_dropped_suggests_longer_context(tokenizer: PreTrainedTokenizerFast) -> None:
    ex = Example("Question: " + "row number one two three " * 20, "Blue.")
    with pytest.raises(UserError, match="--context_length"):
        tokenize_examples([ex], tokenizer, context_length=16, train_on_inputs=False)


def test_context_length_minimum_is_the_configs_rule(tokenizer: PreTrainedTokenizerFast) -> None:
    """The config rejects --context_length < 8 before any work; tokenization has no threshold of its own, and a
    context too short to hold a learnable token drops every row, with the usual advice."""
    with pytest.raises(ConfigError, match="--context_length must be >= 8"):
        build_config({"model": "m", "context_length": 7}).validate()
    with pytest.raises(UserError, match=r"all 1 rows were dropped.*larger --context_length"):
        tokenize_examples([Example("", "Blue.")], tokenizer, context_length=1, train_on_inputs=True)


def test_missing_pad_token_pads_with_eos(tokenizer: PreTrainedTokenizerFast) -> None:
    no_pad = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|endoftext|>")
    assert no_pad.pad_token_id is None
    (item,), _ = tokenize_examples([Example("Q: ", "A")], no_pad, context_length=32, train_on_inputs=False)
    n_real = int(item["attention_mask"].sum())
    assert n_real < 32
    assert (item["input_ids"][n_real:] == no_pad.eos_token_id).all()
    assert (item["labels"][n_real:] == IGNORE_INDEX).all()


# --- dataloader --------------------------------------------------------------------------------------------------


def _distinct_rows_file(tmp_path: Path, n: int) -> str:
    rows = [{"instruction": f"Question number {i}", "output": f"Answer {i}"} for i in range(n)]
    return str(_write_jsonl(tmp_path / "rows.jsonl", rows))


def _steps(loader: torch.utils.data.DataLoader, epoch: int) -> list[list[tuple[int, ...]]]:
    loader.sampler.set_epoch(epoch)
    return [[tuple(row.tolist()) for row in batch["input_ids"]] for batch in loader]


def test_two_ranks_batch_one_see_the_rows_of_one_rank_batch_two(tmp_path: Path, tokenizer) -> None:
    path = _distinct_rows_file(tmp_path, 11)  # odd: the leftover row must be dropped the same way
    one = build_dataloader(DataConfig(dataset=path, context_length=96, batch_size=2), tokenizer, _cpu_env(0, 1), seed=7)
    ranks = [
        build_dataloader(DataConfig(dataset=path, context_length=96, batch_size=1), tokenizer, _cpu_env(r, 2), seed=7)
        for r in range(2)
    ]
    seen_orders = []
    for epoch in (0, 1):
        single = _steps(one, epoch)
        r0, r1 = (_steps(loader, epoch) for loader in ranks)
        assert len(single) == len(r0) == len(r1) == 5
        for step, batch in enumerate(single):
            assert len(set(batch)) == 2
            assert set(batch) == {r0[step][0], r1[step][0]}
        seen_orders.append(single)
    assert seen_orders[0] != seen_orders[1]  # set_epoch reshuffles


def test_dataloader_batches_have_fixed_shape(tmp_path: Path, tokenizer, caplog: pytest.LogCaptureFixture) -> None:
    path = _distinct_rows_file(tmp_path, 8)
    cfg = DataConfig(dataset=path, context_length=48, batch_size=2)
    with caplog.at_level(logging.INFO, logger="qlora_fsdp.loader"):
        loader = build_dataloader(cfg, tokenizer, _cpu_env(0, 1), seed=0)
    batch = next(iter(loader))
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    assert all(t.shape == (2, 48) and t.dtype == torch.long for t in batch.values())
    assert "8 rows" in caplog.text

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="qlora_fsdp.loader"):
        build_dataloader(cfg, tokenizer, _cpu_env(1, 2), seed=0)
    assert caplog.text == ""  # only rank 0 logs


def test_dataset_smaller_than_one_step_is_an_error(tmp_path: Path, tokenizer) -> None:
    path = _distinct_rows_file(tmp_path, 3)
    cfg = DataConfig(dataset=path, context_length=96, batch_size=2)
    assert len(build_dataloader(cfg, tokenizer, _cpu_env(0, 1), seed=0)) == 1
    with pytest.raises(UserError, match=r"3 usable rows.*2 ranks x --batch_size 2"):
        build_dataloader(cfg, tokenizer, _cpu_env(0, 2), seed=0)


def test_dataset_samples_applies_in_build_dataloader(tmp_path: Path, tokenizer) -> None:
    path = _distinct_rows_file(tmp_path, 10)
    cfg = DataConfig(dataset=path, dataset_samples=4, context_length=96, batch_size=1)
    assert len(build_dataloader(cfg, tokenizer, _cpu_env(0, 1), seed=0)) == 4
