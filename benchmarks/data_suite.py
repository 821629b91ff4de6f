"""The data suite (--suite cpu-data) on a synthetic alpaca JSONL: cache build, cached start, data memory, padding.
`python -m benchmarks.data_suite first-step ...` times a launch to its first metrics.jsonl record.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import harness, report
from benchmarks.harness import Runner, Settings, alternating, brief, figure_rows, row, session

GENERATOR_VERSION = 1
"""Part of the synthetic file's name: raise it when the generator changes what it writes."""
FIELD_TOKENS = (20, 400)
"""Each row's instruction + input + output hold a uniformly drawn number of tokens in this range (inclusive)."""
RSS_BAR_MB = 300
"""Item 3's bar: the large run's per-rank peak may exceed the small run's by at most 300 MB (10^6 bytes)."""
FIRST_STEP_BAR = 0.5
"""Item 2's bar: the cached run's time to the first step is at most this fraction of the building run's."""
SHARED_CACHE = "first-step"
"""Item 2's --dataset_cache_dir (under the runner's work directory): items 3 and 4 reuse its cache of every row."""
CACHE_LINE = re.compile(r"tokenized cache (?:built in (?P<build_s>[\d.]+) s with (?P<procs>\d+) process\(es\)|"
                        r"(?P<reused>reused)) at (?P<path>\S+?): (?P<examples>\d+) examples .*?, (?P<samples>\d+) "
                        r"samples, (?P<tokens>\d+) tokens, (?P<mib>[\d.]+) MiB")  # fmt: skip
KEEP = ("step", "tokens", "label_tokens", "tokens_per_s", "packing_efficiency", "peak_memory_bytes_per_rank",
        "elapsed_s")  # fmt: skip


@dataclass
class DataPlan(Settings):
    rows: int
    """Rows of the synthetic file; items 1 and 2 read all of them."""
    rss_rows: tuple[int, int]
    """Items 3 and 4: rows of the large and the small run (run.py's --rows >= 80 fills a step of the small one)."""
    build_reps: int
    train_reps: int
    context_length: int = 1024
    batch_size: int = 2
    """Per rank."""
    nproc: int = 2
    build_procs: tuple[int, ...] = (1, 2)
    first_step_steps: int = 2
    steps: int = 5
    warmup_steps: int = 2
    """Item 4 measures the steps after these."""
    seed: int = 0


