"""The tokenized cache: every sample of a dataset, tokenized once into memory-mapped Arrow and shared.

Built with `datasets` (`Dataset.from_generator` reads and validates the rows, `map` tokenizes them over
--dataset_num_proc processes) under a key that fingerprints everything deciding the rows: the sources (a file's
path, size and mtime; a hub dataset's fingerprint), the tokenizer and its chat template, the prompt style and the
flags that cut or mask samples. A build is written beside its final place and renamed into it, under a file lock:
concurrent builders (the nodes of a job on a shared disk, two jobs) wait for one build and reuse it, and a killed
build leaves only a directory the next builder removes.

`tokenize_in_memory` makes the same rows in this process without `datasets`, writing nothing: the synthetic
dataset always, every dataset with --dataset_in_memory (the GPU machine has no `datasets`).

Each cache row is one sample as it will be trained (at most --context_length tokens): input_ids, labels and its
length, with the example it came from. A preference pair's row holds both sides (its rejected side in
rejected_input_ids and rejected_labels; its length is both together). Rows with nothing to learn are kept with
length 0 (so the counts in the log come from the cache itself) and never served. Packing and padding happen when
rows are read (rows.py), so a packed and an unpacked run share one cache.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qlora_fsdp.data.formats import (
    RECORD_COLUMNS,
    Labelled,
    Sample,
    encode_examples,
    examples_of,
    from_record,
    learned_tokens,
    special_prefix,
)
from qlora_fsdp.data.images import ImageInputs
from qlora_fsdp.data.rows import FitStats, fit_pair, fit_sample
from qlora_fsdp.data.sources import read_rows, source_identity, source_names, source_root
from qlora_fsdp.errors import UserError

logger = logging.getLogger(__name__)

CACHE_VERSION = 4
"""Part of every key: raise it when encoding changes what a cached row holds."""
_CUT = {"whole": 0, "truncated": 1, "split": 2, "no_reply": 3, "identical": 4, "empty": 5, "images_too_long": 6}
"""How a row's sample was cut; "no_reply": a conversation without an assistant turn to learn (nothing to cut);
"identical" and "empty": a preference pair dropped for its replies; "images_too_long": a row with images longer than
the context, dropped (cutting it could cut an image's tokens short)."""
PREFERENCE = "preference"
"""CacheSpec.objective of every preference objective: they all read the same pairs."""
UNPAIRED = "unpaired"
"""CacheSpec.objective of KTO: completions labelled desirable or not, each stored as a pair's one side (the chosen
side for a desirable completion, the rejected side for an undesirable one; the other side empty)."""


@dataclass(frozen=True)
class CacheSpec:
    """What decides a dataset's cached rows, besides the tokenizer (flag names as the CLI's)."""

    dataset: str
    dataset_samples: int
    prompt_style: str
    context_length: int
    packing_split: bool
    train_on_inputs: bool
    objective: str = "sft"
    """The kind of rows: "sft", PREFERENCE for pairs or UNPAIRED for labelled completions."""
    max_prompt_length: int = 0

    @property
    def pairs(self) -> bool:
        """Whether a row is stored as two sides."""
        return self.objective != "sft"


def default_cache_dir() -> Path:
    """Inside datasets' cache home (HF_HOME / HF_DATASETS_CACHE), so later runs and other jobs find it."""
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE) / "qlora-fsdp-tokenized"


