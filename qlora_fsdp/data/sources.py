"""Where rows come from: local json/jsonl/parquet files, hub datasets and the named ones, read lazily.

The lowest stage of the data path: it yields (location, row) pairs and says what identifies a source (for the
tokenized cache's key). It knows nothing about formats; a named dataset yields rows in one of the formats the
encode stage reads (alpaca or prompt/completion), which validates them, after checking the fields it builds them
from.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from qlora_fsdp.errors import UserError

LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")
Located = tuple[str, Any]
"""(where the row is, for errors: "--dataset FILE row N"; the row as read)."""


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def source_names(dataset: str) -> list[str]:
    """The comma-separated names of --dataset; a path that exists is one source even if its name holds a comma."""
    if dataset in NAMED_DATASETS or os.path.exists(os.path.expanduser(dataset)):
        return [dataset]
    names = [name.strip() for name in dataset.split(",")]
    if not all(names):
        raise UserError(f"--dataset {dataset}: an empty name in the comma-separated list")
    return names


# ---------------------------------------------------------------------------------------------------------------
# Local files
# ---------------------------------------------------------------------------------------------------------------


def _lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, line), read as it goes (a large file is never held whole), each line decoded alone so a
    decoding error names its line."""
    with open(path, "rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            try:
                yield line_no, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise UserError(
                    f"--dataset {path} line {line_no}: not UTF-8 text (byte {exc.start + 1} of the line); save the "
                    "file as UTF-8"
                ) from None


def _json_lines(path: str, lines: Iterator[tuple[int, str]], expected: str) -> Iterator[Located]:
    """(location, row) per non-blank line; the location keeps the line number when blank lines shift rows."""
    row = 0
    for line_no, line in lines:
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


def _json_rows(path: str) -> Iterator[Located]:
    """A .json file is either one JSON list of rows or JSON lines; the first non-blank character tells which."""
    lines = _lines(path)
    head: list[tuple[int, str]] = []
    for item in lines:
        head.append(item)
        if item[1].strip():
            break
    if not head or not head[-1][1].lstrip().startswith("["):
        yield from _json_lines(path, iter([*head, *lines]), "a JSON list of rows or one JSON object per line")
        return
    text = "".join(line for _, line in head) + "".join(line for _, line in lines)
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(
            f"--dataset {path} line {exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})"
        ) from None
    yield from ((f"--dataset {path} row {i}", obj) for i, obj in enumerate(rows, start=1))


def _jsonl_rows(path: str) -> Iterator[Located]:
    return _json_lines(path, _lines(path), "one JSON object per line")


def _parquet_rows(path: str) -> Iterator[Located]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=1024)
        row = 0
        for batch in batches:
            for obj in batch.to_pylist():
                row += 1
                yield f"--dataset {path} row {row}", obj
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"--dataset {path}: not a readable parquet file ({one_line(exc)})") from None


_LOCAL_READERS: dict[str, Callable[[str], Iterator[Located]]] = {
    ".json": _json_rows,
    ".jsonl": _jsonl_rows,
    ".parquet": _parquet_rows,
}


# ---------------------------------------------------------------------------------------------------------------
# Hub and named datasets
# ---------------------------------------------------------------------------------------------------------------


def _hub_dataset(name: str, repo: str, split: str, *, streaming: bool = False) -> Any:
    """A hub dataset (datasets' own cache, or read as it is needed), or a one-line UserError when the hub cannot
    be reached."""
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    try:
        return datasets.load_dataset(repo, split=split, streaming=streaming)
    except DatasetNotFoundError as exc:
        raise UserError(
            f"dataset {name!r} ({repo}) was not found on the Hugging Face hub or needs a login ({one_line(exc)})"
        ) from None
    except (ConnectionError, OSError) as exc:
        raise UserError(
            f"dataset {name!r} ({repo}): the Hugging Face hub could not be reached ({one_line(exc)}); "
            "pass a local .jsonl file instead (--dataset data.jsonl, rows in alpaca, chat, text or "
            "prompt/completion format)"
        ) from None


class _Hub:
    """A hub dataset (its first `limit` rows; 0: all) whose rows are passed on through `convert` (None skips one)."""

    synthetic = False

    def __init__(
        self, repo: str, split: str, convert: Callable[[dict[str, Any], str], Any] | None = None, *, limit: int = 0
    ) -> None:
        self.repo, self.split, self.convert, self.limit = repo, split, convert, limit

    def identity(self, name: str) -> dict[str, Any]:
        dataset = _hub_dataset(name, self.repo, self.split)
        return {"hub": self.repo, "split": self.split, "limit": self.limit, "fingerprint": dataset._fingerprint}

    def rows(self, name: str, *, samples: int, streaming: bool) -> Iterator[Located]:
        """The rows; `samples` counts the hub's rows, skipped ones included."""
        limit = min(n for n in (self.limit, samples) if n) if self.limit or samples else 0
        dataset = _hub_dataset(name, self.repo, self.split, streaming=streaming)
        for i, row in enumerate(dataset, start=1):
            if limit and i > limit:
                return
            where = f"{name} row {i}"
            converted = row if self.convert is None else self.convert(row, where)
            if converted is not None:
                yield where, converted


_GUANACO_ASSISTANT = "### Assistant:"


def _text(row: dict[str, Any], key: str, where: str) -> str:
    """A hub row's string field, checked before it goes into a prompt (the formats stage sees only the result)."""
    value = row.get(key)
    if not isinstance(value, str):
        raise UserError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    return value


