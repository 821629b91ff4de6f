"""The checkpoint suite (--suite cpu-checkpoint): training's stall per save with `--async_save true` against a
synchronous save of the same state.

The issue's acceptance: training's stall per save with --async_save true at most 0.3x a synchronous save's, on the
largest `--train_type full --quant none` state the CPU suite can hold. Each run is our real CLI on 2 ranks
(`torchrun train.py --save_steps K`, FSDP2, torch.distributed.checkpoint), a job of its own, in pairs that differ
in --async_save alone:

- full: `--train_type full --quant none` on a random Llama of TinyLlama's shape (the 1.1B model of --suite
  cpu-large) cut to 8 of its 22 decoder layers, 483M parameters: in bf16 its parameters, gradients and Adam moments
  are 3.9 GB over the two ranks, the checkpoint 2.9 GB, and the async side stages another 2.9 GB to host memory
  (the whole 1.1B model would hold about 15 GB with its staging copy in bf16, 31 GB in fp32: too much for a 24 GB
  machine shared with other work); in fp32 (a CPU without native bf16 matmuls) 4 of its layers, the same bytes;
- lora: `--quant bnb` LoRA r16 on every linear of the CPU suite's 171M model: the QLoRA case, where a checkpoint is
  the adapter (gathered to rank 0 and written as PEFT's safetensors before DCP starts, on both sides) and its AdamW
  state.

A save's stall, two ways, both from rank 0 (whose completion work the other rank waits for at the next collective):
- logged: the line the trainer prints at the save, `checkpoint saved to PATH in X s` (sync) or `checkpoint PATH:
  training goes on after X s` (async); printed to 2 decimals;
- step times: metrics.jsonl's `elapsed_s` (since training began, at each step's end) less the next step's own time
  (`tokens / tokens_per_s`) is the time between two steps; a save's stall is that time at its boundary, plus at the
  boundary where an async save is marked complete (rank 0 writes trainer_state.json, renames the directory, prunes
  the older checkpoint), each less the median of the boundaries where nothing was saved or completed. Taking each
  step's own time out keeps the step-to-step variance of a shared machine (several seconds here) out of a figure of
  a few seconds; `gap_stall_s` in results.json is the plain difference of the step-to-step gaps.
The async side's other cost, the background writer's CPU on the same 2 cores, shows as slower steps while a write is
in flight (`step_s_writing` against `step_s_quiet`), beside the total write time (`checkpoint saved ... in Y s`: from
the save to the step boundary where rank 0 found DCP done). Memory: benchmarks/step_probe.py's per-step peak RSS,
which counts a save in the step after it, the largest over steps and ranks, and its rise above the RSS before step 1.
Each pair's last checkpoints are read back and compared tensor by tensor (`python -m benchmarks.checkpoint_suite
compare JSON`): same seed and data, so the background-written checkpoint should equal the synchronous one bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import cpu_suite
from benchmarks.common import REPO_ROOT, base_env, median, read_json, run_metrics, worker_cmd, write_json
from benchmarks.cpu_suite import (
    CpuPlan,
    LaunchSettings,
    Runner,
    _parameters,
    ensure_model,
    launch_conditions,
    launches_markdown,
    model_record,
)
from benchmarks.data_suite import _shell
from benchmarks.report import fmt, render
from benchmarks.rows import row

CASES = ("full", "lora")
STALL_BAR = 0.3
"""The issue's bound on an async save's stall over a synchronous save's (the full case)."""
FULL_MODEL = {**cpu_suite.LARGE_MODEL, "num_layers": 8, "num_shards": 2}
"""483M parameters: TinyLlama's hidden size, heads, MLP and vocabulary, 8 of its 22 layers."""
FULL_LAYERS_FP32 = 4
"""--precision fp32 doubles every byte of the state: half the layers (308M parameters) keep it the same size."""
LORA_MODEL = cpu_suite.FULL_MODEL
"""The CPU suite's 171M model (the same directory under --cache)."""
QUICK_MODEL = cpu_suite.QUICK_MODEL
"""1.6M parameters, both cases of --quick."""
WORKER = "benchmarks.checkpoint_suite"
COMPARE_CHUNK_BYTES = 256 << 20
"""Tensor bytes read from each checkpoint at a time when comparing them."""

