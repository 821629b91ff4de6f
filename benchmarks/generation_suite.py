"""The generation suite (--suite cpu-generation): GRPO sampling, `--generation_mode gathered` (ours) against sharded
(the default), 2 ranks; both modes must sample and train the same, checked on every step first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import harness, report
from benchmarks.harness import FULL_MODEL, QUICK_MODEL, Settings, alternating, figure_rows, median, session

MODES = ("sharded", "gathered")
"""--generation_mode values; gathered is `ours`, sharded (the default) the `peer` column."""
SAME = ("reward", "completions/mean_length", "entropy", "loss")
"""Per-step figures both modes must share (the same completions, from the same distributions, trained the same)."""
PROMPTS = harness.REPO_ROOT / "data" / "grpo_tiny.jsonl"
REWARD = "qlora_fsdp.reward_functions:brief"
FIGURES = (
    ("sampling_tokens_per_s", "sampling: completion tokens per second per rank", "tokens/s", "higher"),
    ("step_tokens_per_s", "whole step: tokens per second", "tokens/s", "higher"),
    ("peak_rss_bytes", "peak RSS per rank (largest rank)", "bytes", "lower"),
)


@dataclass
class GenerationPlan(Settings):
    model: dict[str, int]
    reps: int
    steps: int
    """--max_steps; step 1 is left out of the medians (warm-up)."""
    prompts_per_rank: int = 2
    num_generations: int = 4
    max_completion_length: int = 64
    nproc: int = 2


def plan(*, quick: bool, **launch: Any) -> GenerationPlan:
    """The full suite (171M model, 3 x 4 steps, 64-token completions) or the quick one (2 layers, 8 tokens)."""
    sizes = dict(reps=1, steps=2, max_completion_length=8) if quick else dict(reps=3, steps=4)
    return GenerationPlan(dict(QUICK_MODEL if quick else FULL_MODEL), quick=quick, **sizes).configure(**launch)


def check_same(runs: dict[str, list[dict[str, Any]]]) -> None:
    """Both modes sampled the same completions and trained the same: every step's SAME figures agree."""
    for a, b in zip(runs["sharded"], runs["gathered"], strict=True):
        for x, y in zip(a["steps"], b["steps"], strict=True):
            if key := next((k for k in SAME if not math.isclose(x[k], y[k], rel_tol=1e-5, abs_tol=1e-7)), None):
                raise RuntimeError(f"step {x['step']}: {key} {x[key]} sharded, {y[key]} gathered: the modes did not "
                                   "sample or train the same")  # fmt: skip


def summary(run: dict[str, Any]) -> dict[str, float]:
    timed = run["steps"][1:] or run["steps"]
    return {"sampling_tokens_per_s": median([x["sampling/tokens_per_s"] for x in timed]),
            "step_tokens_per_s": median([x["tokens_per_s"] for x in timed]),
            "peak_rss_bytes": float(max(run["peak_rss_bytes"])),
            "completion_tokens": median([x["completions/mean_length"] for x in timed])}  # fmt: skip


def run(p: GenerationPlan, *, cache: Path, model: Path | None = None) -> dict[str, Any]:
    batch = p.prompts_per_rank * p.num_generations
    with session(p, "generation") as runner:
        model_dir = runner.model(p.model, cache)
        print(f"{p.reps} x {len(MODES)} runs of {p.steps} GRPO steps on {p.nproc} ranks")

        def train(mode: str, rep: int) -> dict[str, Any]:
            flags = runner.flags(
                f"train-{mode}", model=model_dir, quant="bnb", fsdp_version=2, dataset=PROMPTS, objective="grpo",
                reward_funcs=REWARD, generation_mode=mode, num_generations=p.num_generations, batch_size=batch,
                max_completion_length=p.max_completion_length, context_length=p.max_completion_length + 64,
                dataset_samples=0, gradient_checkpointing="false", max_steps=p.steps, seed=0)  # fmt: skip
            done = runner.train(f"--generation_mode {mode} (rep {rep + 1})", flags, nproc=p.nproc, steps=p.steps)
            return {"steps": done["metrics"], "peak_rss_bytes": done["exit_peak_rss_bytes"]}

        runs = alternating(p.reps, MODES, train)
        check_same(runs)
        sums = {mode: [summary(r) for r in runs[mode]] for mode in MODES}
        note = (f"{p.nproc} ranks x {p.prompts_per_rank} prompts x {p.num_generations} completions of "
                f"{p.max_completion_length} tokens a step, {p.precision}; {p.reps} repetition(s), medians")  # fmt: skip
        rows = figure_rows("GRPO sampling", FIGURES, sums["gathered"], sums["sharded"], note=note,
                           ours_label="--generation_mode gathered",
                           peer_label="--generation_mode sharded (the default)")  # fmt: skip
        return runner.results("cpu-generation", rows, {
            "summaries": sums, "steps": {m: [r["steps"] for r in runs[m]] for m in MODES}}, {
            "our_training": f"torchrun --nproc_per_node {p.nproc} train.py --objective grpo --quant bnb, FSDP2 "
                            f"full_shard, --reward_funcs {REWARD}, LoRA r{p.lora_rank} on every linear but the head, "
                            f"--batch_size {batch}, --max_steps {p.steps} (step 1 left out of the medians)",
        }, model=harness.model_record(model_dir, p.model))  # fmt: skip


def render(results: dict[str, Any]) -> str:
    """The table, then the completions each mode sampled."""
    sums = results.get("details", {}).get("summaries", {})
    each = ", ".join(f"{m} {median([s['completion_tokens'] for s in v]):g}" for m, v in sums.items())
    line = f"Tokens per completion (median): {each}; every step's reward, completion length, entropy and loss agree "
    return report.render(results, ["", line + "between the modes (checked)."] if sums else [])
