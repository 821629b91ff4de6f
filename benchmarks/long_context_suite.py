"""The long-context suite (--suite cpu-long-context): what --sequence_parallel_size and --tiled_mlp save per rank.

The issue's acceptance, from this suite: at 16k tokens S = 2 holds at most 0.6x the step's peak tensor bytes per rank
of S = 1; the tiled MLP holds at most 0.7x of untiled; in the same per-rank budget S = 2 trains at least 1.8x the
longest context of S = 1. Every run is our real CLI, `torchrun --nproc_per_node S -m benchmarks.step_probe train.py
--sequence_parallel_size S --quant bnb`, FSDP2, gradient checkpointing at its default (on), LoRA on every linear,
batch 1, on a random Llama whose step is mostly activations (hidden 1024, 4 layers; `--quick`: hidden 256, 2 layers).
S ranks form one group, so dp = 1 and every run trains the same rows: each of them `context` tokens exactly (a
JSONL of text rows longer than any context, truncated to it; checked on metrics.jsonl's tokens at every step).

1. **Memory grid**: every context x S, the tiled MLP off and on (`--tiled_mlp N`, N by auto's rule, a tile per
   hidden-size tokens of the rank's slice, but at least 2 tiles: auto gives one where the slice is no longer than
   the hidden size, and that run would repeat the untiled one). Each figure stands beside S = 1 untiled at the same
   context (the peer column): the step's peak tensor bytes per rank, its peak RSS growth, tokens/s.
2. **Longest context** in a fixed per-rank budget: S = 1 untiled's tensor peak at the base context plus
   BUDGET_MARGIN. For S = 1 and S = 2 (untiled) the longest of the candidates (base, base + step, ... up to the
   largest grid context) whose peak fits, found from the grid's runs first, then launches from the longest known fit
   upward (stride doubling until one does not fit, then bisection): peaks grow with the context.

A step's peak, two ways, as the preference suite measures it: the trainer's profiler (`--profile true
--profile_steps K,K`) over the last step, whose largest "Total Allocated" is the bytes of tensors allocated in the
step and not yet freed (benchmarks/step_probe.py makes gloo's collectives free their buffers on the training thread,
where the profiler sees the free), and the RSS growth of steps 1 to K-1 above the RSS before step 1. Tokens/s: steps
2 to K-1, or step 1 when K = 2 (a step at 16k tokens takes minutes, so the full suite runs K = 2).

Wall time. `--quick` (the test): 4 launches of 1-2 ranks plus at most one search launch. The full suite: one
full-model step of 4096 tokens at S = 1 (2 threads, fp32) took 154 s wall and about 90 CPU-seconds (2026-12-02, other
processes using 1.5 of the 2 cores), so about 50 s on 2 idle cores. Counting a step's work as its tokens x (linear
layers + attention, which grows with the context), a step costs about 2.6x that at 8k and 7.5x at 16k, whatever S (S
ranks share the same 2 cores); 6 runs of 2 steps per context plus about 2 search launches make some 140 such steps,
about 2-2.5 hours on 2 idle cores (launches' start-up included) and 6 or more on a busy one. A 16k run takes up to half
an hour, hence the launch timeout of 2 hours.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import median, write_long_rows
from benchmarks.cpu_suite import (
    CpuPlan,
    LaunchSettings,
    Runner,
    ensure_model,
    launch_conditions,
    launches_markdown,
    model_record,
)
from benchmarks.data_suite import _shell
from benchmarks.preference_suite import probed_train
from benchmarks.report import fmt, render
from benchmarks.rows import row

SP_PEAK_BAR = 0.6
"""The issue's bound on S = 2's step peak tensor bytes per rank over S = 1's, at the largest context."""
TILED_PEAK_BAR = 0.7
"""The issue's bound on the tiled MLP's step peak over untiled (S = 1, the largest context)."""
LONGEST_BAR = 1.8
"""The issue's floor on S = 2's longest context in the budget over S = 1's."""
BUDGET_MARGIN = 0.1
"""The per-rank budget is S = 1 untiled's tensor peak at the base context plus this fraction of it."""
MIN_TILES = 2
ACCEPTANCE = "the issue's ratios"
"""results.md's section of the three acceptance rows."""
FULL_MODEL = dict(hidden_size=1024, num_layers=4, intermediate_size=2816, num_heads=16, num_kv_heads=4,
                  vocab_size=8192, num_shards=2)  # fmt: skip
