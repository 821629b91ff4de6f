"""qlora_fsdp.data: file formats, row errors, prompt templates, label masking, truncation, per-batch padding and
rank sharding."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from qlora_fsdp.config.options import ConfigError, DataConfig, EvalConfig, build_config
from qlora_fsdp.data import IGNORE_INDEX, sources
from qlora_fsdp.data.formats import PROMPT_STYLES, Example, load_examples, pad_token_id
from qlora_fsdp.data.loader import Batching, build_loaders
from qlora_fsdp.data.rows import PAD_MULTIPLE, FitStats, collate, fit_examples
from qlora_fsdp.data.sources import DATASET_NAMES
from qlora_fsdp.errors import UserError
from qlora_fsdp.parallel.distributed import DistEnv

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


def _padded(
    examples: list[Example],
    tokenizer: PreTrainedTokenizerFast,
    *,
    context_length: int,
    train_on_inputs: bool,
    pad_to_context: bool = False,
) -> tuple[dict[str, torch.Tensor] | None, FitStats]:
    """The examples' kept samples as one padded batch (None if none is kept), and what fitting them did."""
    samples, stats = fit_examples(examples, tokenizer, context_length=context_length, train_on_inputs=train_on_inputs)
    items = [{"input_ids": ids, "labels": labels} for ids, labels in samples]
    pad = pad_token_id(tokenizer)
    batch = collate(items, pad_id=pad, context_length=context_length, pad_to_context=pad_to_context) if items else None
    return batch, stats


def _round_up(n: int) -> int:
    return -(-n // PAD_MULTIPLE) * PAD_MULTIPLE


def _loaders(cfg: DataConfig, tokenizer, env: DistEnv, *, seed: int = 0, **kwargs):
    """The training loader alone (no evaluation set configured)."""
    train, evaluation = build_loaders(cfg, EvalConfig(), tokenizer, env, Batching(seed=seed, **kwargs))
    assert evaluation is None
    return train


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


def test_load_examples_leaves_the_sample_limit_to_the_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """--dataset_samples is validated by the config and applied by a named source alone (it knows whether it counts
    rows or examples): load_examples hands the value over and returns the source's examples as they are."""
    asked: list[int] = []

    class Stub:
        def identity(self, name: str) -> dict:
            return {"stub": name}

        def rows(self, name: str, *, samples: int, **_: object):
            asked.append(samples)
            for i in range(5):
                yield f"{name} row {i + 1}", {"prompt": f"q{i}", "completion": f"a{i}"}

    monkeypatch.setitem(sources.NAMED_DATASETS, "stub", Stub())
    assert load_examples("stub", samples=3) == [Example(f"q{i}", f"a{i}") for i in range(5)]  # not cut a second time
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
            r"data\.jsonl row 2: missing field 'output' \(each row needs 'instruction' and 'output'",
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


def test_empty_file_is_an_error(tmp_path: Path, tokenizer) -> None:
    """Alone or in a mixture: a source without rows is named (a mixture would otherwise just lose it)."""
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    assert load_examples(str(path)) == []  # in memory it is simply empty; training refuses it
    full = _write_jsonl(tmp_path / "full.jsonl", ROWS)
    for dataset in (str(path), f"{full},{path}"):
        with pytest.raises(UserError, match=rf"^--dataset {path}: no rows to train on$"):
            _loaders(DataConfig(dataset=dataset, context_length=48), tokenizer, _cpu_env(0, 1))


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

    def fake_load_dataset(repo: str, *, split: str, **_: object) -> list[dict]:
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
        ("yahma/alpaca-cleaned", "train"),  # alpaca_sample and --dataset_samples take the first rows as they read
        ("yahma/alpaca-cleaned", "train"),
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

    monkeypatch.setattr(datasets, "load_dataset", lambda repo, *, split, **_: _split_rows(rows, split))
    assert [e.response for e in load_examples("guanaco", samples=3)] == ["1", "2"]
    assert [e.response for e in load_examples("guanaco")] == ["1", "2", "3"]


def test_hub_row_with_wrong_type_is_a_user_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda repo, *, split, **_: [{"question": "q", "answer": 3}])
    # The named dataset's fields are checked before they become a prompt/completion row.
    with pytest.raises(UserError, match="orca_math row 1: field 'answer' must be a string, got int"):
        load_examples("orca_math")


# --- prompt styles -----------------------------------------------------------------------------------------------


def test_prompt_styles_text(tmp_path: Path) -> None:
    path = str(_write_jsonl(tmp_path / "d.jsonl", ROWS[:2]))
    assert PROMPT_STYLES == ("alpaca", "guanaco", "qna", "raw", "chat")
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
    raw = load_examples(path, prompt_style="raw")  # TRL's reading: the text as it is
    assert [e.prompt for e in raw] == ["Name a color.", "Add the numbers.\n2 and 3"]
    assert [e.response for e in qna] == ["Blue.", "5"]


