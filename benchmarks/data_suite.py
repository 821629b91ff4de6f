"""The data suite (--suite cpu-data): the tokenized data path at scale, on a synthetic alpaca-like JSONL.

1. the first build of the tokenized cache (scripts/preprocess.py) with --dataset_num_proc 1 and 2;
2. the cached start: time to the first training step of a run that finds the cache against one that builds it;
3. per-rank peak RSS of 2-rank training on many rows against few rows of the same file;
4. tokens/s and padding of per-batch padding against --pad_to_context true.

Each measurement is a fresh process (or torchrun job) started through cpu_suite's Runner, which waits for a quiet
machine first and records the CPU other processes took meanwhile. `python -m benchmarks.data_suite first-step
...` is the wrapper that times a launch to its first metrics.jsonl record (see _first_step_main).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, base_env, read_json, run_metrics, write_json
from benchmarks.cpu_suite import (
    QUICK_MODEL,
    SIZE_KEYS,
    CpuPlan,
    LaunchSettings,
    Runner,
    ensure_model,
    launch_conditions,
    launches_markdown,
    model_record,
)
from benchmarks.report import render
from benchmarks.rows import row

GENERATOR_VERSION = 1
"""Part of the synthetic file's name: raise it when the generator changes what it writes."""
FIELD_TOKENS = (20, 400)
"""Each row's instruction + input + output hold a uniformly drawn number of tokens in this range (inclusive)."""
WORD_SOURCE = REPO_ROOT / "data" / "alpaca_tiny.jsonl"
"""The words rows are made of: those of the bundled data, which the tiny model's tokenizer was trained on."""
RSS_ROWS = (200_000, 2_000)
"""Item 3: training on this many rows of the file against this many (--dataset_samples)."""
RSS_BAR_BYTES = 300 * 10**6
"""Item 3's bar: the large run's per-rank peak may exceed the small run's by at most 300 MB."""
FIRST_STEP_BAR = 0.5
"""Item 2's bar: the cached run's time to the first step is at most this fraction of the building run's."""
CACHE_LINE = re.compile(
    r"tokenized cache (?:built in (?P<build_s>[\d.]+) s with (?P<procs>\d+) process\(es\)|(?P<reused>reused)) "
    r"at (?P<path>\S+?): (?P<examples>\d+) examples .*?, (?P<samples>\d+) samples, (?P<tokens>\d+) tokens, "
    r"(?P<mib>[\d.]+) MiB"
)


@dataclass
class DataPlan(LaunchSettings):
    """Sizes and repetitions of one data suite run."""

    rows: int
    """Rows of the synthetic file; items 1 and 2 read all of them."""
    rss_rows: tuple[int, int]
    """Item 3 (and 4, on the first): rows of the large and the small run."""
    build_reps: int
    """Repetitions of items 1 and 2 (each a whole cache build)."""
    train_reps: int
    """Repetitions of items 3 and 4."""
    context_length: int = 1024
    batch_size: int = 2
    """Per rank."""
    nproc: int = 2
    """Ranks of items 3 and 4."""
    build_procs: tuple[int, ...] = (1, 2)
    first_step_steps: int = 2
    """Item 2's --max_steps."""
    steps: int = 5
    """Items 3 and 4's --max_steps."""
    warmup_steps: int = 2
    """Item 4 measures the steps after these."""
    lora_rank: int = 16
    lora_alpha: float = 32.0
    retries: int = field(default=0, kw_only=True)
    """No re-measuring on contention: a build takes minutes; every launch's contention is recorded instead."""
    launch_timeout_s: float = field(default=3600.0, kw_only=True)
    seed: int = 0
    """The generator's seed."""


