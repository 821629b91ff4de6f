"""Datasets -> (prompt, response) examples -> token ids and labels (and fixed-length rows of them).

Rows become batches in qlora_fsdp/loader.py; packing several samples into one row is qlora_fsdp/packing.py.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from qlora_fsdp.chat import (
    Conversation,
    conversation_from_pair,
    conversation_from_row,
    encode_conversation,
    is_chat_row,
)
from qlora_fsdp.errors import UserError

IGNORE_INDEX = -100
"""Label value the cross-entropy loss skips (prompt and padding positions)."""

LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")
_ROW_HELP = (
    "each row needs string 'instruction' and 'output', optional 'input', or a chat list 'messages' or 'conversations'"
)


@dataclass(frozen=True)
class Example:
    """One training row after the prompt template is applied; only `response` is learned unless train_on_inputs."""

    prompt: str
    response: str


AnyExample = Example | Conversation
"""An instruction example (prompt, response) or a chat conversation."""


@dataclass(frozen=True)
class TokenizeStats:
    """What tokenization did to the data, so a silently truncated or shrunken dataset shows up in the log.

    rows: examples given; truncated: rows longer than context_length (dropped ones included); dropped: rows with
    nothing left to learn after truncation; total_label_tokens: the tokens the loss is computed on in the kept rows,
    labels[1:] != -100 (the logits at t predict labels[t + 1], so nothing predicts position 0), the same count the
    trainer logs as label_tokens.
    """

    rows: int
    truncated: int
    dropped: int
    total_label_tokens: int

    @property
    def kept(self) -> int:
        return self.rows - self.dropped


# ---------------------------------------------------------------------------------------------------------------
# Prompt templates
# ---------------------------------------------------------------------------------------------------------------


def _alpaca_prompt(instruction: str, inp: str) -> str:
    if inp:
        return (
            "Below is an instruction that describes a task, paired with an input that provides further context. "
            "Write a response that appropriately completes the request.\n\n"
            f"### Instruction:\n{instruction}\n\n### Input:\n{inp}\n\n### Response:\n"
        )
    return (
        "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
        f"### Instruction:\n{instruction}\n\n### Response:\n"
    )


def _guanaco_prompt(instruction: str, inp: str) -> str:
    body = f"{instruction}\n{inp}" if inp else instruction
    return f"### Human: {body} ### Assistant: "


def _qna_prompt(instruction: str, inp: str) -> str:
    body = f"{instruction}\n{inp}" if inp else instruction
    return f"Question: {body}\nAnswer: "


_PROMPT_FORMATTERS: dict[str, Callable[[str, str], str]] = {
    "alpaca": _alpaca_prompt,
    "guanaco": _guanaco_prompt,
    "qna": _qna_prompt,
}
CHAT_STYLE = "chat"
"""Instruction rows become a user and an assistant turn, rendered with the tokenizer's chat template."""
PROMPT_STYLES = (*_PROMPT_FORMATTERS, CHAT_STYLE)


def _check_prompt_style(prompt_style: str) -> None:
    if prompt_style not in PROMPT_STYLES:
        raise UserError(f"unknown prompt style {prompt_style!r}; valid styles: {', '.join(PROMPT_STYLES)}")


def format_prompt(instruction: str, inp: str = "", *, prompt_style: str = "alpaca") -> str:
    """The prompt text for an alpaca-format row in the given style (the response follows it verbatim)."""
    _check_prompt_style(prompt_style)
    if prompt_style == CHAT_STYLE:
        raise UserError("--prompt_style chat has no prompt text of its own: the tokenizer's chat template writes it")
    return _PROMPT_FORMATTERS[prompt_style](instruction, inp)


# ---------------------------------------------------------------------------------------------------------------
# Row validation (shared by local files and hub rows, so every bad row is reported the same way)
# ---------------------------------------------------------------------------------------------------------------


