"""The tokenized cache (qlora_fsdp/data/cache.py): what it holds, when it is reused and rebuilt, and builders
that run at once or die mid-build."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from qlora_fsdp.data.cache import PREFERENCE, UNPAIRED, CacheSpec, cache_key, open_cache, tokenize_in_memory
from qlora_fsdp.data.formats import load_examples
from qlora_fsdp.data.rows import fit_examples
from qlora_fsdp.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[3]
ALPACA = REPO_ROOT / "data" / "alpaca_tiny.jsonl"


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    return AutoTokenizer.from_pretrained(tiny_model)


def _spec(dataset: Path | str, **changes) -> CacheSpec:
    base = CacheSpec(dataset=str(dataset), dataset_samples=0, prompt_style="alpaca", context_length=64,
                     packing_split=False, train_on_inputs=False)  # fmt: skip
    return dataclasses.replace(base, **changes)


def _copy(tmp_path: Path, rows: int = 0) -> Path:
    lines = ALPACA.read_text().splitlines(keepends=True)
    path = tmp_path / "data.jsonl"
    path.write_text("".join(lines[: rows or None]))
    return path


@pytest.mark.parametrize("num_proc", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_cached_samples_are_the_in_memory_ones(tmp_path: Path, tokenizer, num_proc: int) -> None:
    """Through datasets.map, in one process or two, the rows are exactly fit_examples' samples, in order, with the
    same counts (context 64 truncates some alpaca rows and drops a few whose prompt fills it)."""
    spec = _spec(ALPACA)
    cache, built = open_cache(spec, tokenizer, cache_dir=tmp_path, num_proc=num_proc)
    assert built
    expected, stats = fit_examples(load_examples(str(ALPACA)), tokenizer, context_length=64, train_on_inputs=False)
    assert stats.truncated > 0 and stats.dropped > 0  # the case this test is about
    served = [cache.samples[i] for i in range(len(cache.samples)) if cache.lengths[i] > 0]
    assert served == expected
    assert cache.stats() == stats
    assert cache.summary["processes"] == num_proc


@pytest.mark.parametrize(
    ("dataset", "changes"),
    [("alpaca_tiny.jsonl", {}), ("preference_tiny.jsonl", {"objective": PREFERENCE, "max_prompt_length": 24}),
     ("kto_tiny.jsonl", {"objective": UNPAIRED, "max_prompt_length": 12})],
    ids=["sft", "pairs", "unpaired"],
)
def test_rows_tokenized_in_memory_are_the_cached_rows(tmp_path: Path, tokenizer, monkeypatch, dataset: str,
                                                       changes: dict) -> None:  # fmt: skip
    """--dataset_in_memory: the same samples, counts and statistics as the Arrow cache, and `datasets` never
    imported (the GPU machine has none)."""
    spec = _spec(REPO_ROOT / "data" / dataset, **changes)
    cached, _ = open_cache(spec, tokenizer, cache_dir=tmp_path)
    monkeypatch.setitem(sys.modules, "datasets", None)  # an import of it now raises ImportError
    held = tokenize_in_memory(spec, tokenizer, batch_size=7)  # batches that do not divide the rows
    assert held.path is None and len(held.samples) == len(cached.samples) > 0
    assert [held.samples[i] for i in range(len(held.samples))] == [cached.samples[i] for i in range(len(held.samples))]
    for name, values in cached.counts.items():
        assert held.counts[name].tolist() == values.tolist(), name
    assert held.stats() == cached.stats() and held.examples == cached.examples
    assert "tokenized in memory" in held.describe(True)


def test_a_second_open_reuses_the_cache(tmp_path: Path, tokenizer) -> None:
    first, built = open_cache(_spec(ALPACA), tokenizer, cache_dir=tmp_path)
    again, rebuilt = open_cache(_spec(ALPACA), tokenizer, cache_dir=tmp_path)
    assert (built, rebuilt) == (True, False)
    assert again.path == first.path
    assert "reused" in again.describe(rebuilt) and "built in" in first.describe(built)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == [first.path.name]


def _rebuilds(tmp_path: Path, tokenizer, change) -> bool:
    """Whether `change` (of the data file, the tokenizer or the spec) makes open_cache build a new cache."""
    path = _copy(tmp_path)
    spec = _spec(path)
    before, _ = open_cache(spec, tokenizer, cache_dir=tmp_path / "cache")
    spec, tokenizer = change(path, spec, tokenizer)
    after, built = open_cache(spec, tokenizer, cache_dir=tmp_path / "cache")
    assert built == (after.path != before.path)
    return built


def _edit_file(path: Path, spec: CacheSpec, tok):
    rows = path.read_text().splitlines(keepends=True)
    path.write_text("".join([rows[1], rows[0], *rows[2:]]))  # the same size: only the content and mtime change
    return spec, tok


def _other_tokenizer(path: Path, spec: CacheSpec, tok):
    other = AutoTokenizer.from_pretrained(tok.name_or_path)
    other.add_tokens(["qlorafsdpnewtoken"])
    return spec, other


def _other_template(path: Path, spec: CacheSpec, tok):
    other = AutoTokenizer.from_pretrained(tok.name_or_path)
    other.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return spec, other


CHANGES = {
    "data file": _edit_file,
    "tokenizer": _other_tokenizer,
    "chat template": _other_template,
    "prompt style": lambda p, s, t: (dataclasses.replace(s, prompt_style="qna"), t),
    "context length": lambda p, s, t: (dataclasses.replace(s, context_length=96), t),
    "train_on_inputs": lambda p, s, t: (dataclasses.replace(s, train_on_inputs=True), t),
    "packing_split": lambda p, s, t: (dataclasses.replace(s, packing_split=True), t),
    "dataset_samples": lambda p, s, t: (dataclasses.replace(s, dataset_samples=10), t),
}


@pytest.mark.parametrize("what", CHANGES)
def test_what_decides_the_rows_rebuilds_the_cache(tmp_path: Path, tokenizer, what: str) -> None:
    assert _rebuilds(tmp_path, tokenizer, CHANGES[what])


def test_the_kind_of_rows_rebuilds_the_cache(tmp_path: Path, tokenizer) -> None:
    """KTO's rows (prompt, completion, label) are also supervised prompt/completion rows: the same file read for
    --objective kto is another cache."""
    spec = _spec(REPO_ROOT / "data" / "kto_tiny.jsonl")
    sft, _ = open_cache(spec, tokenizer, cache_dir=tmp_path)
    kto, built = open_cache(dataclasses.replace(spec, objective=UNPAIRED), tokenizer, cache_dir=tmp_path)
    assert built and kto.path != sft.path and (sft.kind, kto.kind) == ("sft", UNPAIRED)


def test_an_untouched_file_and_the_same_flags_do_not_rebuild(tmp_path: Path, tokenizer) -> None:
    """The control of the test above: reopening with nothing changed (a fresh tokenizer object of the same files)."""
    assert not _rebuilds(tmp_path, tokenizer, lambda p, s, t: (s, AutoTokenizer.from_pretrained(t.name_or_path)))


def test_the_key_names_every_source_and_the_tokenizer(tmp_path: Path, tokenizer) -> None:
    path = _copy(tmp_path)
    _, what = cache_key(_spec(f"{path},{ALPACA}"), tokenizer)
    assert [s["path"] for s in what["sources"]] == [str(path), str(ALPACA)]
    assert {"size", "mtime_ns"} <= what["sources"][0].keys()
    assert len(what["tokenizer"]) == 64


def test_a_relative_and_an_absolute_path_are_one_source(tmp_path: Path, tokenizer, monkeypatch) -> None:
    path = _copy(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert cache_key(_spec("data.jsonl"), tokenizer)[0] == cache_key(_spec(path), tokenizer)[0]


def _open_in_process(model: str, spec: CacheSpec, cache_dir: str, start, out) -> None:
    tok = AutoTokenizer.from_pretrained(model)
    start.wait()
    cache, built = open_cache(spec, tok, cache_dir=cache_dir)
    out.put((built, str(cache.path), cache.summary["samples"]))


@pytest.mark.distributed
def test_two_builders_at_once_share_one_build(tmp_path: Path, tiny_model: Path) -> None:
    """Two processes (two jobs, or two nodes on one disk) released together: one builds, the other waits on the
    lock and reuses it; one cache directory, nothing half-written left."""
    big = tmp_path / "big.jsonl"
    big.write_text(ALPACA.read_text() * 10)  # 4,000 rows: a build long enough for the other to arrive during it
    spec = _spec(big)
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_open_in_process, args=(str(tiny_model), spec, str(tmp_path / "c"), start, out))
             for _ in range(2)]  # fmt: skip
    for p in procs:
        p.start()
    results = [out.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sorted(built for built, _, _ in results) == [False, True]
    assert len({path for _, path, _ in results}) == 1
    assert len({samples for _, _, samples in results}) == 1
    key = Path(results[0][1]).name
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [key, f"{key}.lock"]


def _build_forever(model: str, spec: CacheSpec, cache_dir: str) -> None:
    tok = AutoTokenizer.from_pretrained(model)
    open_cache(spec, tok, cache_dir=cache_dir)


@pytest.mark.distributed
def test_a_killed_build_leaves_no_cache_and_the_next_builds_a_whole_one(tmp_path: Path, tiny_model: Path) -> None:
    big = tmp_path / "big.jsonl"
    big.write_text(ALPACA.read_text() * 40)
    spec, cache_dir = _spec(big), tmp_path / "c"
    proc = mp.get_context("spawn").Process(target=_build_forever, args=(str(tiny_model), spec, str(cache_dir)))
    proc.start()
    deadline = time.monotonic() + 120
    while not any(".tmp-" in p.name for p in cache_dir.glob("*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # well inside the build (tens of seconds for 16,000 rows)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    leftovers = [p.name for p in cache_dir.iterdir() if not p.name.endswith(".lock")]
    assert leftovers and all(".tmp-" in name for name in leftovers)  # killed mid-build: only the build aside
    tok = AutoTokenizer.from_pretrained(tiny_model)
    cache, built = open_cache(spec, tok, cache_dir=cache_dir)
    assert built and cache.summary["examples"] == 16000
    assert [p.name for p in cache_dir.iterdir() if not p.name.endswith(".lock")] == [cache.path.name]


def test_a_malformed_row_fails_the_build_in_one_line_and_leaves_nothing(tmp_path: Path, tokenizer) -> None:
    path = _copy(tmp_path, rows=5)
    with path.open("a") as fh:
        fh.write(json.dumps({"instruction": "x", "output": 7}) + "\n")
    with pytest.raises(UserError, match=rf"^--dataset {path} row 6: field 'output' must be a string, got int"):
        open_cache(_spec(path), tokenizer, cache_dir=tmp_path / "c")
    assert [p.name for p in (tmp_path / "c").iterdir()] == [p.name for p in (tmp_path / "c").glob("*.lock")]


def test_an_unwritable_cache_dir_is_one_line(tmp_path: Path, tokenizer) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UserError, match=r"^--dataset_cache_dir .*: cannot build the tokenized cache there"):
        open_cache(_spec(ALPACA), tokenizer, cache_dir=blocker / "sub")