def plan(
    *,
    quick: bool,
    rows: int | None,
    threads: int,
    reps: int | None,
    idle_wait_s: float | None,
    precision: str | None = None,
) -> DataPlan:
    """The full suite (1,000,000 rows; items 3-4 on 200,000 against 2,000) or the quick one the test runs (2,000
    rows; 2,000 against 200)."""
    if quick:
        n = rows or 2_000
        p = DataPlan(n, (min(n, 2_000), max(8, min(n, 2_000) // 10)), build_reps=1, train_reps=1, quick=True)
        p.idle_wait_s, p.launch_timeout_s, p.steps, p.warmup_steps = 0.0, 300.0, 3, 1
    else:
        n = rows or 1_000_000
        p = DataPlan(n, (min(n, RSS_ROWS[0]), min(n // 10, RSS_ROWS[1])), build_reps=1, train_reps=3)
    if p.rss_rows[1] < p.nproc * p.batch_size:
        raise ValueError(f"--rows {n}: too few rows for a {p.nproc}-rank step of batch {p.batch_size}")
    p.set_launch(threads=threads, precision=precision, idle_wait_s=idle_wait_s)
    if reps is not None:
        p.build_reps = p.train_reps = reps
    return p


# ---------------------------------------------------------------------------------------------------------------
# The synthetic dataset
# ---------------------------------------------------------------------------------------------------------------


def _word_costs(tokenizer_file: Path) -> tuple[list[str], list[int], Any]:
    """The bundled data's words (sorted) and the tokens each costs after a space, by the model's own tokenizer."""
    from tokenizers import Tokenizer  # the Rust library alone: the harness stays without torch and transformers

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    words: set[str] = set()
    for line in WORD_SOURCE.read_text().splitlines():
        if line.strip():
            for value in json.loads(line).values():
                words.update(re.findall(r"[A-Za-z]+", str(value)))
    ordered = sorted(words)
    costs = [len(tokenizer.encode(" " + w, add_special_tokens=False).ids) for w in ordered]
    return ordered, costs, tokenizer


def synthetic_rows(n: int, words: list[str], costs: list[int], *, seed: int):
    """n alpaca rows: words drawn until the row's fields hold its drawn token count; the first fifth of the words
    is the instruction, half the rows get an input (the next third of the rest), the remainder is the output."""
    rng = random.Random(seed)
    low, high = FIELD_TOKENS
    for _ in range(n):
        target, chosen, total = rng.randint(low, high), [], 0
        while total < target:
            j = rng.randrange(len(words))
            chosen.append(words[j])
            total += costs[j]
        k = max(1, len(chosen) // 5)
        m = k + (len(chosen) - k) // 3 if rng.random() < 0.5 else k
        yield {"instruction": " ".join(chosen[:k]), "input": " ".join(chosen[k:m]),
               "output": " ".join(chosen[m:]) or chosen[-1]}  # fmt: skip


def ensure_dataset(plan: DataPlan, model: Path, cache: Path, log: Callable[[str], None]) -> tuple[Path, dict]:
    """The synthetic JSONL for the plan's rows, written once under `cache` (deterministic: the seed, the bundled
    words and the model's tokenizer decide it), and what its first rows' fields measure in tokens."""
    words, costs, tokenizer = _word_costs(model / "tokenizer.json")
    import hashlib

    digest = hashlib.sha256((model / "tokenizer.json").read_bytes()).hexdigest()[:10]
    path = cache / "data" / f"synthetic-alpaca-v{GENERATOR_VERSION}-seed{plan.seed}-tok{digest}-{plan.rows}.jsonl"
    written_s = 0.0
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as fh:
            for item in synthetic_rows(plan.rows, words, costs, seed=plan.seed):
                fh.write(json.dumps(item) + "\n")
        tmp.replace(path)
        written_s = time.perf_counter() - started
        log(f"wrote {plan.rows} synthetic rows to {path} in {written_s:.0f} s")
    # The fields' real token counts (each field tokenized alone, as the prompt template frames it) on a sample.
    sample = []
    with open(path, encoding="utf-8") as fh:
        for _, line in zip(range(2000), fh, strict=False):
            item = json.loads(line)
            sample.append(sum(len(tokenizer.encode(v, add_special_tokens=False).ids) for v in item.values() if v))
    info = {
        "path": str(path),
        "rows": plan.rows,
        "bytes": path.stat().st_size,
        "written_s": round(written_s, 1),
        "generator": f"v{GENERATOR_VERSION}, seed {plan.seed}, field tokens uniform in {FIELD_TOKENS}",
        "field_tokens_first_2000": {
            "min": min(sample),
            "median": statistics.median(sample),
            "max": max(sample),
            "mean": round(statistics.fmean(sample), 1),
        },
    }
    return path, info


# ---------------------------------------------------------------------------------------------------------------
# Time to the first step: a wrapper around the launched command
# ---------------------------------------------------------------------------------------------------------------


def _boot_clock() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def _process_start() -> float:
    """When this process was started, on the boot clock (/proc/self/stat's starttime, in clock ticks)."""
    with open("/proc/self/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _first_step_main(argv: list[str]) -> int:
    """`first-step RESULT METRICS -- CMD...`: run CMD, poll METRICS every 20 ms, write to RESULT how long after this
    process started (the launch, to a clock tick) the first record appeared, and exit with CMD's status.

    metrics.jsonl is opened empty when training starts and gets one line-buffered record per optimizer step, so its
    first non-empty size is the end of step 1.
    """
    result, metrics, sep, *cmd = argv
    if sep != "--" or not cmd:
        raise SystemExit("usage: python -m benchmarks.data_suite first-step RESULT METRICS -- CMD...")
    started = _process_start()
    metrics_path = Path(metrics)
    proc = subprocess.Popen(cmd)
    first = None
    while proc.poll() is None:
        if first is None and metrics_path.is_file() and metrics_path.stat().st_size > 0:
            first = _boot_clock() - started
        time.sleep(0.02)
    if first is None and metrics_path.is_file() and metrics_path.stat().st_size > 0:
        first = _boot_clock() - started  # written in the last 20 ms: an upper bound
    write_json(result, {"first_step_s": first, "exit_s": _boot_clock() - started})
    code = proc.returncode
    return code if code >= 0 else 128 - code


# ---------------------------------------------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------------------------------------------


def _env(threads: int) -> dict[str, str]:
    """base_env, but with the tokenizer's own thread default: the package sets TOKENIZERS_PARALLELISM=false itself
    when it tokenizes in a process pool (cache.py), and a user's one-process build runs with the library default."""
    env = base_env(threads)
    env.pop("TOKENIZERS_PARALLELISM", None)
    return env


def _cache_line(log: str) -> dict[str, Any] | None:
    """The "tokenized cache built/reused" line of a log, parsed."""
    match = CACHE_LINE.search(log)
    if match is None:
        return None
    g = match.groupdict()
    out: dict[str, Any] = {"built": not g["reused"], "path": g["path"]}
    if g["build_s"]:
        out.update(build_s=float(g["build_s"]), processes=int(g["procs"]))
    out.update(examples=int(g["examples"]), samples=int(g["samples"]), tokens=int(g["tokens"]), mib=float(g["mib"]))
    return out


class DataRunner(Runner):
    """cpu_suite's Runner (idle waits, contention records, one retry of a failed launch) with this suite's
    commands: preprocess.py, and train.py with a dataset cache directory."""

    def __init__(self, plan: DataPlan, work: Path, log: Callable[[str], None], model: Path, data: Path) -> None:
        super().__init__(plan, work, log)
        self.data_plan, self.model, self.data = plan, model, data

    def preprocess(self, what: str, rows: int, procs: int, cache_dir: Path, *, fresh: bool = True) -> dict[str, Any]:
        """scripts/preprocess.py into `cache_dir` (emptied first when `fresh`): wall time and the cache's line."""
        cmd = [sys.executable, str(REPO_ROOT / "scripts" / "preprocess.py"), "--model", str(self.model),
               "--dataset", str(self.data), "--context_length", str(self.data_plan.context_length),
               "--dataset_num_proc", str(procs), "--dataset_cache_dir", str(cache_dir),
               "--dataset_samples", str(rows)]  # fmt: skip
        reset = (lambda: shutil.rmtree(cache_dir, ignore_errors=True)) if fresh else None
        result = self._go(what, [cmd], [_env(self.data_plan.threads)], reset=reset)
        line = _cache_line(result.log)
        if line is None:
            raise RuntimeError(f"{what}: no 'tokenized cache' line in its output:\n{result.log}")
        return {"wall_s": result.wall_s, "foreign_cores": result.foreign_cores, "command": _shell(cmd), **line}

    def train(
        self,
        what: str,
        *,
        rows: int,
        cache_dir: Path,
        nproc: int,
        steps: int,
        flags: dict[str, Any] | None = None,
        fresh_cache: bool = False,
        first_step: bool = False,
    ) -> dict[str, Any]:
        """train.py (torchrun for 2 ranks) with --quant none --train_type lora on `rows` rows of the file.

        Returns metrics.jsonl's records, each rank's VmHWM at exit (cli_probe), the cache line of the log, and with
        `first_step` the wrapper's time from the launch to the first record.
        """
        p = self.data_plan
        out = Path(self.result_path(f"train-{nproc}"))
        all_flags = {
            "model": self.model, "quant": "none", "train_type": "lora", "precision": p.precision,
            "dataset": self.data, "dataset_samples": rows, "dataset_cache_dir": cache_dir,
            "context_length": p.context_length, "batch_size": p.batch_size, "lora_rank": p.lora_rank,
            "lora_alpha": p.lora_alpha, "lora_dropout": 0.0, "lora_target_modules": "all",
            "gradient_checkpointing": "false", "max_steps": steps, "lr": 1e-5, "log_to": "stdout",
            "save_model": "false", "device": "cpu", "output_dir": out, **(flags or {}),
        }  # fmt: skip
        args = ["-m", "benchmarks.cli_probe", str(REPO_ROOT / "train.py")]
        args += [f"--{k}={v}" for k, v in all_flags.items()]
        if nproc == 1:
            cmd, env = [sys.executable, *args], _env(p.threads)
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
            env = _env(max(1, p.threads // nproc))
        shown = _shell(cmd)
        timing = Path(f"{out}.first-step.json")
        if first_step:
            cmd = [sys.executable, "-m", "benchmarks.data_suite", "first-step", str(timing),
                   str(out / "metrics.jsonl"), "--", *cmd]  # fmt: skip
        peaks = f"{out}.peak-rss"
        env["BENCH_PEAK_RSS_FILE"] = peaks

        def reset() -> None:
            shutil.rmtree(out, ignore_errors=True)
            timing.unlink(missing_ok=True)
            if fresh_cache:
                shutil.rmtree(cache_dir, ignore_errors=True)

        result = self._go(what, [cmd], [env], reset=reset, finished=lambda: len(run_metrics(out)) == steps)
        records = run_metrics(out)
        if len(records) != steps:
            raise RuntimeError(f"{what}: {len(records)} metrics records, expected {steps}:\n{result.log}")
        run = {
            "command": shown,
            "wall_s": result.wall_s,
            "foreign_cores": result.foreign_cores,
            "metrics": records,
            "exit_peak_rss_bytes": [int(Path(f"{peaks}.rank{r}").read_text()) for r in range(nproc)],
            "cache": _cache_line(result.log),
        }
        if first_step:
            run.update(read_json(timing))
            if run["first_step_s"] is None:
                raise RuntimeError(f"{what}: the wrapper saw no metrics record")
        return run


def _shell(cmd: list[str]) -> str:
    """A command line as one would type it (the venv's python shown as `python`)."""
    shown = ["python" if part == sys.executable else part for part in cmd]
    return " ".join(shown).replace(str(REPO_ROOT) + "/", "")


# ---------------------------------------------------------------------------------------------------------------
# The sections
# ---------------------------------------------------------------------------------------------------------------


def _builds(runner: DataRunner, rows: list, details: dict) -> None:
    """1: scripts/preprocess.py, the first build of the cache, with --dataset_num_proc 1 and 2, each into a fresh
    directory: wall time of the whole command (interpreter, imports, tokenizer included) and the build's own."""
    p = runner.data_plan
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in p.build_procs}
    for rep in range(p.build_reps):
        order = p.build_procs if rep % 2 == 0 else tuple(reversed(p.build_procs))
        for procs in order:
            cache_dir = runner.work / f"build-{procs}-{rep}"
            what = f"build, {p.rows} rows, --dataset_num_proc {procs} (rep {rep + 1})"
            runs[procs].append(runner.preprocess(what, p.rows, procs, cache_dir))
            shutil.rmtree(cache_dir, ignore_errors=True)
    one, two = p.build_procs
    kw = {"ours_label": f"--dataset_num_proc {two}", "peer_label": f"--dataset_num_proc {one}",
          "note": f"scripts/preprocess.py on {p.rows:,} rows at --context_length {p.context_length}, a fresh "
                  f"--dataset_cache_dir each; median over {p.build_reps} run(s)"}  # fmt: skip
    rows.append(row("cache build", "build_wall_s", f"wall time of scripts/preprocess.py, first build, {p.rows:,} rows",
                    "s", "lower", [r["wall_s"] for r in runs[two]], [r["wall_s"] for r in runs[one]],
                    **kw))  # fmt: skip
    rows.append(row("cache build", "build_s", "the build's own time (its log line: read + tokenize + save)", "s",
                    "lower", [r["build_s"] for r in runs[two]], [r["build_s"] for r in runs[one]], **kw))  # fmt: skip
    details["builds"] = {str(n): r for n, r in runs.items()}


def _first_step(runner: DataRunner, rows: list, details: dict) -> Path:
    """2: time from the launch to the first metrics record, of a run that builds the cache (fresh directory) and of
    the run after it (the cache exists). Returns the last repetition's cache directory (kept)."""
    p = runner.data_plan
    runs: dict[str, list[dict[str, Any]]] = {"first": [], "cached": []}
    cache_dir = runner.work / "first-step-0"
    for rep in range(p.build_reps):
        if rep:
            shutil.rmtree(cache_dir, ignore_errors=True)
        cache_dir = runner.work / f"first-step-{rep}"
        for kind in ("first", "cached"):
            what = f"time to first step, {kind} run, {p.rows} rows (rep {rep + 1})"
            run = runner.train(what, rows=p.rows, cache_dir=cache_dir, nproc=1, steps=p.first_step_steps,
                               fresh_cache=kind == "first", first_step=True)  # fmt: skip
            want_built = kind == "first"
            if run["cache"] is not None and run["cache"]["built"] != want_built:
                raise RuntimeError(f"{what}: the cache was {'reused' if want_built else 'built'}: {run['cache']}")
            runs[kind].append(run)
    kw = {"ours_label": "the run after it (the cache exists)", "peer_label": "the first run (builds the cache)",
          "note": f"1 process, --quant none --train_type lora, batch {p.batch_size} x {p.context_length}, "
                  f"--max_steps {p.first_step_steps}, {p.rows:,} rows; time from the launch (the process's start, "
                  "/proc) to the first metrics.jsonl record, polled every 20 ms by benchmarks/data_suite.py's wrapper; "
                  f"median over {p.build_reps} pair(s); bar: ratio <= {FIRST_STEP_BAR}"}  # fmt: skip
    rows.append(row("cached start", "time_to_first_step_s", "time from launch to the end of step 1", "s", "lower",
                    [r["first_step_s"] for r in runs["cached"]], [r["first_step_s"] for r in runs["first"]],
                    **kw))  # fmt: skip
    details["first_step"] = {k: [_brief(r) for r in v] for k, v in runs.items()}
    return cache_dir


def _brief(run: dict[str, Any]) -> dict[str, Any]:
    """A run's record for results.json: the metrics' figures that matter here, not every field of every step."""
    keep = ("step", "tokens", "label_tokens", "tokens_per_s", "packing_efficiency", "peak_memory_bytes_per_rank",
            "elapsed_s")  # fmt: skip
    out = {k: v for k, v in run.items() if k != "metrics"}
    out["steps"] = [{k: m[k] for k in keep if k in m} for m in run["metrics"]]
    return out


def _peaks(run: dict[str, Any], nproc: int) -> list[int]:
    """Each rank's largest peak_memory_bytes_per_rank over the run's records (VmHWM, so its last)."""
    return [max(m["peak_memory_bytes_per_rank"][r] for m in run["metrics"]) for r in range(nproc)]


def _throughput(run: dict[str, Any], skip: int) -> tuple[float, float]:
    """(tokens/s, real tokens / row tokens) over the steps after `skip`: sums, so long and short steps weigh as
    their tokens (a step's seconds are tokens / tokens_per_s; its row tokens are tokens / packing_efficiency)."""
    steps = run["metrics"][skip:]
    seconds = sum(m["tokens"] / m["tokens_per_s"] for m in steps)
    row_tokens = sum(m["tokens"] / m["packing_efficiency"] for m in steps)
    tokens = sum(m["tokens"] for m in steps)
    return tokens / seconds, tokens / row_tokens


def _memory_and_padding(runner: DataRunner, shared: Path, built: set[int], rows: list, details: dict) -> None:
    """3 and 4: 2-rank training on the large and the small slice of the file (caches built beforehand, so the
    peaks are what training on them holds), and the large slice again with --pad_to_context true."""
    p = runner.data_plan
    large, small = p.rss_rows
    for n in (large, small):
        if n not in built:
            runner.preprocess(f"cache for {n} rows (not a figure)", n, 2, shared, fresh=False)
            built.add(n)
    peaks: dict[int, list[list[int]]] = {large: [], small: []}
    speed: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    runs: dict[str, list[dict[str, Any]]] = {"large": [], "small": [], "pad_to_context": []}
    for rep in range(p.train_reps):
        plan_order = [(small, False), (large, False), (large, True)]
        if rep % 2:
            plan_order.reverse()
        for n, pad in plan_order:
            padding = "--pad_to_context true" if pad else "per-batch padding"
            what = f"train x{p.nproc}, {n} rows, {padding} (rep {rep + 1})"
            run = runner.train(what, rows=n, cache_dir=shared, nproc=p.nproc, steps=p.steps,
                               flags={"pad_to_context": "true"} if pad else None)  # fmt: skip
            if run["cache"] is not None and run["cache"]["built"]:
                raise RuntimeError(f"{what}: built its cache, which should have existed: {run['cache']}")
            if pad:
                runs["pad_to_context"].append(run)
                speed[True].append(_throughput(run, p.warmup_steps))
            else:
                runs["large" if n == large else "small"].append(run)
                peaks[n].append(_peaks(run, p.nproc))
                if n == large:
                    speed[False].append(_throughput(run, p.warmup_steps))
    # Both padding modes train the same rows at each step (same seed and sampler): the same real tokens.
    same_rows = all(
        [m["tokens"] for m in a["metrics"]] == [m["tokens"] for m in b["metrics"]]
        for a in runs["large"] for b in runs["pad_to_context"]
    )  # fmt: skip
    if not same_rows:
        raise RuntimeError("per-batch padding and --pad_to_context trained different tokens per step")
    shape = (f"{p.nproc} ranks (torchrun, gloo) x batch {p.batch_size} x --context_length {p.context_length}, "
             f"--quant none --train_type lora, --max_steps {p.steps}")  # fmt: skip
    sec = f"data memory, {p.nproc} ranks"
    kw = {"ours_label": f"{large:,} rows (--dataset_samples {large})",
          "peer_label": f"{small:,} rows of the same file (--dataset_samples {small})",
          "note": f"{shape}; each rank's largest peak_memory_bytes_per_rank (VmHWM) in metrics.jsonl; caches built "
                  f"beforehand by scripts/preprocess.py; median over {p.train_reps} run(s)"}  # fmt: skip
    bar = {
        "ours_label": f"{large:,} rows minus {small:,} rows, per rank (paired runs)",
        "peer_label": f"the bar, {RSS_BAR_BYTES / 1e6:.0f} MB (ratio <= 1 passes)",
        "note": kw["note"],
    }
    details["memory"] = {"peaks": {str(n): v for n, v in peaks.items()}}
    for r in range(p.nproc):
        big, little = [v[r] for v in peaks[large]], [v[r] for v in peaks[small]]
        rows.append(row(sec, f"train_peak_rss_rank{r}_bytes", f"peak RSS, rank {r}", "bytes", "lower", big, little,
                        **kw))  # fmt: skip
        growth = [b - s for b, s in zip(big, little, strict=True)]
        # In MB (10^6 bytes), the bar's unit; report.fmt shows no negative byte counts, and a difference may be one.
        rows.append(row(sec, f"train_peak_rss_growth_rank{r}_mb", f"peak RSS, rank {r}: {large:,} rows minus "
                        f"{small:,}, MB", "MB", "lower", [g / 1e6 for g in growth], [RSS_BAR_BYTES / 1e6],
                        **bar))  # fmt: skip
        details["memory"][f"growth_rank{r}_bytes"] = growth
    kw = {
        "ours_label": "per-batch padding (longest row rounded up to 8)",
        "peer_label": "--pad_to_context true",
        "note": f"{shape}, {large:,} rows; steps {p.warmup_steps + 1}-{p.steps}: tokens / seconds and real tokens "
        f"/ row tokens summed over them; the same rows at every step on both sides; row tokens as the "
        f"trainer counts them (every rank's padded batches, summed); median over {p.train_reps} run(s)",
    }
    rows.append(row("padding", "tokens_per_s", "real tokens/s (all ranks)", "tokens/s", "higher",
                    [s[0] for s in speed[False]], [s[0] for s in speed[True]], **kw))  # fmt: skip
    rows.append(row("padding", "packing_efficiency", "real tokens / row tokens (packing_efficiency)", "fraction",
                    "higher", [s[1] for s in speed[False]], [s[1] for s in speed[True]], **kw))  # fmt: skip
    details["padding"] = {"per_batch": speed[False], "pad_to_context": speed[True], "same_rows_per_step": same_rows}
    details["training_runs"] = {k: [_brief(r) for r in v] for k, v in runs.items()}


def run_data_suite(
    plan: DataPlan, *, model: Path | None, cache: Path, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Every measurement of the data suite; returns results.json's content."""
    suite_start = time.perf_counter()
    cpu = CpuPlan(QUICK_MODEL, reps=1, batch_size=1, context_length=1, warmup_steps=0, measured_steps=0,
                  threads=plan.threads, launch_timeout_s=600.0)  # fmt: skip
    model_dir = model or ensure_model(cpu, cache)
    config = json.loads((model_dir / "config.json").read_text())
    data, data_info = ensure_dataset(plan, model_dir, cache, log)
    rows: list[dict[str, Any]] = []
    details: dict[str, Any] = {"dataset": data_info}
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        runner = DataRunner(plan, Path(tmp), log, model_dir, data)
        log(f"1/4 cache build, {plan.rows} rows, --dataset_num_proc {' and '.join(map(str, plan.build_procs))}")
        _builds(runner, rows, details)
        log("2/4 time to the first step, cache built in the run against reused")
        kept = _first_step(runner, rows, details)
        # The last first-step directory holds the cache of all the rows: items 3-4 reuse it where they read as many.
        shared, built = kept, {plan.rows}
        log(f"3/4 and 4/4 {plan.nproc}-rank training, {plan.rss_rows[0]} against {plan.rss_rows[1]} rows; "
            "per-batch padding against --pad_to_context")  # fmt: skip
        _memory_and_padding(runner, shared, built, rows, details)
        launches = runner.launches
    build = next(iter(details["builds"].values()))[0]
    data_info["samples"] = build["samples"]
    data_info["mean_sample_tokens"] = round(build["tokens"] / build["samples"], 1)
    data_info["cache_mib"] = build["mib"]
    ttfs = next(r for r in rows if r["key"] == "time_to_first_step_s")
    growth = [r for r in rows if r["key"].startswith("train_peak_rss_growth")]
    bar_mb = RSS_BAR_BYTES / 1e6
    checks = [
        {"bar": f"cached time to first step <= {FIRST_STEP_BAR}x the first run's", "value": ttfs["ratio"],
         "unit": "x", "passed": ttfs["ratio"] <= FIRST_STEP_BAR},
        *({"bar": f"{r['figure']}: at most {bar_mb:.0f} MB", "value": r["ours"], "unit": "MB",
           "passed": r["ours"] <= bar_mb} for r in growth),
    ]  # fmt: skip
    return {
        "suite": "cpu-data",
        "quick": plan.quick,
        "model": model_record(model_dir, {k: config.get(k) for k in SIZE_KEYS}),
        "settings": {
            **asdict(plan),
            "precision": f"--precision {plan.precision}",
            "threads": f"OMP_NUM_THREADS={plan.threads} for one-process runs, {max(1, plan.threads // plan.nproc)} "
            f"per rank for {plan.nproc}-rank jobs; TOKENIZERS_PARALLELISM left to the package",
            "our_training": "the real CLI: python train.py / torchrun train.py, metrics.jsonl; "
            "scripts/preprocess.py for the builds",
            "shapes": f"batch {plan.batch_size} per rank x --context_length {plan.context_length}",
        },
        "rows": rows,
        "checks": checks,
        "details": details,
        "conditions": launch_conditions(launches),
        "wall_time_s": time.perf_counter() - suite_start,
    }


def render_data(results: dict[str, Any]) -> str:
    """report.render's tables, then the dataset, the bars and every launch's contention."""
    lines = [render(results).rstrip("\n")]
    data = results.get("details", {}).get("dataset")
    if data:
        tokens = data["field_tokens_first_2000"]
        lines += ["", "### Dataset", "",
                  f"`{data['path']}`: {data['rows']:,} synthetic alpaca rows ({data['bytes'] / 2**20:.0f} MiB; "
                  f"generator {data['generator']}). instruction + input + output tokens of the first 2,000 rows: "
                  f"min {tokens['min']}, median {tokens['median']}, mean {tokens['mean']}, max {tokens['max']}; "
                  f"{data.get('samples', '?'):,} samples of {data.get('mean_sample_tokens', '?')} tokens on average "
                  f"with the prompt template (cache {data.get('cache_mib', '?')} MiB)."]  # fmt: skip
    checks = results.get("checks") or []
    if checks:
        lines += ["", "### Acceptance bars", ""]
        if results.get("quick"):
            lines += ["Quick mode: a few thousand rows build in about a second, so these say nothing of the bars.", ""]
        for c in checks:
            value = f"{c['value']:.1f} MB" if c["unit"] == "MB" else f"{c['value']:.3f}x"
            lines.append(f"- {c['bar']}: {value}: **{'pass' if c['passed'] else 'FAIL'}**")
    lines += launches_markdown(results)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "first-step":
        sys.exit(_first_step_main(sys.argv[2:]))
    raise SystemExit("usage: python -m benchmarks.data_suite first-step RESULT METRICS -- CMD...")