def test_unknown_prompt_style(tmp_path: Path) -> None:
    path = str(_write_jsonl(tmp_path / "d.jsonl", ROWS))
    with pytest.raises(UserError, match=r"unknown prompt style 'chatml'.*alpaca, guanaco, qna, raw, chat"):
        load_examples(path, prompt_style="chatml")


# --- dummy -------------------------------------------------------------------------------------------------------


def test_dummy_is_long_deterministic_and_honours_samples(tokenizer: PreTrainedTokenizerFast) -> None:
    full = load_examples("dummy")
    assert len(full) == 512
    assert full == load_examples("dummy")
    assert len({e.response for e in full[:16]}) == 16  # rows differ from each other
    few = load_examples("dummy", samples=3)
    assert few == full[:3]
    batch, stats = _padded(few, tokenizer, context_length=2048, train_on_inputs=False)
    assert stats.truncated == 3  # every row fills a 2048-token context
    assert batch is not None and batch["attention_mask"].tolist() == [[1] * 2048] * 3


# --- tokenization ------------------------------------------------------------------------------------------------


def test_prompt_tokens_and_padding_are_masked(tokenizer: PreTrainedTokenizerFast) -> None:
    ex = Example("Question: Name a color.\nAnswer: ", "Blue.")
    prompt_ids, response_ids = _ids(tokenizer, ex.prompt), _ids(tokenizer, ex.response)
    n_prompt, n_real = len(prompt_ids), len(prompt_ids) + len(response_ids) + 1
    length = _round_up(n_real) + 8  # room past the batch's own width: per-batch padding stops short of it
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert pad != eos

    # Padded to the batch's longest row rounded up to a multiple of 8, or (pad_to_context) to the context.
    for pad_to_context, width in ((False, _round_up(n_real)), (True, length)):
        batch, stats = _padded(
            [ex], tokenizer, context_length=length, train_on_inputs=False, pad_to_context=pad_to_context
        )
        assert batch is not None
        n_pad = width - n_real
        assert n_pad > 0
        for key in ("input_ids", "labels", "attention_mask"):
            assert batch[key].dtype == torch.long and batch[key].shape == (1, width)
        assert batch["input_ids"][0].tolist() == prompt_ids + response_ids + [eos] + [pad] * n_pad
        assert batch["labels"][0].tolist() == [IGNORE_INDEX] * n_prompt + response_ids + [eos] + [IGNORE_INDEX] * n_pad
        assert batch["attention_mask"][0].tolist() == [1] * n_real + [0] * n_pad
        assert stats.rows == 1 and stats.truncated == 0 and stats.dropped == 0
        assert stats.label_tokens == len(response_ids) + 1  # position 0 is a prompt token: unlabelled anyway


def test_batch_is_padded_to_its_longest_row(tokenizer: PreTrainedTokenizerFast) -> None:
    short, long = Example("Q: ", "A"), Example("Question: Name a color.\nAnswer: ", "row number one two three")
    batch, _ = _padded([short, long], tokenizer, context_length=512, train_on_inputs=False)
    assert batch is not None
    real = batch["attention_mask"].sum(1).tolist()
    assert real[0] < real[1] and batch["input_ids"].shape == (2, _round_up(real[1]))
    # The context caps the width even when the longest row is not a multiple of 8.
    capped, _ = _padded([long], tokenizer, context_length=real[1] - 1, train_on_inputs=False)
    assert capped is not None and capped["input_ids"].shape == (1, real[1] - 1)


def test_train_on_inputs_labels_prompt_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    ex = Example("Question: Name a color.\nAnswer: ", "Blue.")
    batch, stats = _padded([ex], tokenizer, context_length=64, train_on_inputs=True)
    assert batch is not None
    item = {k: v[0] for k, v in batch.items()}
    n_real = int(item["attention_mask"].sum())
    assert n_real < len(item["attention_mask"])  # there is padding to check
    assert item["labels"][:n_real].tolist() == item["input_ids"][:n_real].tolist()
    assert (item["labels"][n_real:] == IGNORE_INDEX).all()
    assert stats.label_tokens == n_real - 1  # nothing predicts position 0


def test_label_tokens_are_the_tokens_the_loss_is_computed_on(tokenizer: PreTrainedTokenizerFast) -> None:
    """The logits at t predict labels[t + 1] (the trainer's labels[:, 1:]), so a labelled position 0 is never learned:
    the data log's count must match the trainer's label_tokens, and a row labelled only there has nothing to learn."""
    examples = [Example("Q: ", "A"), Example("Question: hi\nAnswer: ", "Blue."), Example("", "")]
    for train_on_inputs in (True, False):
        batch, stats = _padded(examples, tokenizer, context_length=32, train_on_inputs=train_on_inputs)
        assert batch is not None
        assert (stats.rows, stats.dropped, stats.samples) == (3, 1, 2)  # Example("", "") is eos alone, at position 0
        assert len(batch["input_ids"]) == 2
        assert stats.label_tokens == int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        # With train_on_inputs position 0 is labelled, so counting every label would over-count by one per row.
        assert (batch["labels"][:, 0] != IGNORE_INDEX).all() == train_on_inputs


