"""The long-context suite (--suite cpu-long-context): what --sequence_parallel_size S and --tiled_mlp save per rank,
as a grid of step peaks and the longest context in a fixed budget. benchmarks/README.md: the method and the bars.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import harness, report
from benchmarks.harness import Runner, Settings, brief, figure_rows, llama, median, row, session
from benchmarks.report import fmt

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
FULL_MODEL = llama(1024, 4, 2816, 16, 4, 8192, 2)
"""61.9M parameters, 4 KV heads (so S = 4 splits them): 91 MiB resident at S = 1, while at 4k tokens and more a
step's tensors run to hundreds of MiB of activations."""
QUICK_MODEL = llama(256, 2, 704, 8, 4, 512, 2)
FIGURES = (
    ("tensor_peak_bytes", "step's peak tensor bytes per rank (largest rank)", "bytes", "lower"),
    ("rss_peak_growth_bytes", "step's peak RSS less the RSS before step 1 (largest rank)", "bytes", "lower"),
    ("tokens_per_s", "tokens/s", "tokens/s", "higher"),
)
KEEP = ("step", "loss", "grad_norm", "tokens", "label_tokens", "tokens_per_s", "peak_memory_bytes_per_rank",
        "param_bytes_per_rank")  # fmt: skip
Key = tuple[int, int, int]
"""A run's (context, S, --tiled_mlp)."""


@dataclass
class LongContextPlan(Settings):
    model: dict[str, int]
    contexts: tuple[int, ...]
    """The memory grid's contexts, ascending; acceptance is read at the last."""
    base_context: int
    """The budget's context (S = 1, untiled) and the longest-context search's first candidate."""
    search_step: int
    sizes: tuple[int, ...]
    """--sequence_parallel_size values of the grid; S ranks each."""
    tiled_sizes: tuple[int, ...]
    reps: int
    steps: int = 2
    """Steps 1 to steps-1 give RSS and tokens/s, the last (profiled) the tensor peak."""
    seed: int = 0

    def candidates(self) -> list[int]:
        return list(range(self.base_context, self.contexts[-1] + 1, self.search_step))

    def check(self) -> None:
        """What the measurement needs: unpadded rows that split evenly, a baseline, a step before the profiled one."""
        if self.steps < 2:
            raise ValueError("--max_steps must be >= 2: RSS and tokens/s from the first, the tensor peak from the last")
        if 1 not in self.sizes or not set(self.tiled_sizes) <= set(self.sizes):
            raise ValueError(f"sizes {self.sizes} need S = 1 (the baseline) and every tiled size {self.tiled_sizes}")
        if list(self.contexts) != sorted(set(self.contexts)) or not self.base_context <= self.contexts[-1]:
            raise ValueError(f"contexts {self.contexts} must ascend and reach the base context {self.base_context}")
        multiple = 8 * max(self.sizes)
        if uneven := [c for c in (*self.contexts, *self.candidates()) if c % multiple]:
            raise ValueError(f"contexts {uneven} are not multiples of {multiple}: rows would be padded or split "
                             "unevenly")  # fmt: skip
        heads, kv = self.model["num_heads"], self.model["num_kv_heads"]
        if any(heads % s or (kv % s and s % kv) for s in self.sizes):
            raise ValueError(f"{heads} heads, {kv} KV heads do not split over sizes {self.sizes}")


def plan(*, quick: bool, **launch: Any) -> LongContextPlan:
    """The full suite (4k-16k tokens x S = 1, 2, 4 x tiled; hours) or the quick one (1024 tokens, S = 1, 2)."""
    p = (LongContextPlan(dict(QUICK_MODEL), contexts=(1024,), base_context=512, search_step=512, sizes=(1, 2),
                         tiled_sizes=(1,), reps=1, quick=True, launch_timeout_s=180.0) if quick else
         LongContextPlan(dict(FULL_MODEL), contexts=(4096, 8192, 16384), base_context=4096, search_step=512, reps=1,
                         sizes=(1, 2, 4), tiled_sizes=(1, 2, 4), retries=0, launch_timeout_s=7200.0))  # fmt: skip
    return p.configure(**launch)