"""61.9M parameters, 4 KV heads (so S = 4 splits them): 91 MiB resident at S = 1 (the fp32 embedding and head 64 MiB
of it), 1.16M LoRA parameters, while at 4k tokens and more a step's tensors run to hundreds of MiB of activations."""
QUICK_MODEL = dict(hidden_size=256, num_layers=2, intermediate_size=704, num_heads=8, num_kv_heads=4, vocab_size=512,
                   num_shards=2)  # fmt: skip


@dataclass
class LongContextPlan(LaunchSettings):
    """Sizes and repetitions of one long-context suite run."""

    model: dict[str, int]
    """scripts/make_tiny_model.py size flags."""
    contexts: tuple[int, ...]
    """The memory grid's contexts, ascending; acceptance is read at the last."""
    base_context: int
    """The budget's context (S = 1, untiled) and the longest-context search's first candidate."""
    search_step: int
    """Candidates of the longest-context search: base_context + k x search_step, up to the last grid context."""
    sizes: tuple[int, ...]
    """--sequence_parallel_size values of the grid; S ranks each."""
    tiled_sizes: tuple[int, ...]
    """The sizes that also run with the tiled MLP."""
    reps: int
    steps: int = 2
    """--max_steps: steps 1 to steps-1 give RSS and tokens/s, the last (profiled) the tensor peak."""
    lora_rank: int = 16
    lora_alpha: float = 32.0
    seed: int = 0
    retries: int = field(default=0, kw_only=True)
    """No re-measuring on contention: byte counts do not move with other processes' CPU use; results.md lists
    every launch's contention."""

    def candidates(self) -> list[int]:
        return list(range(self.base_context, self.contexts[-1] + 1, self.search_step))


def plan(*, quick: bool, threads: int, reps: int | None, idle_wait_s: float | None,
         precision: str | None = None) -> LongContextPlan:  # fmt: skip
    """The full suite (4k, 8k and 16k tokens x S = 1, 2, 4 x tiled off/on; hours on 2 cores, see the module
    docstring) or the quick one the test runs (1024 tokens x S = 1, 2, tiled at S = 1; budget at 512 tokens)."""
    if quick:
        p = LongContextPlan(dict(QUICK_MODEL), contexts=(1024,), base_context=512, search_step=512, sizes=(1, 2),
                            tiled_sizes=(1,), reps=1, quick=True)  # fmt: skip
        p.idle_wait_s, p.launch_timeout_s = 0.0, 180.0
    else:
        p = LongContextPlan(dict(FULL_MODEL), contexts=(4096, 8192, 16384), base_context=4096, search_step=512,
                            sizes=(1, 2, 4), tiled_sizes=(1, 2, 4), reps=1)  # fmt: skip
        p.launch_timeout_s = 7200.0
    p.set_launch(threads=threads, precision=precision, idle_wait_s=idle_wait_s)
    if reps is not None:
        p.reps = reps
    check_plan(p)
    return p


def check_plan(p: LongContextPlan) -> None:
    """What the measurement needs: unpadded rows that split evenly, a baseline, and a step before the profiled one."""
    if p.steps < 2:
        raise ValueError("--max_steps must be >= 2: RSS and tokens/s from the first, the tensor peak from the last")
    if 1 not in p.sizes or not set(p.tiled_sizes) <= set(p.sizes):
        raise ValueError(f"sizes {p.sizes} need S = 1 (the baseline) and every tiled size {p.tiled_sizes}")
    if list(p.contexts) != sorted(set(p.contexts)) or not p.base_context <= p.contexts[-1]:
        raise ValueError(f"contexts {p.contexts} must ascend and reach the base context {p.base_context}")
    multiple = 8 * max(p.sizes)
    uneven = [c for c in (*p.contexts, *p.candidates()) if c % multiple]
    if uneven:
        raise ValueError(f"contexts {uneven} are not multiples of {multiple}: rows would be padded or split unevenly")
    heads, kv = p.model["num_heads"], p.model["num_kv_heads"]
    if any(heads % s or (kv % s and s % kv) for s in p.sizes):
        raise ValueError(f"{heads} heads, {kv} KV heads do not split over sizes {p.sizes}")