def test_truncation_counts_and_drops_rows_with_nothing_to_learn(tokenizer: PreTrainedTokenizerFast) -> None:
    short = Example("Question: hi\nAnswer: ", "Blue.")
    long_response = Example("Question: hi\nAnswer: ", "row number one two three " * 20)
    long_prompt = Example("Question: " + "row number one two three " * 20, "Blue.")
    n_prompt = len(_ids(tokenizer, short.prompt))
    length = n_prompt + 8
    assert len(_ids(tokenizer, long_prompt.prompt)) > length

    batch, stats = _padded([short, long_response, long_prompt], tokenizer, context_length=length, train_on_inputs=False)
    assert batch is not None
    assert (stats.rows, stats.truncated, stats.dropped, stats.samples) == (3, 2, 1, 2)
    assert len(batch["input_ids"]) == 2
    cut = {k: v[1] for k, v in batch.items()}
    assert cut["attention_mask"].tolist() == [1] * length  # truncated from the right, no padding
    assert (
        cut["input_ids"].tolist()
        == (_ids(tokenizer, long_response.prompt) + _ids(tokenizer, long_response.response))[:length]
    )
    assert stats.label_tokens == int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    assert stats.tokens == int(batch["attention_mask"].sum())

    # The same long-prompt row is kept when the prompt is learned too.
    _, stats_inputs = fit_examples([long_prompt], tokenizer, context_length=length, train_on_inputs=True)
    assert stats_inputs.dropped == 0 and stats_inputs.truncated == 1