def tiles(p: LongContextPlan, context: int, size: int) -> int:
    """--tiled_mlp for a rank's slice: auto's count, at least MIN_TILES (1 would repeat the untiled run)."""
    return max(MIN_TILES, math.ceil(context // size / p.model["hidden_size"]))


def grid_runs(p: LongContextPlan) -> list[Key]:
    """The memory grid: every context x S untiled, and tiled at tiled_sizes."""
    return [(c, s, t) for c in p.contexts for s in p.sizes for t in (0, *([tiles(p, c, s)] * (s in p.tiled_sizes)))]


def write_rows(p: LongContextPlan, out: Path) -> Path:
    """One text row a step, each longer than the largest context, so every run trains exactly its context."""
    return harness.write_long_rows(out / "rows.jsonl", rows=p.steps, words=p.contexts[-1] + 8, seed=p.seed)


def train(runner: Runner, what: str, model: Path, data: Path, context: int, size: int, tiled: int) -> dict[str, Any]:
    """One run on S ranks (torchrun, even for 1) under the step probe; every step must fill the context."""
    p = runner.plan
    run = runner.profiled(what, f"train-{context}-s{size}-t{tiled}", nproc=size, steps=p.steps, model=model,
                          dataset=data, context_length=context, batch_size=1, seed=p.seed,
                          sequence_parallel_size=size, tiled_mlp=tiled, fills=(context, context - 1, 1.0))  # fmt: skip
    return {"context": context, "size": size, "tiled_mlp": tiled, **run}


def summary(run: dict[str, Any], steps: int) -> dict[str, Any]:
    """A run's figures: the step peaks (largest rank; RSS over steps 1 to steps-1), tokens/s, resident bytes."""
    m = run["metrics"]
    return {**harness.step_peaks(run, steps),
            "tokens_per_s": median([x["tokens_per_s"] for x in m[1 : steps - 1] or m[:1]]),
            "param_bytes_per_rank": max(m[0]["param_bytes_per_rank"]), "loss": [x["loss"] for x in m]}  # fmt: skip


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


def run(p: LongContextPlan, *, cache: Path, model: Path | None = None) -> dict[str, Any]:
    """The grid, then the longest-context search."""
    grid, runs = grid_runs(p), {}

    def peak(run: dict[str, Any]) -> int:
        return harness.step_peaks(run, p.steps)["tensor_peak_bytes"]

    def untiled(size: int) -> dict[int, int]:
        """Untiled runs of this S so far: context -> tensor peak (the first repetition's)."""
        return dict(sorted((c, peak(r[0])) for (c, s, t), r in runs.items() if (s, t) == (size, 0)))

    with session(p, "long") as runner:
        model_dir = runner.model(p.model, cache)
        data = write_rows(p, runner.work / "data")

        def launch(key: Key, rep: int) -> dict[str, Any]:
            what = f"{key[0]} tokens, S={key[1]}, --tiled_mlp {key[2]} (rep {rep + 1})"
            runs.setdefault(key, []).append(train(runner, what, model_dir, data, *key))
            return runs[key][-1]

        print(f"{p.reps} x {len(grid)} runs of {p.steps} steps: contexts {p.contexts}, S {p.sizes}, tiled at S "
              f"{p.tiled_sizes}; then the longest context within the budget (S = 1 at {p.base_context} tokens + "
              f"{BUDGET_MARGIN:.0%})")  # fmt: skip
        harness.alternating(p.reps, grid, launch)
        base = (p.base_context, 1, 0)
        budget = int(peak(runs[base][0] if base in runs else launch(base, 0)) * (1 + BUDGET_MARGIN))
        search: dict[int, dict[str, Any]] = {}
        for size in (s for s in (1, 2) if s in p.sizes):
            known = {c: b <= budget for c, b in untiled(size).items()}
            found = longest_context(p.candidates(), known, lambda c, s=size: peak(launch((c, s, 0), 0)) <= budget)
            search[size] = {"longest": found, "peaks": untiled(size)}
        rows, details = _rows(p, runs, search, budget)
        details["runs"] = {"/".join(map(str, k)): [brief(r, KEEP) for r in v] for k, v in runs.items()}
        steps = "step 1" if p.steps == 2 else f"steps 1-{p.steps - 1}"
        return runner.results("cpu-long-context", rows, details, {
            "candidates": p.candidates(), "budget_bytes": budget,
            "our_training": f"torchrun --nproc_per_node S train.py --sequence_parallel_size S --quant bnb, FSDP2 "
                            f"full_shard, gradient checkpointing (the default), LoRA r{p.lora_rank} on every linear "
                            f"but the head, batch 1 row of exactly the context's tokens, --max_steps {p.steps} "
                            f"(--profile true on step {p.steps})",
            "shapes": f"contexts {', '.join(map(str, p.contexts))}; S {', '.join(map(str, p.sizes))}; tiled MLP at S "
                      f"{', '.join(map(str, p.tiled_sizes))} with --tiled_mlp max({MIN_TILES}, ceil(context / S / "
                      "hidden))",
            "peaks": f"tensor bytes: the largest 'Total Allocated' of the profiler's CPU memory events over step "
                     f"{p.steps}, largest rank; RSS: per rank the largest RSS during {steps} less the RSS just "
                     "before step 1 (benchmarks/probe.py), largest rank",
        }, model=harness.model_record(model_dir, p.model))  # fmt: skip


def _label(size: int, tiled: int) -> str:
    return f"S={size}" + (f", --tiled_mlp {tiled}" if tiled else "")


def _rows(p: LongContextPlan, runs: dict[Key, list[dict[str, Any]]], search: dict[int, dict[str, Any]],
          budget: int) -> tuple[list[dict], dict[str, Any]]:  # fmt: skip
    """The grid's rows against S = 1 untiled, then the acceptance rows, and the record behind them."""
    sums = {k: [summary(r, p.steps) for r in v] for k, v in runs.items()}
    rows, acceptance = [], []
    for c, size, tiled in grid_runs(p):
        if (size, tiled) != (1, 0):
            rows += figure_rows(f"{c} tokens", FIGURES, sums[(c, size, tiled)], sums[(c, 1, 0)],
                                prefix=f"{_label(size, tiled)}: ", suffix=f"_{c}_s{size}" + "_tiled" * bool(tiled),
                                ours_label=f"{size} rank(s), {_label(size, tiled)}",
                                peer_label="S=1, untiled (the same CLI, 1 rank)", note=f"1 row of {c} tokens a step, "
                                f"{p.precision}; {p.reps} repetition(s), medians")  # fmt: skip

    def accept(name: str, figure: str, unit: str, better: str, bar: float, ours: list, peer: list, label: str) -> None:
        made = row(ACCEPTANCE, f"accept_{name}", figure, unit, better, ours, peer, ours_label=label,
                   peer_label="S=1, untiled")  # fmt: skip
        rows.append(made)
        passed = made["ratio"] <= bar if better == "lower" else made["ratio"] >= bar
        acceptance.append({"name": name, "figure": figure, "ratio": made["ratio"], "bar": bar, "better": better,
                           "passed": passed})  # fmt: skip

    top, tiled = p.contexts[-1], tiles(p, p.contexts[-1], 1)
    peaks = {k: [s["tensor_peak_bytes"] for s in v] for k, v in sums.items()}
    base = peaks[(top, 1, 0)]
    if (top, 2, 0) in peaks:
        accept("sp_peak", f"S=2 / S=1: step's peak tensor bytes per rank, {top} tokens", "bytes", "lower",
               SP_PEAK_BAR, peaks[(top, 2, 0)], base, _label(2, 0))  # fmt: skip
    if (top, 1, tiled) in peaks:
        accept("tiled_peak", f"tiled / untiled MLP (S=1, --tiled_mlp {tiled}): step's peak tensor bytes, {top} tokens",
               "bytes", "lower", TILED_PEAK_BAR, peaks[(top, 1, tiled)], base, _label(1, tiled))  # fmt: skip
    longest = {s: search[s]["longest"] for s in search}
    if longest.get(1) and longest.get(2):
        accept("longest", f"longest context within {fmt(budget, 'bytes')} of tensors per rank, S=2 / S=1", "tokens",
               "higher", LONGEST_BAR, [longest[2]], [longest[1]], "S=2, untiled")  # fmt: skip
    return rows, {"acceptance": acceptance, "search": search, "budget_bytes": budget,
                  "summaries": {"/".join(map(str, k)): v for k, v in sums.items()}}  # fmt: skip


def render(results: dict[str, Any]) -> str:
    """The tables, then every run's figures, the longest-context search and the bars."""
    lines, details, settings = [], results.get("details", {}), results.get("settings", {})
    if summaries := details.get("summaries", {}):
        lines += ["", "### Every run", "", "| context | S | --tiled_mlp | tensor peak / rank | RSS growth | peak RSS | "
                  "tokens/s | parameter bytes / rank |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for key in sorted(summaries, key=lambda k: tuple(map(int, k.split("/")))):
            context, size, tiled = key.split("/")
            s = {f: median([x[f] for x in summaries[key]]) for f in summaries[key][0] if f != "loss"}
            cells = [fmt(s[f], "bytes") for f in ("tensor_peak_bytes", "rss_peak_growth_bytes", "peak_rss_bytes")]
            cells += [fmt(s["tokens_per_s"], "tokens/s"), fmt(s["param_bytes_per_rank"], "bytes")]
            lines.append(f"| {context} | {size} | {tiled} | {' | '.join(cells)} |")
    if search := details.get("search", {}):
        candidates = settings["candidates"]
        lines += ["", "### Longest context", "",
                  f"Budget: {fmt(details['budget_bytes'], 'bytes')} of tensors per rank (S=1 untiled at "
                  f"{settings['base_context']} tokens + {BUDGET_MARGIN:.0%}); candidates "
                  f"{candidates[0]}-{candidates[-1]} tokens in steps of {settings['search_step']}.",
                  ""]  # fmt: skip
        for size, s in search.items():
            tested = ", ".join(f"{c}: {fmt(b, 'bytes')}" for c, b in s["peaks"].items())
            last = " (the last candidate: a longer one might fit too)" if s["longest"] == candidates[-1] else ""
            lines.append(f"- S={size}: longest {s['longest'] or 'none'} tokens{last} (peaks measured: {tested}).")
    lines += report.acceptance("Against the issue's bars", [
        f"- {a['figure']}: {a['ratio']:.3f}x (bar {'<=' if a['better'] == 'lower' else '>='} {a['bar']}: "
        f"{report.verdict(a['passed'])})." for a in details.get("acceptance") or []])  # fmt: skip
    if settings.get("peaks"):
        lines += ["", f"Step peaks: {settings['peaks']}."]
    return report.render(results, lines)