def _field(row: Any, name: str, where: str, *, optional: bool = False, hint: str = _ROW_HELP) -> str:
    """row[name] as a string, or a one-line UserError saying where the row is and what is wrong."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected an object, got {type(row).__name__} ({hint})")
    value = row.get(name)
    if value is None:
        if optional:
            return ""
        what = "missing field" if name not in row else "null field"
        raise UserError(f"{where}: {what} {name!r} ({hint})")
    if not isinstance(value, str):
        raise UserError(f"{where}: field {name!r} must be a string, got {type(value).__name__} ({hint})")
    return value


def _alpaca_example(row: Any, where: str, prompt_style: str) -> AnyExample:
    instruction = _field(row, "instruction", where)
    output = _field(row, "output", where)
    inp = _field(row, "input", where, optional=True)
    if prompt_style == CHAT_STYLE:
        return conversation_from_pair(f"{instruction}\n\n{inp}" if inp else instruction, output, where)
    return Example(format_prompt(instruction, inp, prompt_style=prompt_style), output)


def _row_example(row: Any, where: str, prompt_style: str) -> AnyExample:
    """A chat row (recognised by its `messages`/`conversations` list, whatever the style) or an instruction row."""
    if is_chat_row(row):
        return conversation_from_row(row, where)
    return _alpaca_example(row, where, prompt_style)


# ---------------------------------------------------------------------------------------------------------------
# Local files
# ---------------------------------------------------------------------------------------------------------------


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except UnicodeDecodeError as exc:
        raise UserError(f"--dataset {path}: not UTF-8 text (byte {exc.start}); save the file as UTF-8") from None


def _json_lines(path: str, text: str, expected: str) -> Iterable[tuple[str, Any]]:
    """(location, row) per non-blank line; the location keeps the line number when blank lines shift rows."""
    row = 0
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        row += 1
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(
                f"--dataset {path} line {line_no}: not valid JSON ({exc.msg} at column {exc.colno}); "
                f"expected {expected}"
            ) from None
        yield (f"--dataset {path} row {row}" if row == line_no else f"--dataset {path} row {row} (line {line_no})"), obj


def _json_rows(path: str) -> Iterable[tuple[str, Any]]:
    """A .json file is either one JSON list of rows or JSON lines; the first character tells which."""
    text = _read_text(path)
    if not text.lstrip().startswith("["):
        return _json_lines(path, text, "a JSON list of rows or one JSON object per line")
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(
            f"--dataset {path} line {exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})"
        ) from None
    return ((f"--dataset {path} row {i}", obj) for i, obj in enumerate(rows, start=1))


def _jsonl_rows(path: str) -> Iterable[tuple[str, Any]]:
    return _json_lines(path, _read_text(path), "one JSON object per line")


def _parquet_rows(path: str) -> Iterable[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"--dataset {path}: not a readable parquet file ({_one_line(exc)})") from None
    return ((f"--dataset {path} row {i}", obj) for i, obj in enumerate(rows, start=1))


_LOCAL_READERS: dict[str, Callable[[str], Iterable[tuple[str, Any]]]] = {
    ".json": _json_rows,
    ".jsonl": _jsonl_rows,
    ".parquet": _parquet_rows,
}


def _load_local(path: str, samples: int, prompt_style: str) -> list[AnyExample]:
    """The first `samples` rows (0: all), each validated up front: a bad row 40,000 lines in should fail now, not
    mid-epoch, while rows past the limit are never read."""
    reader = _LOCAL_READERS[os.path.splitext(path)[1].lower()]
    examples = []
    for where, row in reader(path):
        if samples and len(examples) >= samples:
            break
        examples.append(_row_example(row, where, prompt_style))
    return examples


# ---------------------------------------------------------------------------------------------------------------
# Named datasets (hub + synthetic)
# ---------------------------------------------------------------------------------------------------------------


def _hub_rows(name: str, repo: str, split: str, limit: int) -> list[dict[str, Any]]:
    """Rows of a hub dataset, or a one-line UserError when the hub cannot be reached (offline clusters)."""
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    if limit:
        split = f"{split}[:{limit}]"
    try:
        ds = datasets.load_dataset(repo, split=split)
    except DatasetNotFoundError as exc:
        raise UserError(
            f"dataset {name!r} ({repo}) was not found on the Hugging Face hub or needs a login ({_one_line(exc)})"
        ) from None
    except (ConnectionError, OSError) as exc:
        raise UserError(
            f"dataset {name!r} ({repo}): the Hugging Face hub could not be reached ({_one_line(exc)}); "
            "pass a local .jsonl file in alpaca format instead (--dataset data.jsonl, rows with "
            "'instruction', 'output' and optional 'input')"
        ) from None
    return list(ds)


def _load_alpaca(samples: int, prompt_style: str) -> list[AnyExample]:
    rows = _hub_rows("alpaca", "yahma/alpaca-cleaned", "train", samples)
    return [_alpaca_example(r, f"alpaca row {i}", prompt_style) for i, r in enumerate(rows, start=1)]


def _load_alpaca_sample(samples: int, prompt_style: str) -> list[AnyExample]:
    limit = min(samples, 128) if samples else 128
    rows = _hub_rows("alpaca_sample", "yahma/alpaca-cleaned", "train", limit)
    return [_alpaca_example(r, f"alpaca_sample row {i}", prompt_style) for i, r in enumerate(rows, start=1)]


_GUANACO_ASSISTANT = "### Assistant:"


def _load_guanaco(samples: int, prompt_style: str) -> list[Example]:
    """The last Assistant turn is the response; earlier turns are context. Rows without one are skipped."""
    rows = _hub_rows("guanaco", "timdettmers/openassistant-guanaco", "train", samples)
    examples = []
    for i, row in enumerate(rows, start=1):
        text = _field(row, "text", f"guanaco row {i}", hint="expected a string 'text'")
        cut = text.rfind(_GUANACO_ASSISTANT)
        if cut < 0:
            continue
        # Same convention as the guanaco prompt style: the prompt ends with "### Assistant: ".
        prompt = text[:cut] + _GUANACO_ASSISTANT + " "
        examples.append(Example(prompt, text[cut + len(_GUANACO_ASSISTANT) :].strip()))
    return examples


def _load_sql(samples: int, prompt_style: str) -> list[Example]:
    # know_sql ships only a "validation" split; it is the whole dataset.
    rows = _hub_rows("sql", "knowrohit07/know_sql", "validation", samples)
    hint = "expected strings 'context', 'question', 'answer'"
    examples = []
    for i, row in enumerate(rows, start=1):
        where = f"sql row {i}"
        context = _field(row, "context", where, hint=hint)
        question = _field(row, "question", where, hint=hint)
        prompt = (
            "Write an SQL query that answers the question, using this schema.\n\n"
            f"### Schema:\n{context}\n\n### Question:\n{question}\n\n### SQL:\n"
        )
        examples.append(Example(prompt, _field(row, "answer", where, hint=hint)))
    return examples


def _load_orca_math(samples: int, prompt_style: str) -> list[Example]:
    rows = _hub_rows("orca_math", "microsoft/orca-math-word-problems-200k", "train", samples)
    hint = "expected strings 'question', 'answer'"
    examples = []
    for i, row in enumerate(rows, start=1):
        where = f"orca_math row {i}"
        prompt = _qna_prompt(_field(row, "question", where, hint=hint), "")
        examples.append(Example(prompt, _field(row, "answer", where, hint=hint)))
    return examples


_DUMMY_ROWS = 512
_DUMMY_WORDS_PER_ROW = 3000  # > 2048 tokens with any common tokenizer, so every row fills a 2048 context
_DUMMY_TEXT = (
    "the of and to in is was for on that with as by at from his it an were are which this be or has had not "
    "but first one their its new after who they have her she two been other when there all during into school "
    "time may years more most only over city some world would where later up such used many can state about "
    "national out known university united then made"
)
_DUMMY_VOCAB = tuple(_DUMMY_TEXT.split())


def _load_dummy(samples: int, prompt_style: str) -> list[AnyExample]:
    """Synthetic long rows for memory tests: same seed every call, so runs (and ranks) agree without a hub."""
    rng = random.Random(0)
    n = min(samples, _DUMMY_ROWS) if samples else _DUMMY_ROWS
    examples = []
    for _ in range(n):
        row = {
            "instruction": "Continue the text.",
            "output": " ".join(rng.choices(_DUMMY_VOCAB, k=_DUMMY_WORDS_PER_ROW)),
        }
        examples.append(_alpaca_example(row, "dummy", prompt_style))
    return examples


_NAMED_DATASETS: dict[str, Callable[[int, str], list[AnyExample]]] = {
    "alpaca": _load_alpaca,
    "alpaca_sample": _load_alpaca_sample,
    "guanaco": _load_guanaco,
    "sql": _load_sql,
    "orca_math": _load_orca_math,
    "dummy": _load_dummy,
}
DATASET_NAMES = tuple(_NAMED_DATASETS)


def load_examples(dataset: str, *, samples: int = 0, prompt_style: str = "alpaca") -> list[AnyExample]:
    """Examples of every source of `dataset` (see load_sources), concatenated in order."""
    return [e for _, examples in load_sources(dataset, samples=samples, prompt_style=prompt_style) for e in examples]


def load_sources(dataset: str, *, samples: int = 0, prompt_style: str = "alpaca") -> list[tuple[str, list[AnyExample]]]:
    """(source, examples) per comma-separated name or local file of `dataset`; samples > 0 keeps the first N rows
    of each source. A path that exists is one source even if its name holds a comma."""
    _check_prompt_style(prompt_style)
    if dataset in _NAMED_DATASETS or os.path.exists(os.path.expanduser(dataset)):
        names = [dataset]
    else:
        names = [name.strip() for name in dataset.split(",")]
    if not all(names):
        raise UserError(f"--dataset {dataset}: an empty name in the comma-separated list")
    return [(name, _load_source(name, samples, prompt_style)) for name in names]


def _load_source(dataset: str, samples: int, prompt_style: str) -> list[AnyExample]:
    """Examples from a named dataset or a local file.

    The loader alone applies the limit (it reads only those rows, and knows whether a skipped row counts); the
    config has already checked samples >= 0.
    """
    loader = _NAMED_DATASETS.get(dataset)
    path = os.path.expanduser(dataset)
    if loader is not None:
        examples = loader(samples, prompt_style)
    elif path.lower().endswith(LOCAL_SUFFIXES) or os.path.exists(path):
        if not os.path.isfile(path):
            raise UserError(f"--dataset {dataset}: {'not a file' if os.path.exists(path) else 'no such file'}")
        if not path.lower().endswith(LOCAL_SUFFIXES):
            raise UserError(f"--dataset {dataset}: unsupported file type; use {', '.join(LOCAL_SUFFIXES)}")
        examples = _load_local(path, samples, prompt_style)
    else:
        raise UserError(
            f"unknown dataset {dataset!r}; valid names: {', '.join(DATASET_NAMES)}, "
            f"or a local {'/'.join(LOCAL_SUFFIXES)} file in alpaca or chat format (several: comma-separated)"
        )
    if not examples:
        raise UserError(f"--dataset {dataset}: no rows to train on")
    return examples


# ---------------------------------------------------------------------------------------------------------------
# Tokenization
# ---------------------------------------------------------------------------------------------------------------


Sample = tuple[list[int], list[int]]
"""(input_ids, labels) of one example at its full length, labels -100 where nothing is learned."""


def pad_token_id(tokenizer: Any) -> int:
    """The id that fills rows past their tokens (never learned, never attended to): pad, else eos."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def encode_examples(examples: list[AnyExample], tokenizer: Any, *, train_on_inputs: bool) -> list[Sample]:
    """Each example's (ids, labels), untruncated; fitting them into rows (truncated and padded, or packed) is the
    caller's business.

    Instruction example: prompt + response + eos, the prompt unlabelled unless train_on_inputs. Conversation: the
    chat template's rendering, only assistant replies (and their end-of-turn token) labelled unless
    train_on_inputs; one without an assistant turn is empty, so it is dropped like a row with nothing to learn.
    """
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise UserError("the tokenizer has no eos token; the model cannot learn where a response ends")
    if not examples:
        raise UserError("no examples to tokenize")
    plain = [e for e in examples if isinstance(e, Example)]
    prompts = tokenizer([e.prompt for e in plain], add_special_tokens=False)["input_ids"] if plain else []
    responses = tokenizer([e.response for e in plain], add_special_tokens=False)["input_ids"] if plain else []
    pairs = zip(prompts, responses, strict=True)
    samples: list[Sample] = []
    for example in examples:
        if isinstance(example, Example):
            prompt_ids, response_ids = next(pairs)
            prompt_labels = list(prompt_ids) if train_on_inputs else [IGNORE_INDEX] * len(prompt_ids)
            samples.append(([*prompt_ids, *response_ids, eos_id], [*prompt_labels, *response_ids, eos_id]))
        elif not example.has_reply:
            samples.append(([], []))
        else:
            ids, learned = encode_conversation(example, tokenizer)
            samples.append(
                (ids, [i if train_on_inputs or m else IGNORE_INDEX for i, m in zip(ids, learned, strict=True)])
            )
    return samples