STEP_LINE = re.compile(r"\bstep (\d+) loss\b")
GOES_ON = re.compile(r"checkpoint (\S+?): training goes on after ([0-9.]+)s, the rest is written in the background")
SAVED = re.compile(r"checkpoint saved to (\S+) in ([0-9.]+)s")
CHECKPOINT_STEP = re.compile(r"checkpoint-(\d+)$")


@dataclass
class CheckpointPlan(LaunchSettings):
    """Sizes and repetitions of one checkpoint suite run."""

    full_model: dict[str, int]
    """scripts/make_tiny_model.py size flags of the full case's model."""
    lora_model: dict[str, int]
    """... and of the LoRA case's."""
    reps: int
    steps: int
    """--max_steps. The boundary after step 1 never saves: the baseline of the time between steps."""
    save_steps: int
    """--save_steps: saves after steps K, 2K, ...; those before the last step get a step-time measure too."""
    context_length: int
    batch_size: int
    """--batch_size per rank (--dataset dummy: every row fills the context)."""
    cases: tuple[str, ...] = CASES
    nproc: int = 2
    lora_rank: int = 16
    lora_alpha: float = 32.0
    save_total_limit: int = 1
    """Disk: the older checkpoint is pruned as the next one completes (on both sides, inside the measured stall)."""
    seed: int = 0
    retries: int = field(default=0, kw_only=True)
    """No re-measuring on contention: a shared machine's load is recorded for every launch instead (each run of the
    full case takes about 3 minutes)."""

    @property
    def saves(self) -> list[int]:
        """The steps after which a checkpoint is written."""
        return list(range(self.save_steps, self.steps + 1, self.save_steps))

    @property
    def timed_saves(self) -> list[int]:
        """Saves with a step after them, whose stall the step times show."""
        return [s for s in self.saves if s < self.steps]


def plan(*, quick: bool, threads: int, reps: int | None, idle_wait_s: float | None,
         precision: str | None = None) -> CheckpointPlan:  # fmt: skip
    """The full suite (the 483M full fine-tune and the 171M LoRA case, 6 steps saving every 2nd; about 8 minutes
    on a busy 2-core machine, the models already built) or the quick one the test runs (the 1.6M model in both
    cases; about a minute)."""
    if quick:
        p = CheckpointPlan(dict(QUICK_MODEL), dict(QUICK_MODEL), reps=1, steps=6, save_steps=2, context_length=64,
                           batch_size=1, quick=True)  # fmt: skip
        p.idle_wait_s, p.launch_timeout_s = 0.0, 180.0
    else:
        p = CheckpointPlan(dict(FULL_MODEL), dict(LORA_MODEL), reps=1, steps=6, save_steps=2, context_length=64,
                           batch_size=1)  # fmt: skip
    p.set_launch(threads=threads, precision=precision, idle_wait_s=idle_wait_s)
    if not quick and p.precision == "fp32":
        p.full_model["num_layers"] = FULL_LAYERS_FP32
    if reps is not None:
        p.reps = reps
    check_plan(p)
    return p


def check_plan(p: CheckpointPlan) -> None:
    """A quiet boundary (after step 1) for the baseline, and a save with a step after it."""
    if p.save_steps < 2:
        raise ValueError("--save_steps must be >= 2: the boundary after step 1 is the baseline of the step times")
    if not p.timed_saves:
        raise ValueError(f"--max_steps {p.steps} leaves no save before the last step (--save_steps {p.save_steps})")


# ---------------------------------------------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------------------------------------------


