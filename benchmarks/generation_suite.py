"""The generation suite (--suite cpu-generation): GRPO's sampling with the weights gathered against sharded.

The issue asks for generation tokens/s both ways: through the sharded model (`--generation_mode sharded`, the default:
every decoded token gathers every unit's shards, ranks in lockstep) and with every unit gathered once per micro-batch
(`--generation_mode gathered`: each rank then holds the whole packed model while it samples and decodes on its own).
Each run is our real CLI, `torchrun --nproc_per_node 2 train.py --objective grpo --quant bnb`, FSDP2, on a random
Llama (cpu_suite's model: 171M parameters; `--quick`: its 2-layer one) and data/grpo_tiny.jsonl's prompts, under
benchmarks/cli_probe.py for each rank's peak RSS.

Figures per run, gathered beside sharded from the same repetition (their order reversed every other repetition):
- `sampling/tokens_per_s` from metrics.jsonl: the completion tokens a rank sampled per second of sampling, the median
  of steps 2 to S (step 1 warms up);
- the whole step's tokens/s (sampling, scoring, the loss's forward and backward);
- the peak RSS per rank over the run (largest rank): what holding the gathered model costs.
A random model seldom draws an end token, so completions run to --max_completion_length either way; both modes
sample the same completions (the same seeds) and train the same steps, which the suite checks on every step's reward,
completion length, entropy and loss before it reports anything.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, median
from benchmarks.cpu_suite import (
    FULL_MODEL,
    QUICK_MODEL,
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

MODES = ("sharded", "gathered")
"""--generation_mode values; gathered is `ours`, sharded (the default) the `peer` column."""
SAME = ("reward", "completions/mean_length", "entropy", "loss")
"""Per-step figures both modes must share (the same completions, drawn from the same distributions, trained the
same)."""
PROMPTS = REPO_ROOT / "data" / "grpo_tiny.jsonl"
REWARD = "qlora_fsdp.reward_functions:brief"


@dataclass
class GenerationPlan(LaunchSettings):
    """Sizes and repetitions of one generation suite run."""

    model: dict[str, int]
    """scripts/make_tiny_model.py size flags."""
    reps: int
    steps: int
    """--max_steps; step 1 is left out of the medians (warm-up)."""
    prompts_per_rank: int = 2
    num_generations: int = 4
    max_completion_length: int = 64
    nproc: int = 2
    lora_rank: int = 16
    lora_alpha: float = 32.0


def plan(*, quick: bool, threads: int, reps: int | None, idle_wait_s: float | None,
         precision: str | None = None) -> GenerationPlan:  # fmt: skip
    """The full suite (171M model, 3 repetitions of 4 steps, 8 completions of 64 tokens a rank a step; minutes on
    2 cores) or the quick one the test runs (2-layer model, one repetition of 2 steps, 8 tokens)."""
    if quick:
        p = GenerationPlan(dict(QUICK_MODEL), reps=1, steps=2, max_completion_length=8, quick=True)
        p.idle_wait_s = 0.0
    else:
        p = GenerationPlan(dict(FULL_MODEL), reps=3, steps=4)
    p.set_launch(threads=threads, precision=precision, idle_wait_s=idle_wait_s)
    if reps is not None:
        p.reps = reps
    return p


def _run(runner: Runner, p: GenerationPlan, model: Path, mode: str, rep: int) -> dict[str, Any]:
    """One training run: its per-step records and each rank's peak RSS."""
    flags = {
        "dataset": PROMPTS, "objective": "grpo", "reward_funcs": REWARD, "generation_mode": mode,
        "num_generations": p.num_generations, "max_completion_length": p.max_completion_length,
        "context_length": p.max_completion_length + 64, "batch_size": p.prompts_per_rank * p.num_generations,
        "dataset_samples": 0, "max_steps": p.steps, "seed": 0,
    }  # fmt: skip
    records, peaks = runner.train_cli(f"--generation_mode {mode} (rep {rep + 1})", model, "bnb", nproc=p.nproc,
                                      version=2, flags=flags)  # fmt: skip
    return {"mode": mode, "steps": records, "peak_rss_bytes": peaks}


def _check_same(runs: dict[str, list[dict[str, Any]]]) -> None:
    """Both modes sampled the same completions and trained the same: every step's SAME figures agree."""
    for a, b in zip(runs["sharded"], runs["gathered"], strict=True):
        for x, y in zip(a["steps"], b["steps"], strict=True):
            for key in SAME:
                if not math.isclose(x[key], y[key], rel_tol=1e-5, abs_tol=1e-7):
                    raise RuntimeError(f"step {x['step']}: {key} {x[key]} sharded, {y[key]} gathered: the modes "
                                       "did not sample or train the same")  # fmt: skip