def test_all_rows_dropped_suggests_longer_context(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    prompt = "Question: " + "row number one two three " * 20
    samples, stats = fit_examples([Example(prompt, "Blue.")], tokenizer, context_length=16, train_on_inputs=False)
    assert samples == [] and (stats.dropped, stats.samples) == (1, 0)  # counted here; the loader refuses it
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": prompt, "completion": "Blue."}])
    with pytest.raises(UserError, match="--context_length"):
        _loaders(DataConfig(dataset=str(path), context_length=16), tokenizer, _cpu_env(0, 1))


def test_context_length_minimum_is_the_configs_rule(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    """The config rejects --context_length < 8 before any work; tokenization has no threshold of its own, and a
    context too short to hold a learnable token drops every row, with the usual advice."""
    with pytest.raises(ConfigError, match="--context_length must be >= 8"):
        build_config({"model": "m", "context_length": 7}).validate()
    _, stats = fit_examples([Example("", "Blue.")], tokenizer, context_length=1, train_on_inputs=True)
    assert (stats.rows, stats.dropped, stats.samples) == (1, 1, 0)
    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": "Blue."}])
    with pytest.raises(UserError, match=r"all 1 rows were dropped.*larger --context_length"):
        _loaders(DataConfig(dataset=str(path), context_length=1, train_on_inputs=True), tokenizer, _cpu_env(0, 1))


def test_missing_pad_token_pads_with_eos(tokenizer: PreTrainedTokenizerFast) -> None:
    no_pad = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|endoftext|>")
    assert no_pad.pad_token_id is None
    batch, _ = _padded([Example("Q: ", "A")], no_pad, context_length=32, train_on_inputs=False)
    assert batch is not None
    item = {k: v[0] for k, v in batch.items()}
    n_real = int(item["attention_mask"].sum())
    assert n_real < len(item["input_ids"])
    assert (item["input_ids"][n_real:] == no_pad.eos_token_id).all()
    assert (item["labels"][n_real:] == IGNORE_INDEX).all()


def test_text_and_prompt_completion_rows(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    """A `text` row is learned whole (an empty prompt); a prompt/completion row is used verbatim, its completion
    learned."""
    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": "row number one"}, {"prompt": "Q: ", "completion": "A"}])
    text, pair = load_examples(str(path))
    assert (text, pair) == (Example("", "row number one"), Example("Q: ", "A"))
    samples, _ = fit_examples([text, pair], tokenizer, context_length=64, train_on_inputs=False)
    eos = tokenizer.eos_token_id
    text_ids, prompt_ids, completion_ids = (_ids(tokenizer, t) for t in ("row number one", "Q: ", "A"))
    assert samples[0] == ([*text_ids, eos], [*text_ids, eos])
    assert samples[1] == (
        [*prompt_ids, *completion_ids, eos],
        [IGNORE_INDEX] * len(prompt_ids) + [*completion_ids, eos],
    )


def test_sequences_start_with_the_tokenizers_bos_once(tokenizer: PreTrainedTokenizerFast) -> None:
    """A tokenizer that puts BOS before a text (Llama's) gets it at the start of every sample, never learned."""
    from tokenizers import processors

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    bos_id = backend.token_to_id("<|pad|>")  # any special token stands in for a BOS here
    backend.post_processor = processors.TemplateProcessing(single="<|pad|> $A", special_tokens=[("<|pad|>", bos_id)])
    with_bos = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")
    ex = Example("Q: ", "A")
    (sample,), stats = fit_examples([ex], with_bos, context_length=32, train_on_inputs=True)
    plain = _ids(tokenizer, ex.prompt) + _ids(tokenizer, ex.response) + [tokenizer.eos_token_id]
    assert sample[0] == [bos_id, *plain]
    assert sample[1] == [IGNORE_INDEX, *plain]
    assert stats.label_tokens == len(plain)


# --- dataloader --------------------------------------------------------------------------------------------------


def _distinct_rows_file(tmp_path: Path, n: int) -> str:
    rows = [{"instruction": f"Question number {i}", "output": f"Answer {i}"} for i in range(n)]
    return str(_write_jsonl(tmp_path / "rows.jsonl", rows))


def _steps(loader: torch.utils.data.DataLoader, epoch: int) -> list[list[tuple[int, ...]]]:
    """Each step's rows without their padding (a batch is padded to its own longest row)."""
    loader.sampler.set_epoch(epoch)
    return [
        [
            tuple(row[mask.bool()].tolist())
            for row, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)
        ]
        for batch in loader
    ]


def test_two_ranks_batch_one_see_the_rows_of_one_rank_batch_two(tmp_path: Path, tokenizer) -> None:
    path = _distinct_rows_file(tmp_path, 11)  # odd: the leftover row must be dropped the same way
    one = _loaders(DataConfig(dataset=path, context_length=96, batch_size=2), tokenizer, _cpu_env(0, 1), seed=7)
    ranks = [
        _loaders(DataConfig(dataset=path, context_length=96, batch_size=1), tokenizer, _cpu_env(r, 2), seed=7)
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


def test_dataloader_pads_each_batch_to_its_longest_row(tmp_path: Path, tokenizer, caplog) -> None:
    path = _distinct_rows_file(tmp_path, 8)
    cfg = DataConfig(dataset=path, context_length=96, batch_size=2)
    with caplog.at_level(logging.INFO, logger="qlora_fsdp.data.loader"):
        loader = _loaders(cfg, tokenizer, _cpu_env(0, 1))
    for batch in loader:
        assert set(batch) == {"input_ids", "labels", "attention_mask"}
        width = _round_up(int(batch["attention_mask"].sum(1).max()))
        assert width < 96  # short rows: per-batch padding stops well short of the context
        assert all(t.shape == (2, width) and t.dtype == torch.long for t in batch.values())
    assert "tokenized cache built" in caplog.text
    assert "training rows: 8 rows, 0 truncated at 96 tokens, 0 dropped" in caplog.text

    # --pad_to_context, and fixed_shapes (--compile), pad every batch to the context; the cache is reused.
    for pad_cfg, fixed in (
        (DataConfig(dataset=path, context_length=96, batch_size=2, pad_to_context=True), False),
        (cfg, True),
    ):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="qlora_fsdp.data.loader"):
            loader = _loaders(pad_cfg, tokenizer, _cpu_env(0, 1), fixed_shapes=fixed)
        assert "tokenized cache reused" in caplog.text
        assert all(t.shape == (2, 96) for batch in loader for t in batch.values())

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="qlora_fsdp.data.loader"):
        _loaders(cfg, tokenizer, _cpu_env(1, 2))
    assert caplog.text == ""  # only rank 0 logs


def test_dataset_smaller_than_one_step_is_an_error(tmp_path: Path, tokenizer) -> None:
    path = _distinct_rows_file(tmp_path, 3)
    cfg = DataConfig(dataset=path, context_length=96, batch_size=2)
    assert len(_loaders(cfg, tokenizer, _cpu_env(0, 1))) == 1
    with pytest.raises(UserError, match=r"3 usable rows.*2 ranks x --batch_size 2"):
        _loaders(cfg, tokenizer, _cpu_env(0, 2))


def test_dataset_samples_applies_in_build_loaders(tmp_path: Path, tokenizer) -> None:
    path = _distinct_rows_file(tmp_path, 10)
    cfg = DataConfig(dataset=path, dataset_samples=4, context_length=96, batch_size=1)
    assert len(_loaders(cfg, tokenizer, _cpu_env(0, 1))) == 4