class CheckpointRunner(Runner):
    """cpu_suite's Runner with this suite's command: train.py on 2 ranks under benchmarks/step_probe.py, rank 0's
    stdout teed to a file by torchrun (the checkpoint lines)."""

    def __init__(self, plan: CheckpointPlan, work: Path, log: Callable[[str], None]) -> None:
        super().__init__(plan, work, log)
        self.ckpt_plan = plan

    def train(self, what: str, model: Path, case: str, *, async_save: bool) -> dict[str, Any]:
        """One run: metrics.jsonl, rank 0's checkpoint lines, the probe's per-step RSS, the last checkpoint's size."""
        p = self.ckpt_plan
        out = Path(self.result_path(f"{case}-{'async' if async_save else 'sync'}"))
        flags: dict[str, Any] = {
            "model": model, "precision": p.precision, "dataset": "dummy", "context_length": p.context_length,
            "dataset_samples": p.nproc * p.batch_size * p.steps, "batch_size": p.batch_size, "max_steps": p.steps,
            "gradient_checkpointing": "false", "lr": 1e-5, "seed": p.seed, "save_steps": p.save_steps,
            "save_total_limit": p.save_total_limit, "async_save": str(async_save).lower(), "log_to": "stdout",
            "save_model": "false", "device": "cpu", "output_dir": out,
        }  # fmt: skip
        if case == "full":
            flags |= {"train_type": "full", "quant": "none"}
        else:
            flags |= {"train_type": "lora", "quant": "bnb", "lora_rank": p.lora_rank, "lora_alpha": p.lora_alpha,
                      "lora_dropout": 0.0, "lora_target_modules": "all"}  # fmt: skip
        logs = Path(f"{out}.logs")
        probe = f"{out}.steps"
        script = ["-m", "benchmarks.step_probe", str(REPO_ROOT / "train.py"), *(f"--{k}={v}" for k, v in flags.items())]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={p.nproc}",
               f"--log-dir={logs}", "--tee=0:1", *script]  # fmt: skip
        env = base_env(max(1, p.threads // p.nproc))
        env["BENCH_STEP_RSS_FILE"] = probe
        final = out / f"checkpoint-{p.saves[-1]}"

        def reset() -> None:
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(logs, ignore_errors=True)
            for r in range(p.nproc):
                Path(f"{probe}.rank{r}.json").unlink(missing_ok=True)

        def finished() -> bool:
            return len(run_metrics(out)) == p.steps and (final / "trainer_state.json").is_file()

        result = self._go(what, [cmd], [env], reset=reset, finished=finished)
        records = run_metrics(out)
        if len(records) != p.steps:
            raise RuntimeError(f"{what}: {len(records)} metrics records, expected {p.steps}:\n{result.log}")
        stdout = sorted(logs.glob("*/attempt_*/0/stdout.log"))
        if not stdout:
            raise RuntimeError(f"{what}: torchrun wrote no stdout.log of rank 0 under {logs}:\n{result.log}")
        saves = parse_saves(stdout[-1].read_text(), async_save=async_save, expected=p.saves)
        ranks = [read_json(f"{probe}.rank{r}.json") for r in range(p.nproc)]
        for r in ranks:
            if not r["reset"] or r["baseline_rss_bytes"] is None or len(r["steps"]) != p.steps:
                raise RuntimeError(f"{what}: rank {r['rank']}'s probe did not measure every step: {r}")
        if not (final / "trainer_state.json").is_file():
            raise RuntimeError(f"{what}: {final} is not a complete checkpoint:\n{result.log}")
        left = sorted(x.name for x in out.glob("checkpoint-*"))
        if left != [final.name]:
            raise RuntimeError(f"{what}: --save_total_limit {p.save_total_limit} left {left}")
        return {
            "case": case,
            "async_save": async_save,
            "command": _shell(cmd),
            "wall_s": result.wall_s,
            "foreign_cores": result.foreign_cores,
            "metrics": records,
            "saves": saves,
            "ranks": ranks,
            "checkpoint": {"path": str(final), **tree_bytes(final)},
            "output_dir": str(out),
        }

    def compare(self, what: str, a: Path, b: Path) -> dict[str, Any]:
        """The two checkpoints' DCP tensors, read back in a process of their own and compared."""
        result = self.result_path("compare")
        args = {"a": str(a), "b": str(b), "result": result}
        self._go(what, [worker_cmd(WORKER, "compare", args)], [base_env(self.plan.threads)])
        return read_json(result)


def tree_bytes(path: Path) -> dict[str, int]:
    """Bytes of the files under a checkpoint directory, all of them and those of DCP's `sharded/`."""
    total = sharded = files = 0
    for root, _, names in os.walk(path):
        for name in names:
            size = (Path(root) / name).stat().st_size
            total, files = total + size, files + 1
            if Path(root).relative_to(path).parts[:1] == ("sharded",):
                sharded += size
    return {"bytes": total, "sharded_bytes": sharded, "files": files}


def parse_saves(text: str, *, async_save: bool, expected: list[int]) -> list[dict[str, Any]]:
    """Rank 0's checkpoint lines, per save: the logged seconds, and after which step each was printed."""
    after = 0
    saves: dict[int, dict[str, Any]] = {}
    for line in text.splitlines():
        if step := STEP_LINE.search(line):
            after = int(step[1])
        elif hit := GOES_ON.search(line) or SAVED.search(line):
            number = CHECKPOINT_STEP.search(hit[1])
            if number is None:
                raise RuntimeError(f"a checkpoint line names no checkpoint-STEP directory: {line!r}")
            entry = saves.setdefault(int(number[1]), {"step": int(number[1])})
            if hit.re is GOES_ON:
                entry |= {"goes_on_s": float(hit[2]), "printed_after_step": after}
            else:
                entry |= {"saved_s": float(hit[2]), "completed_after_step": after}
    found = sorted(saves)
    want = {"goes_on_s", "saved_s"} if async_save else {"saved_s"}
    incomplete = [s for s, e in saves.items() if not want <= set(e) or (not async_save and "goes_on_s" in e)]
    if found != expected or incomplete:
        side = "async" if async_save else "sync"
        raise RuntimeError(f"{side} run: checkpoint lines for steps {found} (incomplete: {incomplete}), expected "
                           f"{expected}, each with {sorted(want)}:\n{text[-3000:]}")  # fmt: skip
    return [saves[s] for s in found]


# ---------------------------------------------------------------------------------------------------------------
# The figures of a run
# ---------------------------------------------------------------------------------------------------------------


def analyse(run: dict[str, Any], steps: int) -> dict[str, Any]:
    """A run's figures: each save's stall both ways and its write time, step times with and without a background
    write in flight, peak RSS. Boundary b is the time between the end of step b and the start of step b + 1."""
    m = {r["step"]: r for r in run["metrics"]}
    own = {s: m[s]["tokens"] / m[s]["tokens_per_s"] for s in m}
    gap = {b: m[b + 1]["elapsed_s"] - m[b]["elapsed_s"] for b in range(1, steps)}
    between = {b: gap[b] - own[b + 1] for b in gap}
    saved_at = {s["step"] for s in run["saves"]}
    busy = saved_at | {s["completed_after_step"] for s in run["saves"]}
    quiet = [b for b in between if b not in busy]
    base, base_gap = median([between[b] for b in quiet]), median([gap[b] for b in quiet])
    writing: set[int] = set()
    saves = []
    for s in run["saves"]:
        n, done = s["step"], s["completed_after_step"]
        entry = {**s, "logged_stall_s": s["goes_on_s"] if run["async_save"] else s["saved_s"]}
        if n < steps:
            # The boundary where rank 0 marked an async save complete, unless that is another save's (then its
            # stall holds it) or the end of training.
            extra = [done] if done not in saved_at and done < steps else []
            entry["steps_stall_s"] = sum(between[b] - base for b in [n, *extra])
            entry["gap_stall_s"] = sum(gap[b] - base_gap for b in [n, *extra])
        if run["async_save"]:
            writing.update(range(n + 1, min(done, steps) + 1))
        saves.append(entry)
    timed = [x for x in saves if "steps_stall_s" in x]
    later = range(2, steps + 1)
    ranks = run["ranks"]
    peak = [max(x["peak_rss_bytes"] for x in r["steps"]) for r in ranks]
    return {
        "saves": saves,
        "stall_logged_s": median([x["logged_stall_s"] for x in saves]),
        "stall_steps_s": median([x["steps_stall_s"] for x in timed]),
        "stall_gap_s": median([x["gap_stall_s"] for x in timed]),
        "write_s": median([x["saved_s"] for x in saves]),
        "between_steps_quiet_s": base,
        "step_s": median([own[s] for s in later]),
        "step_s_writing": median([own[s] for s in later if s in writing]) if writing & set(later) else None,
        "step_s_quiet": median([own[s] for s in later if s not in writing]) if set(later) - writing else None,
        "steps_writing": sorted(writing),
        "peak_rss_bytes": max(peak),
        "peak_rss_bytes_per_rank": peak,
        "rss_rise_bytes": max(p - r["baseline_rss_bytes"] for p, r in zip(peak, ranks, strict=True)),
        "checkpoint_bytes": run["checkpoint"]["bytes"],
        "training_s": m[steps]["elapsed_s"],
        "trainable_parameters": m[1]["trainable_parameters"],
    }


def _brief(run: dict[str, Any]) -> dict[str, Any]:
    """A run's record for results.json: of each step what matters here."""
    keep = ("step", "loss", "tokens", "tokens_per_s", "elapsed_s", "peak_memory_bytes_per_rank")
    out = {k: v for k, v in run.items() if k not in ("metrics", "saves")}
    out["steps"] = [{k: x[k] for k in keep if k in x} for x in run["metrics"]]
    return out


# ---------------------------------------------------------------------------------------------------------------
# The suite
# ---------------------------------------------------------------------------------------------------------------


def run_checkpoint_suite(plan: CheckpointPlan, *, cache: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every run of the checkpoint suite; returns results.json's content."""
    p = plan
    suite_start = time.perf_counter()
    models = {}
    for case in p.cases:
        sizes = p.full_model if case == "full" else p.lora_model
        model_plan = CpuPlan(sizes, reps=1, batch_size=1, context_length=1, warmup_steps=0, measured_steps=0,
                             threads=p.threads, launch_timeout_s=p.launch_timeout_s)  # fmt: skip
        models[case] = ensure_model(model_plan, cache)
    build_s = time.perf_counter() - suite_start
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {c: {"sync": [], "async": []} for c in p.cases}
    compared: dict[str, list[dict[str, Any]]] = {c: [] for c in p.cases}
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        runner = CheckpointRunner(p, Path(tmp), log)
        log(f"{p.reps} x sync and async saves ({', '.join(p.cases)}): {p.nproc} ranks x {p.batch_size} row(s) of "
            f"{p.context_length} tokens, {p.steps} steps, --save_steps {p.save_steps}")  # fmt: skip
        for rep in range(p.reps):
            for case in p.cases:
                order = (False, True) if rep % 2 == 0 else (True, False)
                made = {}
                for async_save in order:
                    side = "async" if async_save else "sync"
                    what = f"{case} --async_save {str(async_save).lower()} (rep {rep + 1})"
                    made[side] = runner.train(what, models[case], case, async_save=async_save)
                    runs[case][side].append(made[side])
                a, b = (Path(made[side]["checkpoint"]["path"]) / "sharded" for side in ("async", "sync"))
                compared[case].append(runner.compare(f"{case}: compare the async and sync checkpoints", a, b))
                for side in made.values():
                    shutil.rmtree(side["output_dir"], ignore_errors=True)  # gigabytes on the full case
        launches = runner.launches
    rows: list[dict[str, Any]] = []
    details = _rows(p, models, runs, compared, rows)
    full = models.get("full", models[p.cases[0]])
    briefs = {c: {side: [_brief(r) for r in v] for side, v in sides.items()} for c, sides in runs.items()}
    return {
        "suite": "cpu-checkpoint",
        "quick": p.quick,
        "model": model_record(full, p.full_model),
        "models": {c: {"path": str(m), "parameters": _parameters(m)} for c, m in models.items()},
        "settings": {
            **asdict(p),
            "saves": p.saves,
            "precision": f"--precision {p.precision} (parameters, gradients and Adam moments in {p.precision})",
            "threads": f"OMP_NUM_THREADS={max(1, p.threads // p.nproc)} per rank",
            "our_training": f"torchrun --nproc_per_node {p.nproc} train.py, FSDP2, --dataset dummy, --batch_size "
            f"{p.batch_size} x {p.context_length} tokens, --max_steps {p.steps} --save_steps {p.save_steps} "
            f"--save_total_limit {p.save_total_limit}, gradient checkpointing off; full: --train_type full --quant "
            f"none; lora: --quant bnb, LoRA r{p.lora_rank} on every linear; the two sides differ in --async_save",
            "stalls": "logged: rank 0's checkpoint line at the save; step times: metrics.jsonl's elapsed_s less the "
            "next step's tokens / tokens_per_s at the save's boundary (and where an async save is marked complete), "
            "less the median of the boundaries without either",
        },
        "rows": rows,
        "details": {**details, "runs": briefs},
        "conditions": {"build_model_s": round(build_s, 1), **launch_conditions(launches)},
        "wall_time_s": time.perf_counter() - suite_start,
    }


def _rows(p: CheckpointPlan, models: dict[str, Path], runs: dict[str, dict[str, list[dict[str, Any]]]],
          compared: dict[str, list[dict[str, Any]]], rows: list) -> dict[str, Any]:  # fmt: skip
    """Each case's rows, async against sync; returns the acceptance record and every run's figures."""
    summaries = {c: {s: [analyse(r, p.steps) for r in v] for s, v in sides.items()} for c, sides in runs.items()}
    timed = ", ".join(str(s) for s in p.timed_saves)
    figures = (
        ("stall_logged_s", "training's stall per save, as logged (async: until training goes on)", "s"),
        ("stall_steps_s", f"training's stall per save, from the step times (saves after steps {timed})", "s"),
        ("write_s", "seconds from a save until its checkpoint is complete", "s"),
        ("step_s", f"seconds per step, steps 2-{p.steps}", "s"),
        ("peak_rss_bytes", "peak RSS during training and saves, largest rank", "bytes"),
        ("rss_rise_bytes", "peak RSS less the RSS before step 1, largest rank", "bytes"),
        ("checkpoint_bytes", "checkpoint size on disk", "bytes"),
    )
    acceptance = []
    for case, sides in summaries.items():
        ours, peer = sides["async"], sides["sync"]
        params = ours[0]["trainable_parameters"]
        what = "--train_type full --quant none" if case == "full" else f"--quant bnb, LoRA r{p.lora_rank}"
        shape = f"{what}, {params:,} trainable of {_parameters(models[case]):,} parameters, {p.nproc} ranks, FSDP2"
        kw = {"ours_label": f"--async_save true; {shape}", "peer_label": "--async_save false (the same CLI)",
              "note": f"{case}: saves after steps {', '.join(map(str, p.saves))} of {p.steps}; {p.reps} repetition(s), "
                      f"medians"}  # fmt: skip
        made = {}
        for key, figure, unit in figures:
            made[key] = row(case, f"{key}_{case}", figure, unit, "lower", [s[key] for s in ours],
                            [s[key] for s in peer], **kw)  # fmt: skip
            rows.append(made[key])
        same = [c["identical"] for c in compared[case]]
        ratios = {k: made[f"stall_{k}_s"]["ratio"] for k in ("logged", "steps")}
        bar = STALL_BAR if case == "full" else None
        acceptance.append({
            "case": case,
            "stall_ratio": ratios,
            "stall_s": {side: {k: made[f"stall_{k}_s"][side] for k in ratios} for side in ("ours", "peer")},
            "stall_bar": bar,
            "checkpoint_bytes": {"async": made["checkpoint_bytes"]["ours"], "sync": made["checkpoint_bytes"]["peer"]},
            "checkpoints_identical": all(same),
            "passed": all(same) and (bar is None or all(r <= bar for r in ratios.values())),
        })  # fmt: skip
    return {"acceptance": acceptance, "summaries": summaries, "compared": compared}


def render_checkpoint(results: dict[str, Any]) -> str:
    """report.render's tables, then the acceptance checks, every save, and the launches."""
    lines = [render(results).rstrip("\n")]
    details = results.get("details", {})
    if details.get("acceptance"):
        lines += ["", "### Acceptance", ""]
        for a in details["acceptance"]:
            r, s = a["stall_ratio"], a["stall_s"]
            bar = f" (bar {a['stall_bar']:.2f}x: {'pass' if a['passed'] else 'FAIL'})" if a["stall_bar"] else ""
            same = "identical" if a["checkpoints_identical"] else "DIFFERENT"
            size = a["checkpoint_bytes"]["async"]
            lines.append(f"- {a['case']}: stall per save, async / sync: logged {s['ours']['logged']:.2f} / "
                         f"{s['peer']['logged']:.2f} s = {r['logged']:.3f}x, from the step times "
                         f"{s['ours']['steps']:.2f} / {s['peer']['steps']:.2f} s = {r['steps']:.3f}x{bar}; "
                         f"checkpoint {fmt(size, 'bytes')} ({size:,.0f} bytes), async and sync checkpoints "
                         f"{same}.")  # fmt: skip
    summaries = details.get("summaries", {})
    if summaries:
        head = "| run | save after step | logged stall | stall from step times | complete after | found after step |"
        lines += ["", "### Saves", "", head, "|---|---:|---:|---:|---:|---:|"]
        for case, sides in summaries.items():
            for side, reps in sides.items():
                for i, s in enumerate(reps):
                    for x in s["saves"]:
                        steps = f"{x['steps_stall_s']:.2f} s" if "steps_stall_s" in x else "-"
                        lines.append(f"| {case} {side} (rep {i + 1}) | {x['step']} | {x['logged_stall_s']:.2f} s | "
                                     f"{steps} | {x['saved_s']:.2f} s | {x['completed_after_step']} |")  # fmt: skip
        lines += ["", "Steps while a background write is in flight (async) against the others, and the rest:", ""]
        for case, sides in summaries.items():
            for i, s in enumerate(sides["async"]):
                if s["step_s_writing"] is not None and s["step_s_quiet"] is not None:
                    lines.append(f"- {case} (rep {i + 1}): steps {s['steps_writing']} {s['step_s_writing']:.2f} s "
                                 f"against {s['step_s_quiet']:.2f} s (sync run: "
                                 f"{sides['sync'][i]['step_s']:.2f} s a step).")  # fmt: skip
    lines += launches_markdown(results)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# Worker: compare two DCP checkpoints (`python -m benchmarks.checkpoint_suite compare JSON`)
# ---------------------------------------------------------------------------------------------------------------


def compare(args: dict[str, Any]) -> None:
    """Whether two DCP directories hold the same tensors, bit for bit; read in chunks of COMPARE_CHUNK_BYTES."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    metas = []
    for path in (args["a"], args["b"]):
        items = dcp.FileSystemReader(path).read_metadata().state_dict_metadata.items()
        metas.append({k: v for k, v in items if isinstance(v, TensorStorageMetadata)})
    a, b = metas
    layout = {k: (tuple(v.size), v.properties.dtype) for k, v in a.items()}
    same_layout = layout == {k: (tuple(v.size), v.properties.dtype) for k, v in b.items()}
    size = {k: v.size.numel() * v.properties.dtype.itemsize for k, v in a.items()}
    chunks: list[list[str]] = [[]]
    for key in sorted(layout) if same_layout else []:
        if chunks[-1] and sum(size[k] for k in chunks[-1]) + size[key] > COMPARE_CHUNK_BYTES:
            chunks.append([])
        chunks[-1].append(key)
    differing, max_diff = [], 0.0
    for chunk in filter(None, chunks):
        loaded = []
        for path in (args["a"], args["b"]):
            state = {k: torch.empty(layout[k][0], dtype=layout[k][1]) for k in chunk}
            dcp.load(state, checkpoint_id=path, no_dist=True)
            loaded.append(state)
        for k in chunk:
            x, y = loaded[0][k], loaded[1][k]
            if not torch.equal(x, y):
                differing.append(k)
                max_diff = max(max_diff, (x.double() - y.double()).abs().max().item())
    write_json(args["result"], {
        "tensors": len(a), "tensor_bytes": sum(size.values()), "same_layout": same_layout, "differing": differing,
        "max_abs_diff": max_diff, "identical": same_layout and not differing,
    })  # fmt: skip


WORKERS = {"compare": compare}


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in WORKERS:
        raise SystemExit(f"usage: python -m benchmarks.checkpoint_suite {{{','.join(WORKERS)}}} JSON_ARGS")
    WORKERS[sys.argv[1]](json.loads(sys.argv[2]))