def summary(run: dict[str, Any]) -> dict[str, float]:
    timed = run["steps"][1:] or run["steps"]
    return {
        "sampling_tokens_per_s": median([x["sampling/tokens_per_s"] for x in timed]),
        "step_tokens_per_s": median([x["tokens_per_s"] for x in timed]),
        "peak_rss_bytes": float(max(run["peak_rss_bytes"])),
        "completion_tokens": median([x["completions/mean_length"] for x in timed]),
    }


FIGURES = (
    ("sampling_tokens_per_s", "sampling: completion tokens per second per rank", "tokens/s", "higher"),
    ("step_tokens_per_s", "whole step: tokens per second", "tokens/s", "higher"),
    ("peak_rss_bytes", "peak RSS per rank (largest rank)", "bytes", "lower"),
)


def run_generation_suite(plan: GenerationPlan, *, cache: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every run of the generation suite; returns results.json's content."""
    p = plan
    suite_start = time.perf_counter()
    # cpu_suite's plan for its model builder and Runner; a launch is finished when it has logged warmup + measured.
    model_plan = CpuPlan(p.model, reps=1, batch_size=p.nproc, context_length=1, warmup_steps=1,
                         measured_steps=p.steps - 1,
                         threads=p.threads, launch_timeout_s=p.launch_timeout_s, precision=p.precision,
                         lora_rank=p.lora_rank, lora_alpha=p.lora_alpha)  # fmt: skip
    model = ensure_model(model_plan, cache)
    build_s = time.perf_counter() - suite_start
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="bench-generation-") as tmp:
        runner = Runner(model_plan, Path(tmp), log)
        log(f"{p.reps} x {len(MODES)} runs of {p.steps} GRPO steps on {p.nproc} ranks")
        for rep in range(p.reps):
            for mode in MODES if rep % 2 == 0 else reversed(MODES):
                runs[mode].append(_run(runner, p, model, mode, rep))
        launches = runner.launches
    _check_same(runs)
    sums = {mode: [summary(r) for r in runs[mode]] for mode in MODES}
    note = (f"{p.nproc} ranks x {p.prompts_per_rank} prompts x {p.num_generations} completions of "
            f"{p.max_completion_length} tokens a step, {p.precision}; {p.reps} repetition(s), medians")  # fmt: skip
    rows = [row("GRPO sampling", key, figure, unit, better, [s[key] for s in sums["gathered"]],
                [s[key] for s in sums["sharded"]], ours_label="--generation_mode gathered",
                peer_label="--generation_mode sharded (the default)", note=note)
            for key, figure, unit, better in FIGURES]  # fmt: skip
    return {
        "suite": "cpu-generation",
        "quick": p.quick,
        "model": model_record(model, p.model),
        "settings": {
            **asdict(p),
            "precision": f"--precision {p.precision}",
            "threads": f"OMP_NUM_THREADS={p.threads} // {p.nproc} per rank",
            "our_training": f"torchrun --nproc_per_node {p.nproc} train.py --objective grpo --quant bnb, FSDP2 "
            f"full_shard, --reward_funcs {REWARD}, LoRA r{p.lora_rank} on every linear but the head, --batch_size "
            f"{p.prompts_per_rank * p.num_generations}, --max_steps {p.steps} (step 1 left out of the medians)",
        },
        "rows": rows,
        "details": {"summaries": sums, "steps": {m: [r["steps"] for r in runs[m]] for m in MODES}},
        "conditions": {"build_model_s": round(build_s, 1), **launch_conditions(launches)},
        "wall_time_s": time.perf_counter() - suite_start,
    }


def render_generation(results: dict[str, Any]) -> str:
    """report.render's table, the completions each mode sampled, and the launches."""
    lines = [render(results).rstrip("\n")]
    sums = results.get("details", {}).get("summaries", {})
    if sums:
        tokens = {m: median([s["completion_tokens"] for s in v]) for m, v in sums.items()}
        each = ", ".join(f"{m} {t:g}" for m, t in tokens.items())
        lines += ["", f"Tokens per completion (median): {each}; every step's reward, completion length, entropy and "
                  "loss agree between the modes (checked)."]  # fmt: skip
    lines += launches_markdown(results)
    return "\n".join(lines) + "\n"