def plan(*, quick: bool, rows: int | None, **launch: Any) -> DataPlan:
    """The full suite (1,000,000 rows; item 3 trains on 200,000 of them against 2,000) or the quick one (2,000 against
    200); a build takes minutes, so no retry."""
    n = rows or (2_000 if quick else 1_000_000)
    rss = (min(n, 2_000), max(8, min(n, 2_000) // 10)) if quick else (min(n, 200_000), min(n // 10, 2_000))
    p = DataPlan(n, rss, build_reps=1, train_reps=1 if quick else 3, launch_timeout_s=300.0 if quick else 3600.0,
                 quick=quick, retries=0, **(dict(steps=3, warmup_steps=1) if quick else {}))  # fmt: skip
    return p.configure(**launch)


def synthetic_rows(n: int, word_tokens: dict[str, int], *, seed: int):
    """n alpaca rows of a drawn token count: a fifth instruction, half with an input, the rest the output."""
    rng, words, costs = random.Random(seed), list(word_tokens), list(word_tokens.values())
    for _ in range(n):
        target, chosen, total = rng.randint(*FIELD_TOKENS), [], 0
        while total < target:
            j = rng.randrange(len(words))
            chosen.append(words[j])
            total += costs[j]
        k = max(1, len(chosen) // 5)
        m = k + (len(chosen) - k) // 3 if rng.random() < 0.5 else k
        yield {"instruction": " ".join(chosen[:k]), "input": " ".join(chosen[k:m]),
               "output": " ".join(chosen[m:]) or chosen[-1]}  # fmt: skip


def ensure_dataset(plan: DataPlan, model: Path, cache: Path) -> tuple[Path, dict]:
    """The synthetic JSONL (written once under `cache`) and its first rows' token counts."""
    tokenizer, costs = harness.word_tokens(model / "tokenizer.json")
    digest = hashlib.sha256((model / "tokenizer.json").read_bytes()).hexdigest()[:10]
    path = cache / "data" / f"synthetic-alpaca-v{GENERATOR_VERSION}-seed{plan.seed}-tok{digest}-{plan.rows}.jsonl"
    written_s = 0.0
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        started, tmp = time.perf_counter(), path.with_name(f"{path.name}.tmp-{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in synthetic_rows(plan.rows, costs, seed=plan.seed))
        tmp.replace(path)
        written_s = time.perf_counter() - started
        print(f"wrote {plan.rows} synthetic rows to {path} in {written_s:.0f} s")
    with open(path, encoding="utf-8") as fh:  # each field tokenized alone, as the prompt template frames it
        sample = [sum(len(tokenizer.encode(v, add_special_tokens=False).ids) for v in json.loads(line).values() if v)
                  for _, line in zip(range(2000), fh, strict=False)]  # fmt: skip
    return path, {"path": str(path), "rows": plan.rows, "bytes": path.stat().st_size, "written_s": round(written_s, 1),
                  "generator": f"v{GENERATOR_VERSION}, seed {plan.seed}, field tokens uniform in {FIELD_TOKENS}",
                  "field_tokens_first_2000": {"min": min(sample), "median": statistics.median(sample),
                                              "max": max(sample), "mean": round(statistics.fmean(sample), 1)},
                  }  # fmt: skip


def _first_step_main(argv: list[str]) -> int:
    """`first-step RESULT METRICS -- CMD...`: run CMD, write to RESULT when METRICS (opened empty, then a record per
    step) got its first record, after this process's start (/proc, a clock tick), and exit with CMD's status."""
    if argv[:1] != ["first-step"] or argv[3:4] != ["--"] or len(argv) < 5:
        raise SystemExit("usage: python -m benchmarks.data_suite first-step RESULT METRICS -- CMD...")
    result, metrics, _, *cmd = argv[1:]
    started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    proc, first = subprocess.Popen(cmd), None
    while True:
        exited = proc.poll() is not None  # a record written in the last 20 ms still counts: an upper bound
        if first is None and Path(metrics).is_file() and Path(metrics).stat().st_size > 0:
            first = time.clock_gettime(time.CLOCK_BOOTTIME) - started
        if exited:
            break
        time.sleep(0.02)
    harness.write_json(result, {"first_step_s": first, "exit_s": time.clock_gettime(time.CLOCK_BOOTTIME) - started})
    return proc.returncode if proc.returncode >= 0 else 128 - proc.returncode


def cache_line(log: str) -> dict[str, Any] | None:
    """The "tokenized cache built/reused" line of a log, parsed."""
    if (match := CACHE_LINE.search(log)) is None:
        return None
    g = match.groupdict()
    built = {"build_s": float(g["build_s"]), "processes": int(g["procs"])} if g["build_s"] else {}
    counts = {k: int(g[k]) for k in ("examples", "samples", "tokens")}
    return {"built": not g["reused"], "path": g["path"], **built, **counts, "mib": float(g["mib"])}


def preprocess(runner: Runner, what: str, rows: int, procs: int, cache_dir: Path, data: Path, model: Path, *,
               fresh: bool = True) -> dict[str, Any]:  # fmt: skip
    """scripts/preprocess.py into `cache_dir` (`fresh`: emptied before, removed after): wall time and its cache line."""
    cmd = [sys.executable, str(harness.REPO_ROOT / "scripts" / "preprocess.py"), "--model", str(model), "--dataset",
           str(data), "--context_length", str(runner.plan.context_length), "--dataset_num_proc", str(procs),
           "--dataset_cache_dir", str(cache_dir), "--dataset_samples", str(rows)]  # fmt: skip
    reset = (lambda: shutil.rmtree(cache_dir, ignore_errors=True)) if fresh else None
    result = runner.go(what, [cmd], [runner.env(runner.plan.threads)], reset=reset)
    if reset is not None:
        reset()
    if (line := cache_line(result.log)) is None:
        raise RuntimeError(f"{what}: no 'tokenized cache' line in its output:\n{result.log}")
    return {"wall_s": result.wall_s, "foreign_cores": result.foreign_cores, "command": harness.shell(cmd), **line}


def train(runner: Runner, what: str, model: Path, data: Path, *, rows: int, cache_dir: Path, nproc: int, steps: int,
          fresh_cache: bool = False, first_step: bool = False, **flags: Any) -> dict[str, Any]:  # fmt: skip
    """train.py --quant none --train_type lora on `rows` rows; `first_step`: under the timing wrapper."""
    p = runner.plan
    f = runner.flags(f"train-{nproc}", model=model, quant="none", train_type="lora", dataset=data,
                     dataset_samples=rows, dataset_cache_dir=cache_dir, context_length=p.context_length,
                     batch_size=p.batch_size, gradient_checkpointing="false", max_steps=steps, **flags)  # fmt: skip
    timing = Path(f"{f['output_dir']}.first-step.json")  # a fresh name each run, written as the wrapper exits
    wrap = [sys.executable, "-m", "benchmarks.data_suite", "first-step", str(timing),
            str(Path(f["output_dir"]) / "metrics.jsonl"), "--"] if first_step else []  # fmt: skip
    reset = (lambda: shutil.rmtree(cache_dir, ignore_errors=True)) if fresh_cache else None
    run = runner.train(what, f, nproc=nproc, steps=steps, wrap=wrap, reset=reset)
    run["cache"] = cache_line(run.pop("log"))
    if run["cache"] is not None and run["cache"]["built"] != fresh_cache:  # a fresh cache is built, any other reused
        raise RuntimeError(f"{what}: the cache was {'built' if fresh_cache else 'reused'}: {run['cache']}")
    if first_step:
        run.update(harness.read_json(timing))
        if run["first_step_s"] is None:
            raise RuntimeError(f"{what}: the wrapper saw no metrics record")
    return run


def run(p: DataPlan, *, model: Path | None, cache: Path) -> dict[str, Any]:
    """Items 1-4, then the bars; returns results.json's content."""
    # The tokenizer keeps its own thread default, as a user's run has it (the package pins it in a process pool).
    with session(p, "data", env=functools.partial(harness.base_env, pin_tokenizers=False)) as runner:
        model_dir = model or runner.model(harness.QUICK_MODEL, cache)
        data, info = ensure_dataset(p, model_dir, cache)
        rows, details = [], {"dataset": info}
        for stage in (_builds, _first_step, _training):
            rows += stage(runner, model_dir, data, details)
        ttfs = next(r["ratio"] for r in rows if r["key"] == "time_to_first_step_s")
        checks = [{"bar": f"cached time to first step <= {FIRST_STEP_BAR}x the first run's", "value": ttfs,
                   "unit": "x", "passed": ttfs <= FIRST_STEP_BAR}]  # fmt: skip
        checks += [{"bar": f"{r['figure']}: at most {RSS_BAR_MB} MB", "value": r["ours"], "unit": "MB",
                    "passed": r["ours"] <= RSS_BAR_MB} for r in rows if r["key"].startswith("train_peak_rss_growth")
                   ]  # fmt: skip
        return runner.results("cpu-data", rows, details, {
            "tokenizers": "TOKENIZERS_PARALLELISM left to the package",
            "our_training": "the real CLI: python train.py / torchrun train.py, metrics.jsonl; scripts/preprocess.py "
                            "for the builds",
            "shapes": f"batch {p.batch_size} per rank x --context_length {p.context_length}",
        }, model=harness.model_record(model_dir), checks=checks)  # fmt: skip


def _builds(runner: Runner, model: Path, data: Path, details: dict) -> list[dict]:
    """1: scripts/preprocess.py's first build at each --dataset_num_proc: the command's wall and the build's."""
    p = runner.plan
    one, two = p.build_procs
    print(f"1/4 cache build, {p.rows} rows, --dataset_num_proc {one} and {two}")

    def measure(procs: int, rep: int) -> dict[str, Any]:
        return preprocess(runner, f"build, {p.rows} rows, --dataset_num_proc {procs} (rep {rep + 1})", p.rows, procs,
                          runner.work / f"build-{procs}-{rep}", data, model)  # fmt: skip

    runs = alternating(p.build_reps, p.build_procs, measure)
    details["builds"] = {str(n): r for n, r in runs.items()}
    build = runs[one][0]
    details["dataset"].update(samples=build["samples"], mean_sample_tokens=round(build["tokens"] / build["samples"], 1),
                              cache_mib=build["mib"])  # fmt: skip
    timed = {n: [{"build_wall_s": r["wall_s"], "build_s": r["build_s"]} for r in v] for n, v in runs.items()}
    return figure_rows("cache build", (
        ("build_wall_s", f"wall time of scripts/preprocess.py, first build, {p.rows:,} rows", "s", "lower"),
        ("build_s", "the build's own time (its log line: read + tokenize + save)", "s", "lower"),
    ), timed[two], timed[one], ours_label=f"--dataset_num_proc {two}", peer_label=f"--dataset_num_proc {one}",
        note=f"scripts/preprocess.py on {p.rows:,} rows at --context_length {p.context_length}, a fresh "
             f"--dataset_cache_dir each; median over {p.build_reps} run(s)")  # fmt: skip


def _first_step(runner: Runner, model: Path, data: Path, details: dict) -> list[dict]:
    """2: launch to first record, the run that builds the cache (into SHARED_CACHE, emptied), then one reusing it."""
    p = runner.plan
    print("2/4 time to the first step, cache built in the run against reused")
    runs: dict[str, list[dict[str, Any]]] = {"first": [], "cached": []}
    for rep in range(p.build_reps):
        for kind, kept in runs.items():
            kept.append(train(runner, f"time to first step, {kind} run, {p.rows} rows (rep {rep + 1})", model, data,
                              rows=p.rows, cache_dir=runner.work / SHARED_CACHE, nproc=1, steps=p.first_step_steps,
                              fresh_cache=kind == "first", first_step=True))  # fmt: skip
    details["first_step"] = {k: [brief(r, KEEP) for r in v] for k, v in runs.items()}
    return [row("cached start", "time_to_first_step_s", "time from launch to the end of step 1", "s", "lower",
                [r["first_step_s"] for r in runs["cached"]], [r["first_step_s"] for r in runs["first"]],
                ours_label="the run after it (the cache exists)", peer_label="the first run (builds the cache)",
                note=f"1 process, --quant none --train_type lora, batch {p.batch_size} x {p.context_length}, "
                f"--max_steps {p.first_step_steps}, {p.rows:,} rows; time from the launch (the process's start, "
                "/proc) to the first metrics.jsonl record, polled every 20 ms by benchmarks/data_suite.py's "
                f"wrapper; median over {p.build_reps} pair(s); bar: ratio <= {FIRST_STEP_BAR}")]  # fmt: skip


def _throughput(run: dict[str, Any], skip: int) -> tuple[float, float]:
    """(tokens/s, real tokens / row tokens) summed over the steps after `skip`, so steps weigh as their tokens."""
    steps = run["metrics"][skip:]
    tokens = sum(m["tokens"] for m in steps)
    return (tokens / sum(m["tokens"] / m["tokens_per_s"] for m in steps),
            tokens / sum(m["tokens"] / m["packing_efficiency"] for m in steps))  # fmt: skip


def _training(runner: Runner, model: Path, data: Path, details: dict) -> list[dict]:
    """3 and 4: training on the large and the small slice, caches built beforehand into SHARED_CACHE (which already
    holds every row's), and on the large one with --pad_to_context."""
    p, cache_dir = runner.plan, runner.work / SHARED_CACHE
    large, small = p.rss_rows
    print(f"3/4 and 4/4 {p.nproc}-rank training, {large} against {small} rows; per-batch padding, --pad_to_context")
    for n in [n for n in (large, small) if n != p.rows]:
        preprocess(runner, f"cache for {n} rows (not a figure)", n, 2, cache_dir, data, model, fresh=False)

    def measure(kind: str, rep: int) -> dict[str, Any]:
        n, pad = small if kind == "small" else large, kind == "pad_to_context"
        what = f"train x{p.nproc}, {n} rows, {'--pad_to_context true' if pad else 'per-batch padding'} (rep {rep + 1})"
        return train(runner, what, model, data, rows=n, cache_dir=cache_dir, nproc=p.nproc, steps=p.steps,
                     **({"pad_to_context": "true"} if pad else {}))  # fmt: skip

    runs = alternating(p.train_reps, ("small", "large", "pad_to_context"), measure)
    shape = (f"{p.nproc} ranks (torchrun, gloo) x batch {p.batch_size} x --context_length {p.context_length}, "
             f"--quant none --train_type lora, --max_steps {p.steps}")  # fmt: skip
    # 3: each rank's peak RSS on the large slice against the small one, and their difference against the bar.
    peaks = {n: [[max(m["peak_memory_bytes_per_rank"][r] for m in run["metrics"]) for r in range(p.nproc)]
                 for run in runs[kind]] for n, kind in ((large, "large"), (small, "small"))}  # fmt: skip
    details["memory"] = {"peaks": {str(n): v for n, v in peaks.items()}}
    section, rows = f"data memory, {p.nproc} ranks", []
    note = (f"{shape}; each rank's largest peak_memory_bytes_per_rank (VmHWM) in metrics.jsonl; caches built "
            f"beforehand by scripts/preprocess.py; median over {p.train_reps} run(s)")  # fmt: skip
    for r in range(p.nproc):
        big, little = [v[r] for v in peaks[large]], [v[r] for v in peaks[small]]
        growth = details["memory"][f"growth_rank{r}_bytes"] = [b - s for b, s in zip(big, little, strict=True)]
        # In MB (10^6 bytes), the bar's unit; report.fmt shows no negative byte counts, and a difference may be one.
        rows += [
            row(section, f"train_peak_rss_rank{r}_bytes", f"peak RSS, rank {r}", "bytes", "lower", big, little,
                ours_label=f"{large:,} rows (--dataset_samples {large})",
                peer_label=f"{small:,} rows of the same file (--dataset_samples {small})", note=note),
            row(section, f"train_peak_rss_growth_rank{r}_mb", f"peak RSS, rank {r}: {large:,} rows minus {small:,}, MB",
                "MB", "lower", [g / 1e6 for g in growth], [RSS_BAR_MB], note=note,
                ours_label=f"{large:,} rows minus {small:,} rows, per rank (paired runs)",
                peer_label=f"the bar, {RSS_BAR_MB} MB (ratio <= 1 passes)"),
        ]  # fmt: skip
    # 4: real tokens/s and real tokens / row tokens of per-batch padding against --pad_to_context, the same rows.
    same_rows = all([m["tokens"] for m in a["metrics"]] == [m["tokens"] for m in b["metrics"]]
                    for a in runs["large"] for b in runs["pad_to_context"])  # fmt: skip
    if not same_rows:
        raise RuntimeError("per-batch padding and --pad_to_context trained different tokens per step")
    speed = {kind: [_throughput(run, p.warmup_steps) for run in runs[kind]] for kind in ("large", "pad_to_context")}
    ours, peer = ([{"tokens_per_s": t, "packing_efficiency": e} for t, e in speed[k]] for k in speed)
    rows += figure_rows("padding", (
        ("tokens_per_s", "real tokens/s (all ranks)", "tokens/s", "higher"),
        ("packing_efficiency", "real tokens / row tokens (packing_efficiency)", "fraction", "higher"),
    ), ours, peer, ours_label="per-batch padding (longest row rounded up to 8)", peer_label="--pad_to_context true",
        note=f"{shape}, {p.rss_rows[0]:,} rows; steps {p.warmup_steps + 1}-{p.steps}: tokens / seconds and real "
             "tokens / row tokens summed over them; the same rows at every step on both sides; row tokens as the "
             "trainer counts them (every rank's padded batches, summed); median over "
             f"{p.train_reps} run(s)")  # fmt: skip
    details["padding"] = {"per_batch": speed["large"], "pad_to_context": speed["pad_to_context"],
                          "same_rows_per_step": same_rows}  # fmt: skip
    details["training_runs"] = {k: [brief(r, KEEP) for r in v] for k, v in runs.items()}
    return rows


def render(results: dict[str, Any]) -> str:
    """The tables, then the dataset and the bars."""
    lines, data = [], results.get("details", {}).get("dataset")
    if data:
        t = data["field_tokens_first_2000"]
        lines += ["", "### Dataset", "",
                  f"`{data['path']}`: {data['rows']:,} synthetic alpaca rows ({data['bytes'] / 2**20:.0f} MiB; "
                  f"generator {data['generator']}). instruction + input + output tokens of the first 2,000 rows: "
                  f"min {t['min']}, median {t['median']}, mean {t['mean']}, max {t['max']}; "
                  f"{data.get('samples', '?'):,} samples of {data.get('mean_sample_tokens', '?')} tokens on average "
                  f"with the prompt template (cache {data.get('cache_mib', '?')} MiB)."]  # fmt: skip
    value = {"MB": "{:.1f} MB", "x": "{:.3f}x"}
    quick = "Quick mode: a few thousand rows build in about a second, so these say nothing of the bars."
    lines += report.acceptance("Acceptance bars", [
        f"- {c['bar']}: {value[c['unit']].format(c['value'])}: **{report.verdict(c['passed'])}**"
        for c in results.get("checks") or []], quick_note=quick if results.get("quick") else "")  # fmt: skip
    return report.render(results, lines)


if __name__ == "__main__":
    sys.exit(_first_step_main(sys.argv[1:]))