def tiles(p: LongContextPlan, context: int, size: int) -> int:
    """--tiled_mlp for a rank's slice of `context`: auto's tile per hidden-size tokens, at least MIN_TILES."""
    return max(MIN_TILES, math.ceil(context // size / p.model["hidden_size"]))


def grid_runs(p: LongContextPlan) -> list[tuple[int, int, int]]:
    """The memory grid's runs as (context, S, --tiled_mlp): every context x S untiled, and tiled at tiled_sizes."""
    return [(c, s, t) for c in p.contexts for s in p.sizes for t in (0, *([tiles(p, c, s)] * (s in p.tiled_sizes)))]


def write_rows(p: LongContextPlan, out: Path) -> Path:
    """`steps` text rows (one a step), each longer than the largest context, so every run trains exactly its
    context's tokens."""
    return write_long_rows(out / "rows.jsonl", rows=p.steps, words=p.contexts[-1] + 8, seed=p.seed)


# ---------------------------------------------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------------------------------------------


class LongContextRunner(Runner):
    """cpu_suite's Runner with this suite's command: train.py on S ranks under benchmarks/step_probe.py."""

    def __init__(self, plan: LongContextPlan, work: Path, model: Path, data: Path, log: Callable[[str], None]) -> None:
        super().__init__(plan, work, log)
        self.lc_plan, self.model, self.data = plan, model, data

    def train(self, what: str, context: int, size: int, tiled: int) -> dict[str, Any]:
        """One run: metrics.jsonl's records, and per rank the probe's per-step RSS and the last step's tensor peak."""
        p = self.lc_plan
        out = Path(self.result_path(f"train-{context}-s{size}-t{tiled}"))
        flags = {
            "model": self.model, "quant": "bnb", "precision": p.precision, "dataset": self.data,
            "dataset_cache_dir": self.work / "tokenized", "dataset_num_proc": 1, "context_length": context,
            "batch_size": 1, "lora_rank": p.lora_rank, "lora_alpha": p.lora_alpha, "lora_dropout": 0.0,
            "lora_target_modules": "all", "max_steps": p.steps, "lr": 1e-5, "seed": p.seed, "log_to": "stdout",
            "save_model": "false", "device": "cpu", "output_dir": out, "sequence_parallel_size": size,
            "tiled_mlp": tiled, "profile": "true", "profile_steps": f"{p.steps},{p.steps}",
        }  # fmt: skip
        cmd, result, records, ranks = probed_train(self, what, out, flags, nproc=size, steps=p.steps,
                                                    threads=p.threads)  # fmt: skip
        got = [(x["tokens"], x["label_tokens"], x["packing_efficiency"]) for x in records]
        if any(g != (context, context - 1, 1.0) for g in got):
            raise RuntimeError(f"{what}: (tokens, label tokens, packing efficiency) per step {got}, expected "
                               f"({context}, {context - 1}, 1.0): the rows did not fill the context")  # fmt: skip
        return {"context": context, "size": size, "tiled_mlp": tiled, "command": _shell(cmd), "wall_s": result.wall_s,
                "foreign_cores": result.foreign_cores, "metrics": records, "ranks": ranks}  # fmt: skip


def summary(run: dict[str, Any], steps: int) -> dict[str, Any]:
    """A run's figures: the step peaks (largest rank; RSS over steps 1 to steps-1), tokens/s, resident bytes."""
    m, ranks = run["metrics"], run["ranks"]
    timed = m[1 : steps - 1] or m[:1]
    return {
        "tensor_peak_bytes": max(r["tensor_peak_bytes"] for r in ranks),
        "rss_peak_growth_bytes": max(s["peak_rss_bytes"] - r["baseline_rss_bytes"] for r in ranks
                                     for s in r["steps"][: steps - 1]),
        "peak_rss_bytes": max(s["peak_rss_bytes"] for r in ranks for s in r["steps"][: steps - 1]),
        "tokens_per_s": median([x["tokens_per_s"] for x in timed]),
        "param_bytes_per_rank": max(m[0]["param_bytes_per_rank"]),
        "loss": [x["loss"] for x in m],
    }  # fmt: skip


def longest_context(candidates: list[int], known: dict[int, bool], fits: Callable[[int], bool]) -> int | None:
    """The longest candidate that fits, as peaks grow with the context: from the longest known fit (`known`: what
    earlier runs showed), test upward with a doubling stride until one does not fit, then bisect; `fits` launches a
    run and `known` collects its answer. None when not even the first candidate fits."""

    def test(i: int) -> bool:
        if candidates[i] not in known:
            known[candidates[i]] = fits(candidates[i])
        return known[candidates[i]]

    lo = max((i for i, c in enumerate(candidates) if known.get(c) is True), default=-1)
    hi = min((i for i, c in enumerate(candidates) if known.get(c) is False and i > lo), default=len(candidates))
    stride = 1
    while lo + stride < hi:
        if not test(lo + stride):
            hi = lo + stride
            break
        lo, stride = lo + stride, stride * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if test(mid) else (lo, mid)
    return candidates[lo] if lo >= 0 else None


# ---------------------------------------------------------------------------------------------------------------
# The suite
# ---------------------------------------------------------------------------------------------------------------

Key = tuple[int, int, int]
"""A run's (context, S, --tiled_mlp)."""


def run_long_context_suite(plan: LongContextPlan, *, cache: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every run of the long-context suite; returns results.json's content."""
    p = plan
    suite_start = time.perf_counter()
    model_plan = CpuPlan(p.model, reps=1, batch_size=1, context_length=1, warmup_steps=0, measured_steps=0,
                         threads=p.threads, launch_timeout_s=p.launch_timeout_s)  # fmt: skip
    model = ensure_model(model_plan, cache)
    build_s = time.perf_counter() - suite_start
    grid = grid_runs(p)
    runs: dict[Key, list[dict[str, Any]]] = {}

    def peak(run: dict[str, Any]) -> int:
        return summary(run, p.steps)["tensor_peak_bytes"]

    with tempfile.TemporaryDirectory(prefix="bench-long-") as tmp:
        work = Path(tmp)
        runner = LongContextRunner(p, work, model, write_rows(p, work / "data"), log)

        def train(key: Key, rep: int) -> dict[str, Any]:
            context, size, tiled = key
            what = f"{context} tokens, S={size}, --tiled_mlp {tiled} (rep {rep + 1})"
            runs.setdefault(key, []).append(runner.train(what, context, size, tiled))
            return runs[key][-1]

        log(f"{p.reps} x {len(grid)} runs of {p.steps} steps: contexts {p.contexts}, S {p.sizes}, tiled at S "
            f"{p.tiled_sizes}; then the longest context within the budget (S = 1 at {p.base_context} tokens + "
            f"{BUDGET_MARGIN:.0%})")  # fmt: skip
        for rep in range(p.reps):
            for key in grid if rep % 2 == 0 else reversed(grid):
                train(key, rep)
        base = (p.base_context, 1, 0)
        budget = int(peak(runs[base][0] if base in runs else train(base, 0)) * (1 + BUDGET_MARGIN))
        search: dict[int, dict[str, Any]] = {}
        for size in (s for s in (1, 2) if s in p.sizes):

            def peaks(size: int = size) -> dict[int, int]:
                """Untiled runs of this S so far: context -> tensor peak (the first repetition's)."""
                found = {c: peak(r[0]) for (c, s, t), r in runs.items() if (s, t) == (size, 0)}
                return dict(sorted(found.items()))

            def fits(context: int, size: int = size) -> bool:
                return peak(train((context, size, 0), 0)) <= budget

            known = {c: b <= budget for c, b in peaks().items()}
            search[size] = {"longest": longest_context(p.candidates(), known, fits), "peaks": peaks()}
        launches = runner.launches
    rows: list[dict[str, Any]] = []
    details = _rows(p, runs, search, budget, rows)
    return {
        "suite": "cpu-long-context",
        "quick": p.quick,
        "model": model_record(model, p.model),
        "settings": {
            **asdict(p),
            "candidates": p.candidates(),
            "budget_bytes": budget,
            "precision": f"--precision {p.precision}",
            "threads": f"OMP_NUM_THREADS={p.threads} // S per rank (at least 1)",
            "our_training": f"torchrun --nproc_per_node S train.py --sequence_parallel_size S --quant bnb, FSDP2 "
            f"full_shard, gradient checkpointing (the default), LoRA r{p.lora_rank} on every linear but the head, "
            f"batch 1 row of exactly the context's tokens, --max_steps {p.steps} (--profile true on step {p.steps})",
            "shapes": f"contexts {', '.join(map(str, p.contexts))}; S {', '.join(map(str, p.sizes))}; tiled MLP at S "
            f"{', '.join(map(str, p.tiled_sizes))} with --tiled_mlp max({MIN_TILES}, ceil(context / S / hidden))",
            "peaks": f"tensor bytes: the largest 'Total Allocated' of the profiler's CPU memory events over step "
            f"{p.steps}, largest rank; RSS: per rank the largest RSS during {_steps(p.steps - 1)} less the RSS just "
            f"before step 1 (benchmarks/step_probe.py), largest rank",
        },
        "rows": rows,
        "details": {**details, "runs": {"/".join(map(str, k)): [_brief(r) for r in v] for k, v in runs.items()}},
        "conditions": {"build_model_s": round(build_s, 1), **launch_conditions(launches)},
        "wall_time_s": time.perf_counter() - suite_start,
    }


def _brief(run: dict[str, Any]) -> dict[str, Any]:
    """A run's record for results.json: the probe's per-rank records, and of each step what matters here."""
    keep = ("step", "loss", "grad_norm", "tokens", "label_tokens", "tokens_per_s", "peak_memory_bytes_per_rank",
            "param_bytes_per_rank")  # fmt: skip
    out = {k: v for k, v in run.items() if k != "metrics"}
    out["steps"] = [{k: x[k] for k in keep if k in x} for x in run["metrics"]]
    return out


FIGURES = (
    ("tensor_peak_bytes", "step's peak tensor bytes per rank (largest rank)", "bytes", "lower"),
    ("rss_peak_growth_bytes", "step's peak RSS less the RSS before step 1 (largest rank)", "bytes", "lower"),
    ("tokens_per_s", "tokens/s", "tokens/s", "higher"),
)


def _label(size: int, tiled: int) -> str:
    return f"S={size}" + (f", --tiled_mlp {tiled}" if tiled else "")


def _steps(last: int) -> str:
    return "step 1" if last == 1 else f"steps 1-{last}"


def _rows(p: LongContextPlan, runs: dict[Key, list[dict[str, Any]]], search: dict[int, dict[str, Any]], budget: int,
          rows: list) -> dict[str, Any]:  # fmt: skip
    """The grid's rows against S = 1 untiled at each context, then the acceptance rows; returns the acceptance
    record, the search and every run's summary."""
    sums = {k: [summary(r, p.steps) for r in v] for k, v in runs.items()}
    for context in p.contexts:
        peer = sums[(context, 1, 0)]
        kw = {"peer_label": "S=1, untiled (the same CLI, 1 rank)",
              "note": f"1 row of {context} tokens a step, {p.precision}; {p.reps} repetition(s), medians"}  # fmt: skip
        for (c, size, tiled), ours in sums.items():
            if c != context or (size, tiled) == (1, 0) or (c, size, tiled) not in grid_runs(p):
                continue
            suffix = f"_{context}_s{size}" + ("_tiled" if tiled else "")
            for key, figure, unit, better in FIGURES:
                rows.append(row(f"{context} tokens", f"{key}{suffix}", f"{_label(size, tiled)}: {figure}", unit,
                                better, [s[key] for s in ours], [s[key] for s in peer],
                                ours_label=f"{size} rank(s), {_label(size, tiled)}", **kw))  # fmt: skip
    top = p.contexts[-1]
    acceptance = []
    tiled = tiles(p, top, 1)
    checks = [
        ("sp_peak", (top, 2, 0), SP_PEAK_BAR, f"S=2 / S=1: step's peak tensor bytes per rank, {top} tokens"),
        ("tiled_peak", (top, 1, tiled), TILED_PEAK_BAR,
         f"tiled / untiled MLP (S=1, --tiled_mlp {tiled}): step's peak tensor bytes, {top} tokens"),
    ]  # fmt: skip
    for name, ours_key, bar, figure in checks:
        if ours_key in sums:
            made = row(ACCEPTANCE, f"accept_{name}", figure, "bytes", "lower",
                       [s["tensor_peak_bytes"] for s in sums[ours_key]],
                       [s["tensor_peak_bytes"] for s in sums[(top, 1, 0)]],
                       ours_label=_label(*ours_key[1:]), peer_label="S=1, untiled")  # fmt: skip
            rows.append(made)
            acceptance.append({"name": name, "figure": figure, "ratio": made["ratio"], "bar": bar, "better": "lower",
                               "passed": made["ratio"] <= bar})  # fmt: skip
    longest = {s: search[s]["longest"] for s in search}
    if longest.get(1) and longest.get(2):
        figure = f"longest context within {fmt(budget, 'bytes')} of tensors per rank, S=2 / S=1"
        made = row(ACCEPTANCE, "accept_longest", figure, "tokens", "higher", [longest[2]], [longest[1]],
                   ours_label="S=2, untiled", peer_label="S=1, untiled")  # fmt: skip
        rows.append(made)
        acceptance.append({"name": "longest", "figure": figure, "ratio": made["ratio"], "bar": LONGEST_BAR,
                           "better": "higher", "passed": made["ratio"] >= LONGEST_BAR})  # fmt: skip
    return {"acceptance": acceptance, "search": search, "budget_bytes": budget,
            "summaries": {"/".join(map(str, k)): v for k, v in sums.items()}}  # fmt: skip


def render_long_context(results: dict[str, Any]) -> str:
    """report.render's tables, then every run's figures, the longest-context search, the acceptance and launches."""
    lines = [render(results).rstrip("\n")]
    details = results.get("details", {})
    summaries = details.get("summaries", {})
    if summaries:
        lines += ["", "### Every run", "", "| context | S | --tiled_mlp | tensor peak / rank | RSS growth | peak RSS | "
                  "tokens/s | parameter bytes / rank |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for key in sorted(summaries, key=lambda k: tuple(map(int, k.split("/")))):
            context, size, tiled = key.split("/")
            s = {f: median([x[f] for x in summaries[key]]) for f in summaries[key][0] if f != "loss"}
            cells = [fmt(s[f], "bytes") for f in ("tensor_peak_bytes", "rss_peak_growth_bytes", "peak_rss_bytes")]
            cells += [fmt(s["tokens_per_s"], "tokens/s"), fmt(s["param_bytes_per_rank"], "bytes")]
            lines.append(f"| {context} | {size} | {tiled} | {' | '.join(cells)} |")
    search, candidates = details.get("search", {}), results.get("settings", {}).get("candidates")
    if search:
        lines += ["", "### Longest context", "",
                  f"Budget: {fmt(details['budget_bytes'], 'bytes')} of tensors per rank (S=1 untiled at "
                  f"{results['settings']['base_context']} tokens + {BUDGET_MARGIN:.0%}); candidates "
                  f"{candidates[0]}-{candidates[-1]} tokens in steps of {results['settings']['search_step']}.",
                  ""]  # fmt: skip
        for size, s in search.items():
            tested = ", ".join(f"{c}: {fmt(b, 'bytes')}" for c, b in s["peaks"].items())
            last = " (the last candidate: a longer one might fit too)" if s["longest"] == candidates[-1] else ""
            lines.append(f"- S={size}: longest {s['longest'] or 'none'} tokens{last} (peaks measured: {tested}).")
    if details.get("acceptance"):
        lines += ["", "### Against the issue's bars", ""]
        for a in details["acceptance"]:
            sign = "<=" if a["better"] == "lower" else ">="
            lines.append(f"- {a['figure']}: {a['ratio']:.3f}x (bar {sign} {a['bar']}: "
                         f"{'pass' if a['passed'] else 'FAIL'}).")  # fmt: skip
    s = results.get("settings", {})
    if s.get("peaks"):
        lines += ["", f"Step peaks: {s['peaks']}."]
    lines += launches_markdown(results)
    return "\n".join(lines) + "\n"