def learned_tokens(labels: list[int]) -> int:
    """Label tokens the loss learns from a sample: labels[1:] (nothing predicts a sample's first token)."""
    return sum(label != IGNORE_INDEX for label in labels[1:])


def all_dropped_error(examples: list[AnyExample], context_length: int) -> UserError:
    if all(isinstance(e, Conversation) and not e.has_reply for e in examples):
        return UserError(f"all {len(examples)} rows were dropped: no conversation has an assistant turn to learn")
    return UserError(
        f"all {len(examples)} rows were dropped: within --context_length {context_length} none has a token "
        "the loss can learn (the prompts fill it); use a larger --context_length"
    )


def tokenize_examples(
    examples: list[AnyExample], tokenizer: Any, *, context_length: int, train_on_inputs: bool
) -> tuple[list[dict[str, torch.Tensor]], TokenizeStats]:
    """Fixed-length rows (input_ids, labels, attention_mask), so every step has the same shape on every rank.

    Each example's sequence (see encode_examples) is cut to context_length from the right, then padded; labels
    are -100 on padding. The loss learns labels[1:] (nothing predicts position 0), so a row with no label in
    labels[1:] after truncation is dropped: it would add a loss over zero tokens (NaN in a mean). The config's
    --context_length minimum is the only one; a context too short for any row drops them all.
    """
    pad_id = pad_token_id(tokenizer)
    items: list[dict[str, torch.Tensor]] = []
    truncated = dropped = label_tokens = 0
    for ids, labels in encode_examples(examples, tokenizer, train_on_inputs=train_on_inputs):
        if len(ids) > context_length:
            truncated += 1
            ids, labels = ids[:context_length], labels[:context_length]
        learned = learned_tokens(labels)
        if not learned:
            dropped += 1
            continue
        n_pad = context_length - len(ids)
        label_tokens += learned
        items.append(
            {
                "input_ids": torch.tensor(ids + [pad_id] * n_pad, dtype=torch.long),
                "labels": torch.tensor(labels + [IGNORE_INDEX] * n_pad, dtype=torch.long),
                "attention_mask": torch.tensor([1] * len(ids) + [0] * n_pad, dtype=torch.long),
            }
        )
    stats = TokenizeStats(rows=len(examples), truncated=truncated, dropped=dropped, total_label_tokens=label_tokens)
    if not items:
        raise all_dropped_error(examples, context_length)
    return items, stats