def tokenizer_identity(tokenizer: Any) -> str:
    """A digest of what the tokenizer turns text into: its whole model and rules, specials and chat template."""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    facts = [
        type(tokenizer).__name__,
        getattr(tokenizer, "chat_template", None) or "",
        tokenizer.eos_token_id,
        special_prefix(tokenizer),
        list(tokenizer.all_special_tokens),
    ]
    digest.update(json.dumps(facts, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def cache_key(spec: CacheSpec, tokenizer: Any, images: ImageInputs | None = None) -> tuple[str, dict[str, Any]]:
    """(key, what it fingerprints): the same key means the same rows (an image's tokens depend on the processor)."""
    from importlib.metadata import version

    flags = {k: v for k, v in asdict(spec).items() if k != "dataset"}  # the sources stand for it, by absolute path
    what = {
        "version": CACHE_VERSION,
        **flags,
        "sources": [source_identity(name) for name in source_names(spec.dataset)],
        "tokenizer": tokenizer_identity(tokenizer),
        "images": images.identity() if images is not None else None,
        # They decide how text becomes tokens and how a chat template renders.
        "libraries": {lib: version(lib) for lib in ("tokenizers", "transformers", "jinja2")},
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24], what


# ---------------------------------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------------------------------


def _records(names: tuple[str, ...], samples: int, prompt_style: str, kind: str) -> Iterator[dict[str, Any]]:
    """Every example of the sources, validated as it is read, with its source and its index over all sources."""
    index = 0
    for source, name in enumerate(names):
        first = index
        rows = read_rows(name, samples=samples)
        for record in examples_of(rows, prompt_style=prompt_style, kind=kind, root=source_root(name)):
            yield {**record, "source": source, "source_row": index}
            index += 1
        if index == first:
            raise UserError(f"--dataset {name}: no rows to train on")


_ROW_COLUMNS = ("input_ids", "labels", "rejected_input_ids", "rejected_labels", "length", "label_tokens", "source",
                "source_row", "cut", "images")  # fmt: skip


def _encode(
    batch: dict[str, list[Any]], tokenizer: Any, spec: CacheSpec, images: ImageInputs | None = None
) -> dict[str, list[Any]]:
    """datasets.map's function: a batch of examples -> their samples (pieces), dropped ones with length 0."""
    examples = [from_record({k: batch[k][i] for k in RECORD_COLUMNS}) for i in range(len(batch["where"]))]
    out: dict[str, list[Any]] = {k: [] for k in _ROW_COLUMNS}
    if spec.objective == UNPAIRED:
        _encode_unpaired(examples, batch, tokenizer, spec, out)
        return out
    if spec.pairs:
        _encode_pairs(examples, batch, tokenizer, spec, out, images)
        return out
    encoded = encode_examples(examples, tokenizer, train_on_inputs=spec.train_on_inputs, images=images)
    for i, sample in enumerate(encoded):
        paths = list(getattr(examples[i], "images", ()))
        if paths and len(sample[0]) > spec.context_length:
            _append(out, batch, i, ([], []), ([], []), "images_too_long", paths)  # its images still key the cache
            continue
        kept, how, dropped = fit_sample(sample, spec.context_length, split=spec.packing_split)
        how = how if sample[0] else "no_reply"
        pieces: list[Sample] = [*kept, *[([], [])] * dropped]
        for ids, labels in pieces:
            _append(out, batch, i, (ids, labels), ([], []), how, paths)
    return out


def _append(out: dict[str, list[Any]], batch: dict[str, list[Any]], i: int, sample: Sample, rejected: Sample,
            how: str, images: list[str] | None = None) -> None:  # fmt: skip
    out["input_ids"].append(sample[0])
    out["labels"].append(sample[1])
    out["rejected_input_ids"].append(rejected[0])
    out["rejected_labels"].append(rejected[1])
    out["length"].append(len(sample[0]) + len(rejected[0]))
    out["label_tokens"].append(learned_tokens(sample[1]) + learned_tokens(rejected[1]))
    out["source"].append(batch["source"][i])
    out["source_row"].append(batch["source_row"][i])
    out["cut"].append(_CUT[how])
    out["images"].append(images or [])


def _encode_pairs(examples: list[Any], batch: dict[str, list[Any]], tokenizer: Any, spec: CacheSpec,
                  out: dict[str, list[Any]], images: ImageInputs | None = None) -> None:  # fmt: skip
    """Each pair's sides fitted together (rows.fit_pair); a pair with an empty or repeated reply, or a side left
    with nothing to learn, is a row of length 0, and so is a pair with images that fitting would cut."""
    sides = [side for pair in examples for side in (pair.chosen, pair.rejected)]
    encoded = encode_examples(sides, tokenizer, train_on_inputs=False, images=images)
    prefix = special_prefix(tokenizer)
    for i, pair in enumerate(examples):
        chosen, rejected = encoded[2 * i], encoded[2 * i + 1]
        defect = pair.defect() or ("no_reply" if not (chosen[0] and rejected[0]) else None)
        if defect is not None:
            _append(out, batch, i, ([], []), ([], []), defect)
            continue
        head = len(prefix) if chosen[0][: len(prefix)] == prefix else 0
        chosen, rejected, how = fit_pair(chosen, rejected, spec.context_length,
                                         max_prompt_length=spec.max_prompt_length, keep_head=head)  # fmt: skip
        paths = list(getattr(pair.chosen, "images", ()))
        if paths and how != "whole":
            _append(out, batch, i, ([], []), ([], []), "images_too_long", paths)  # its images still key the cache
            continue
        if not (learned_tokens(chosen[1]) and learned_tokens(rejected[1])):
            chosen = rejected = ([], [])
        _append(out, batch, i, chosen, rejected, how, paths)


def _encode_unpaired(examples: list[Labelled], batch: dict[str, list[Any]], tokenizer: Any, spec: CacheSpec,
                     out: dict[str, list[Any]]) -> None:  # fmt: skip
    """Each completion fitted as a pair's side is (its prompt cut from the left, --max_prompt_length), stored on the
    chosen side if desirable, else on the rejected side; one left with nothing to learn is a row of length 0."""
    encoded = encode_examples([e.example for e in examples], tokenizer, train_on_inputs=False)
    prefix = special_prefix(tokenizer)
    for i, (example, sample) in enumerate(zip(examples, encoded, strict=True)):
        if not sample[0]:
            _append(out, batch, i, ([], []), ([], []), "no_reply")
            continue
        head = len(prefix) if sample[0][: len(prefix)] == prefix else 0
        sample, _, how = fit_pair(sample, sample, spec.context_length, max_prompt_length=spec.max_prompt_length,
                                  keep_head=head)  # fmt: skip
        if not learned_tokens(sample[1]):
            sample = ([], [])
        sides = (sample, ([], [])) if example.desirable else (([], []), sample)
        _append(out, batch, i, *sides, how)


def _auto_procs(rows: int) -> int:
    """One process per ~5,000 examples, at most the CPUs (and 16): small datasets skip the pool's start-up."""
    return max(1, min(os.cpu_count() or 1, 16, rows // 5000))


def _build(spec: CacheSpec, tokenizer: Any, images: ImageInputs | None, work: Path, num_proc: int) -> dict[str, Any]:
    """Tokenize into `work`/rows; returns the summary written beside them."""
    import datasets
    from datasets.exceptions import DatasetGenerationError

    names = source_names(spec.dataset)
    started = time.perf_counter()
    record_features = datasets.Features(
        {
            **{k: datasets.Value("string") for k in RECORD_COLUMNS},
            "source": datasets.Value("int32"),
            "source_row": datasets.Value("int64"),
        }
    )
    try:
        records = datasets.Dataset.from_generator(
            _records,
            features=record_features,
            cache_dir=str(work / "read"),
            # A tuple: datasets splits list arguments into shards, one generator call per source.
            gen_kwargs={
                "names": tuple(names),
                "samples": spec.dataset_samples,
                "prompt_style": spec.prompt_style,
                "kind": spec.objective,
            },
        )
    except DatasetGenerationError as exc:
        if isinstance(exc.__cause__, UserError):
            raise exc.__cause__ from None
        raise
    procs = num_proc or _auto_procs(len(records))
    if procs > 1:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the pool's processes tokenize in parallel
    row_features = datasets.Features(
        {
            **{k: datasets.Sequence(datasets.Value("int32")) for k in _ROW_COLUMNS[:4]},
            **{k: datasets.Value("int32") for k in ("length", "label_tokens", "source")},
            "source_row": datasets.Value("int64"),
            "cut": datasets.Value("int8"),
            "images": datasets.Sequence(datasets.Value("string")),
        }
    )
    (work / "encoded").mkdir()
    rows = records.map(
        _encode,
        batched=True,
        batch_size=256,
        num_proc=procs if procs > 1 else None,
        remove_columns=records.column_names,
        features=row_features,
        fn_kwargs={"tokenizer": tokenizer, "spec": spec, "images": images},
        cache_file_name=str(work / "encoded" / "rows.arrow"),
        new_fingerprint=work.name,
    )
    rows.save_to_disk(str(work / "rows"))
    per_source = np.bincount(np.asarray(records.data.column("source")), minlength=len(names))
    summary = {
        "sources": dict(zip(names, per_source.tolist(), strict=True)),
        "examples": len(records),
        "pairs": spec.pairs,
        "kind": spec.objective,
        "images": images_identity(rows),
        **asdict(_stats(_counts(rows), len(records))),
        "bytes": sum(f.stat().st_size for f in (work / "rows").rglob("*") if f.is_file()),
        "build_s": round(time.perf_counter() - started, 2),
        "processes": procs,
    }
    del rows, records
    shutil.rmtree(work / "read", ignore_errors=True)
    shutil.rmtree(work / "encoded", ignore_errors=True)
    return summary


def images_identity(rows: Any) -> str | None:
    """A digest of every image the rows hold (path, size, modification time), None without images: the cache is
    keyed by its rows' sources, and a row's image tokens also depend on its image files."""
    paths = sorted({path for paths in rows.data.column("images").to_pylist() for path in paths or ()})
    if not paths:
        return None
    stats = [(path, *_stat(path)) for path in paths]
    return hashlib.sha256(json.dumps(stats).encode()).hexdigest()


def _stat(path: str) -> tuple[int, int]:
    try:
        info = os.stat(path)
    except OSError:
        return (-1, -1)
    return info.st_size, info.st_mtime_ns


def _current(final: Path) -> bool:
    """Whether a complete cache at `final` still describes its image files (a cache without images always does)."""
    if not (final / "summary.json").is_file():
        return False
    recorded = json.loads((final / "summary.json").read_text()).get("images")
    if recorded is None:
        return True
    import datasets

    if images_identity(datasets.load_from_disk(str(final / "rows"))) == recorded:
        return True
    logger.info("the images of the tokenized cache %s changed since it was built: building it again", final)
    return False


_COUNTS = ("length", "label_tokens", "source_row", "cut")
"""The per-row numbers the statistics need, held as arrays whatever holds the token lists."""


def _counts(rows: Any) -> dict[str, np.ndarray]:
    return {name: rows.data.column(name).to_numpy() for name in _COUNTS}


def _stats(counts: dict[str, np.ndarray], examples: int, keep: np.ndarray | None = None) -> FitStats:
    """FitStats of the cache's rows whose example is in `keep` (a boolean mask over examples; None: all)."""
    length, cut, origin, label_tokens = (counts[k] for k in ("length", "cut", "source_row", "label_tokens"))
    chosen = np.ones(len(length), dtype=bool) if keep is None else keep[origin]
    valid = chosen & (length > 0)
    return FitStats(
        rows=examples if keep is None else int(keep.sum()),
        truncated=int((chosen & (cut == _CUT["truncated"])).sum()),
        split=len(np.unique(origin[chosen & (cut == _CUT["split"])])),
        dropped=int((chosen & (length == 0)).sum()),
        samples=int(valid.sum()),
        tokens=int(length[valid].sum()),
        label_tokens=int(label_tokens[valid].sum()),
        identical=int((chosen & (cut == _CUT["identical"])).sum()),
        empty=int((chosen & (cut == _CUT["empty"])).sum()),
        images_too_long=int((chosen & (cut == _CUT["images_too_long"])).sum()),
    )


# ---------------------------------------------------------------------------------------------------------------
# Opening
# ---------------------------------------------------------------------------------------------------------------


class Samples(Sequence):
    """The cache's (input_ids, labels) by row index, a pair's ((chosen ids, labels), (rejected ids, labels)) with
    `pairs`. `rows[i]` is a row's dict: read from the memory-mapped Arrow files as it is asked for (`arrow_samples`),
    or held in memory (tokenize_in_memory)."""

    def __init__(self, rows: Sequence[dict[str, Any]], *, pairs: bool = False) -> None:
        self.pairs = pairs
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> Any:
        row = self._rows[index]
        sample = row["input_ids"], row["labels"]
        return (sample, (row["rejected_input_ids"], row["rejected_labels"])) if self.pairs else sample

    def images(self, index: int) -> list[str]:
        """The paths of the images a sample's image tokens stand for, in order."""
        return list(self._rows[index]["images"] or [])


def _sample_columns(pairs: bool) -> list[str]:
    return [*_ROW_COLUMNS[: 4 if pairs else 2], "images"]


def arrow_samples(rows: Any, *, pairs: bool) -> Samples:
    """The samples of a datasets.Dataset of cache rows, read only when asked for."""
    return Samples(rows.select_columns(_sample_columns(pairs)), pairs=pairs)


@dataclass
class TokenizedCache:
    """An opened cache (or rows tokenized in memory): its samples, their lengths and examples, and what its build
    counted."""

    path: Path | None
    """None: held in memory, nothing on disk."""
    samples: Samples
    counts: dict[str, np.ndarray]
    """Per row: length, label_tokens, source_row, cut."""
    summary: dict[str, Any]

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per row (0: nothing to learn, never served)."""
        return self.counts["length"]

    @property
    def origin(self) -> np.ndarray:
        """The example (index over all sources) each row came from."""
        return self.counts["source_row"]

    @property
    def examples(self) -> int:
        return int(self.summary["examples"])

    @property
    def kind(self) -> str:
        """The kind of rows (CacheSpec.objective)."""
        return self.summary["kind"]

    def stats(self, keep: np.ndarray | None = None) -> FitStats:
        return _stats(self.counts, self.examples, keep)

    def all_without_reply(self, indices: np.ndarray) -> bool:
        """Whether every row at `indices` is a conversation with no assistant turn (for the all-dropped error)."""
        return bool((self.counts["cut"][indices] == _CUT["no_reply"]).all())

    def describe(self, built: bool) -> str:
        s = self.summary
        origin = ", ".join(f"{name}: {n}" for name, n in s["sources"].items())
        rows = f"{s['examples']} examples ({origin}), {s['samples']} samples, {s['tokens']} tokens"
        if self.path is None:
            return f"tokenized in memory in {s['build_s']} s: {rows}"
        how = f"built in {s['build_s']} s with {s['processes']} process(es)" if built else "reused"
        return f"tokenized cache {how} at {self.path}: {rows}, {s['bytes'] / 2**20:.1f} MiB"


def _load(path: Path) -> TokenizedCache:
    import datasets

    rows = datasets.load_from_disk(str(path / "rows"))
    summary = json.loads((path / "summary.json").read_text())
    return TokenizedCache(path, arrow_samples(rows, pairs=summary.get("pairs", False)), _counts(rows), summary)


def tokenize_in_memory(
    spec: CacheSpec, tokenizer: Any, images: ImageInputs | None = None, *, batch_size: int = 256
) -> TokenizedCache:
    """The rows a cache of `spec` would hold, tokenized in this process by the same encoding and held in memory."""
    started = time.perf_counter()
    names = tuple(source_names(spec.dataset))
    columns: dict[str, list[Any]] = {k: [] for k in _ROW_COLUMNS}
    per_source = [0] * len(names)
    records = _records(names, spec.dataset_samples, spec.prompt_style, spec.objective)
    while chunk := list(itertools.islice(records, batch_size)):
        for record in chunk:
            per_source[record["source"]] += 1
        encoded = _encode({k: [r[k] for r in chunk] for k in chunk[0]}, tokenizer, spec, images)
        for k, values in encoded.items():
            columns[k] += values
    counts = {k: np.asarray(columns.pop(k), dtype=np.int64) for k in _COUNTS}
    examples = sum(per_source)
    summary = {
        "sources": dict(zip(names, per_source, strict=True)),
        "examples": examples,
        "pairs": spec.pairs,
        "kind": spec.objective,
        **asdict(_stats(counts, examples)),
        "build_s": round(time.perf_counter() - started, 2),
    }
    kept = _sample_columns(spec.pairs)
    rows = [dict(zip(kept, values, strict=True)) for values in zip(*(columns[k] for k in kept), strict=True)]
    return TokenizedCache(None, Samples(rows, pairs=spec.pairs), counts, summary)


def _stale(build: Path, *, max_age_s: float = 24 * 3600) -> bool:
    """Whether a `KEY.tmp-HOST-PID` build was abandoned: its process is gone (same host), or it is a day old (a
    lock that a shared filesystem does not honour must not let one node delete another's build in progress)."""
    host, _, pid = build.name.rpartition(".tmp-")[2].rpartition("-")
    if host == socket.gethostname() and pid.isdigit():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    return time.time() - build.stat().st_mtime > max_age_s


def _cache_dir_error(root: Path, exc: OSError | NotImplementedError) -> UserError:
    reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return UserError(f"--dataset_cache_dir {root}: cannot build the tokenized cache there ({reason}); pass a "
                     "writable directory on a filesystem with file locks")  # fmt: skip


def open_cache(
    spec: CacheSpec, tokenizer: Any, images: ImageInputs | None = None, *, cache_dir: str | Path = "", num_proc: int = 0
) -> tuple[TokenizedCache, bool]:
    """The cache for `spec` and this tokenizer (and image processor), built here if no one has built it: (cache,
    built here)."""
    from filelock import FileLock, Timeout

    key, what = cache_key(spec, tokenizer, images)
    root = Path(cache_dir or default_cache_dir()).expanduser()
    final = root / key
    if _current(final):  # complete (renamed into place whole): no lock needed to read it
        return _load(final), False
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(root / f"{key}.lock"))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            logger.info("waiting for another process building the tokenized cache %s", final)
            lock.acquire()
    except (OSError, NotImplementedError) as exc:
        raise _cache_dir_error(root, exc) from None
    try:
        if _current(final):
            return _load(final), False
        for stale in root.glob(f"{key}.tmp-*"):
            if _stale(stale):
                shutil.rmtree(stale, ignore_errors=True)
        # Never complete (no summary.json), or its images changed: rebuilt under the lock every builder takes.
        shutil.rmtree(final, ignore_errors=True)
        return _build_aside(spec, tokenizer, images, root, key, what, num_proc)
    finally:
        lock.release()


def _build_aside(
    spec: CacheSpec,
    tokenizer: Any,
    images: ImageInputs | None,
    root: Path,
    key: str,
    what: dict[str, Any],
    num_proc: int,
) -> tuple[TokenizedCache, bool]:
    """Build in KEY.tmp-HOST-PID and rename it into place when whole."""
    import datasets

    final = root / key
    work = root / f"{key}.tmp-{socket.gethostname()}-{os.getpid()}"
    try:
        work.mkdir()
    except OSError as exc:
        raise _cache_dir_error(root, exc) from None
    progress = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        summary = _build(spec, tokenizer, images, work, num_proc)
        (work / "spec.json").write_text(json.dumps(what, indent=1, sort_keys=True))
        (work / "summary.json").write_text(json.dumps(summary, indent=1))
        os.replace(work, final)
    except OSError as exc:
        shutil.rmtree(work, ignore_errors=True)
        if not (final / "summary.json").is_file():
            raise _cache_dir_error(root, exc) from None
        return _load(final), False  # another builder finished first (a lock the filesystem did not honour)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        if progress:
            datasets.enable_progress_bars()
    return _load(final), True