def _guanaco(row: dict[str, Any], where: str) -> dict[str, str] | None:
    """The last Assistant turn is the completion; earlier turns are the prompt. Rows without one are skipped."""
    text = row.get("text")
    cut = text.rfind(_GUANACO_ASSISTANT) if isinstance(text, str) else -1
    if cut < 0:
        return None
    prompt, completion = text[:cut] + _GUANACO_ASSISTANT + " ", text[cut + len(_GUANACO_ASSISTANT) :].strip()
    return {"prompt": prompt, "completion": completion}


def _sql(row: dict[str, Any], where: str) -> dict[str, str]:
    context, question = _text(row, "context", where), _text(row, "question", where)
    prompt = (
        "Write an SQL query that answers the question, using this schema.\n\n"
        f"### Schema:\n{context}\n\n### Question:\n{question}\n\n### SQL:\n"
    )
    return {"prompt": prompt, "completion": _text(row, "answer", where)}


def _orca_math(row: dict[str, Any], where: str) -> dict[str, str]:
    return {"prompt": f"Question: {_text(row, 'question', where)}\nAnswer: ", "completion": _text(row, "answer", where)}


_DUMMY_TEXT = (
    "the of and to in is was for on that with as by at from his it an were are which this be or has had not "
    "but first one their its new after who they have her she two been other when there all during into school "
    "time may years more most only over city some world would where later up such used many can state about "
    "national out known university united then made"
)


class _Dummy:
    """Synthetic long alpaca rows for memory tests: the same every call, so runs (and ranks) agree without a hub."""

    synthetic = True
    ROWS = 512
    WORDS_PER_ROW = 3000  # > 2048 tokens with any common tokenizer, so every row fills a 2048 context

    def identity(self, name: str) -> dict[str, Any]:
        return {"synthetic": name, "rows": self.ROWS, "words": self.WORDS_PER_ROW, "version": 1}

    def rows(self, name: str, *, samples: int, streaming: bool) -> Iterator[Located]:
        rng, vocab = random.Random(0), _DUMMY_TEXT.split()
        for i in range(1, min(samples or self.ROWS, self.ROWS) + 1):
            text = " ".join(rng.choices(vocab, k=self.WORDS_PER_ROW))
            yield f"{name} row {i}", {"instruction": "Continue the text.", "output": text}


NAMED_DATASETS: dict[str, Any] = {
    "alpaca": _Hub("yahma/alpaca-cleaned", "train"),
    "alpaca_sample": _Hub("yahma/alpaca-cleaned", "train", limit=128),
    "guanaco": _Hub("timdettmers/openassistant-guanaco", "train", _guanaco),
    "sql": _Hub("knowrohit07/know_sql", "validation", _sql),  # know_sql ships only a "validation" split
    "orca_math": _Hub("microsoft/orca-math-word-problems-200k", "train", _orca_math),
    "dummy": _Dummy(),
}
DATASET_NAMES = tuple(NAMED_DATASETS)


def _local_path(name: str) -> str:
    """The file a non-named source names, or a one-line UserError saying why it is not one."""
    path = os.path.expanduser(name)
    if not (path.lower().endswith(LOCAL_SUFFIXES) or os.path.exists(path)):
        raise UserError(
            f"unknown dataset {name!r}; valid names: {', '.join(DATASET_NAMES)}, or a local "
            f"{'/'.join(LOCAL_SUFFIXES)} file in alpaca, chat, text or prompt/completion format "
            "(several: comma-separated)"
        )
    if not os.path.isfile(path):
        raise UserError(f"--dataset {name}: {'not a file' if os.path.exists(path) else 'no such file'}")
    if not path.lower().endswith(LOCAL_SUFFIXES):
        raise UserError(f"--dataset {name}: unsupported file type; use {', '.join(LOCAL_SUFFIXES)}")
    return path


def source_root(name: str) -> Path | None:
    """The directory a local file's relative image paths start from (None for a named dataset)."""
    return None if name in NAMED_DATASETS else Path(_local_path(name)).resolve().parent


def check_source(name: str) -> None:
    """A one-line UserError now for a source that names no dataset or file (a hub dataset is checked when read)."""
    if name not in NAMED_DATASETS:
        _local_path(name)


def synthetic(dataset: str) -> bool:
    """Whether every source of `dataset` is generated here (nothing read, so nothing worth caching on disk)."""
    return all(getattr(NAMED_DATASETS.get(name), "synthetic", False) for name in source_names(dataset))


def source_identity(name: str) -> dict[str, Any]:
    """What decides a source's rows, for the cache key: a file's path, size and modification time; a hub
    dataset's repository, split and datasets' fingerprint of its files; a synthetic one's parameters."""
    named = NAMED_DATASETS.get(name)
    if named is not None:
        return named.identity(name)
    path = _local_path(name)
    stat = os.stat(path)
    return {"path": os.path.abspath(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def read_rows(name: str, *, samples: int = 0, streaming: bool = False) -> Iterator[Located]:
    """(location, row) of one source in order, the first `samples` only (0: all); rows past them are never read.

    Local files are always read as they go; `streaming` reads a hub dataset so too, instead of through datasets'
    local copy of it.
    """
    named = NAMED_DATASETS.get(name)
    if named is not None:
        yield from named.rows(name, samples=samples, streaming=streaming)
        return
    path = _local_path(name)
    for count, item in enumerate(_LOCAL_READERS[os.path.splitext(path)[1].lower()](path), start=1):
        yield item
        if samples and count >= samples:
            return
