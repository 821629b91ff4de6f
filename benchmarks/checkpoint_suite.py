"""The checkpoint suite (--suite cpu-checkpoint): training's stall per save, `--async_save true` against false, 2
ranks, a 483M full fine-tune and a LoRA case (bar: async <= 0.3x sync, full case). benchmarks/README.md: the method.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import harness, report
from benchmarks.harness import Runner, Settings, brief, keyed_rows, median, session
from benchmarks.report import fmt

CASES = ("full", "lora")
STALL_BAR = 0.3
"""The issue's bound on an async save's stall over a synchronous save's (the full case)."""
FULL_MODEL = {**harness.LARGE_MODEL, "num_layers": 8, "num_shards": 2}
"""483M parameters: TinyLlama's hidden size, heads, MLP and vocabulary, 8 of its 22 layers (3.9 GB of state in bf16
over the two ranks, plus the async side's staging copy: what a 24 GB machine shared with other work holds)."""
FULL_LAYERS_FP32 = 4
"""--precision fp32 doubles every byte of the state: half the layers keep it the same size."""
GOES_ON = re.compile(r"checkpoint (\S+?): training goes on after ([0-9.]+)s, the rest is written in the background")
SAVED = re.compile(r"checkpoint saved to (\S+) in ([0-9.]+)s")
KEEP = ("step", "loss", "tokens", "tokens_per_s", "elapsed_s", "peak_memory_bytes_per_rank")


@dataclass
class CheckpointPlan(Settings):
    full_model: dict[str, int]
    lora_model: dict[str, int]
    reps: int
    steps: int
    """--max_steps. The boundary after step 1 never saves: the baseline of the time between steps."""
    save_steps: int
    context_length: int
    batch_size: int
    """Per rank (--dataset dummy: every row fills the context)."""
    cases: tuple[str, ...] = CASES
    nproc: int = 2
    save_total_limit: int = 1
    """The older checkpoint is pruned as the next one completes (on both sides, inside the measured stall)."""
    seed: int = 0

    @property
    def saves(self) -> list[int]:
        return list(range(self.save_steps, self.steps + 1, self.save_steps))

    @property
    def timed_saves(self) -> list[int]:
        """Saves with a step after them, whose stall the step times show."""
        return [s for s in self.saves if s < self.steps]

    def check(self) -> None:
        """A quiet boundary (after step 1) for the baseline, and a save with a step after it."""
        if self.save_steps < 2:
            raise ValueError("--save_steps must be >= 2: the boundary after step 1 is the baseline of the step times")
        if not self.timed_saves:
            raise ValueError(f"--max_steps {self.steps} leaves no save before the last step (--save_steps "
                             f"{self.save_steps})")  # fmt: skip


def plan(*, quick: bool, **launch: Any) -> CheckpointPlan:
    """The full suite (483M full, 171M LoRA) or the quick one (1.6M both); a full run is minutes, so no retry."""
    models = (harness.QUICK_MODEL, harness.QUICK_MODEL) if quick else (FULL_MODEL, harness.FULL_MODEL)
    p = CheckpointPlan(*map(dict, models), reps=1, steps=6, save_steps=2, context_length=64, batch_size=1,
                       quick=quick, retries=0, launch_timeout_s=180.0 if quick else 600.0)  # fmt: skip
    p.configure(**launch)
    if not quick and p.precision == "fp32":
        p.full_model["num_layers"] = FULL_LAYERS_FP32
    return p


def train(runner: Runner, what: str, model: Path, case: str, *, async_save: bool) -> dict[str, Any]:
    """One run under the step probe, rank 0's stdout teed by torchrun; its saves and last checkpoint."""
    p, full = runner.plan, case == "full"
    flags = runner.flags(
        f"{case}-{'async' if async_save else 'sync'}", model=model, dataset="dummy", context_length=p.context_length,
        dataset_samples=p.nproc * p.batch_size * p.steps, batch_size=p.batch_size, max_steps=p.steps,
        gradient_checkpointing="false", seed=p.seed, save_steps=p.save_steps, save_total_limit=p.save_total_limit,
        async_save=str(async_save).lower(), train_type=case, quant="none" if full else "bnb")  # fmt: skip
    if full:  # no adapters: no LoRA flags
        flags = {k: v for k, v in flags.items() if not k.startswith("lora_")}
    out = Path(flags["output_dir"])
    logs, final = Path(f"{out}.logs"), out / f"checkpoint-{p.saves[-1]}"
    run = runner.train(what, flags, nproc=p.nproc, steps=p.steps, probe="steps", torchrun=True,
                       torchrun_args=(f"--log-dir={logs}", "--tee=0:1"),
                       reset=lambda: shutil.rmtree(logs, ignore_errors=True),
                       done=lambda: (final / "trainer_state.json").is_file())  # fmt: skip
    log = run.pop("log")
    stdout = sorted(logs.glob("*/attempt_*/0/stdout.log"))
    if not stdout:
        raise RuntimeError(f"{what}: torchrun wrote no stdout.log of rank 0 under {logs}:\n{log}")
    if not (final / "trainer_state.json").is_file():
        raise RuntimeError(f"{what}: {final} is not a complete checkpoint:\n{log}")
    left = sorted(x.name for x in out.glob("checkpoint-*"))
    if left != [final.name]:
        raise RuntimeError(f"{what}: --save_total_limit {p.save_total_limit} left {left}")
    sizes = {f: f.stat().st_size for f in final.rglob("*") if f.is_file()}
    sharded = sum(n for f, n in sizes.items() if f.relative_to(final).parts[0] == "sharded")
    return {"case": case, "async_save": async_save, **run,
            "saves": parse_saves(stdout[-1].read_text(), async_save=async_save, expected=p.saves),
            "checkpoint": {"path": str(final), "bytes": sum(sizes.values()), "sharded_bytes": sharded,
                           "files": len(sizes)},
            "output_dir": str(out)}  # fmt: skip


def parse_saves(text: str, *, async_save: bool, expected: list[int]) -> list[dict[str, Any]]:
    """Rank 0's checkpoint lines, per save: the logged seconds, and after which step each was printed."""
    after, saves = 0, {}
    for line in text.splitlines():
        if step := re.search(r"\bstep (\d+) loss\b", line):
            after = int(step[1])
        elif hit := GOES_ON.search(line) or SAVED.search(line):
            if (number := re.search(r"checkpoint-(\d+)$", hit[1])) is None:
                raise RuntimeError(f"a checkpoint line names no checkpoint-STEP directory: {line!r}")
            entry = saves.setdefault(int(number[1]), {"step": int(number[1])})
            if hit.re is GOES_ON:
                entry |= {"goes_on_s": float(hit[2]), "printed_after_step": after}
            else:
                entry |= {"saved_s": float(hit[2]), "completed_after_step": after}
    found = sorted(saves)
    want = {"goes_on_s", "saved_s"} if async_save else {"saved_s"}
    incomplete = [s for s, e in saves.items() if set(e) & {"goes_on_s", "saved_s"} != want]
    if found != expected or incomplete:
        side = "async" if async_save else "sync"
        raise RuntimeError(f"{side} run: checkpoint lines for steps {found} (incomplete: {incomplete}), expected "
                           f"{expected}, each with {sorted(want)}:\n{text[-3000:]}")  # fmt: skip
    return [saves[s] for s in found]


def analyse(run: dict[str, Any], steps: int) -> dict[str, Any]:
    """A run's stalls, write times and step times; boundary b lies between step b's end and step b + 1's start."""
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


def run(p: CheckpointPlan, *, cache: Path, model: Path | None = None) -> dict[str, Any]:
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {c: {"sync": [], "async": []} for c in p.cases}
    compared: dict[str, list[dict[str, Any]]] = {c: [] for c in p.cases}
    with session(p, "ckpt") as runner:
        models = {c: runner.model(p.full_model if c == "full" else p.lora_model, cache) for c in p.cases}
        print(f"{p.reps} x sync and async saves ({', '.join(p.cases)}): {p.nproc} ranks x {p.batch_size} row(s) of "
              f"{p.context_length} tokens, {p.steps} steps, --save_steps {p.save_steps}")  # fmt: skip
        for rep in range(p.reps):
            for case in p.cases:
                made = {side: train(runner, f"{case} --async_save {str(side == 'async').lower()} (rep {rep + 1})",
                                    models[case], case, async_save=side == "async")
                        for side in (("sync", "async") if rep % 2 == 0 else ("async", "sync"))}  # fmt: skip
                a, b = (str(Path(made[side]["checkpoint"]["path"]) / "sharded") for side in ("async", "sync"))
                compared[case] += runner.worker(f"{case}: compare the async and sync checkpoints", "compare",
                                                {"a": a, "b": b})  # fmt: skip
                for side, done in made.items():
                    runs[case][side].append(done)
                    shutil.rmtree(done["output_dir"], ignore_errors=True)  # gigabytes on the full case
        rows, details = _rows(p, models, runs, compared)
        details["runs"] = {c: {side: [brief(r, KEEP, drop=("saves",)) for r in v] for side, v in sides.items()}
                           for c, sides in runs.items()}  # fmt: skip
        return runner.results("cpu-checkpoint", rows, details, {
            "saves": p.saves,
            "precision": f"--precision {p.precision} (parameters, gradients and Adam moments in {p.precision})",
            "our_training": f"torchrun --nproc_per_node {p.nproc} train.py, FSDP2, --dataset dummy, --batch_size "
                            f"{p.batch_size} x {p.context_length} tokens, --max_steps {p.steps} --save_steps "
                            f"{p.save_steps} --save_total_limit {p.save_total_limit}, gradient checkpointing off; "
                            f"full: --train_type full --quant none; lora: --quant bnb, LoRA r{p.lora_rank} on every "
                            "linear; the two sides differ in --async_save",
            "stalls": "logged: rank 0's checkpoint line at the save; step times: metrics.jsonl's elapsed_s less the "
                      "next step's tokens / tokens_per_s at the save's boundary (and where an async save is marked "
                      "complete), less the median of the boundaries without either",
        }, model=harness.model_record(models.get("full", models[p.cases[0]]), p.full_model),
           models={c: {"path": str(m), "parameters": harness.parameters(m)} for c, m in models.items()})  # fmt: skip


def _rows(p: CheckpointPlan, models: dict[str, Path], runs: dict[str, dict[str, list[dict[str, Any]]]],
          compared: dict[str, list[dict[str, Any]]]) -> tuple[list[dict], dict[str, Any]]:  # fmt: skip
    """Each case's rows, async against sync, and the acceptance record and every run's figures."""
    summaries = {c: {s: [analyse(r, p.steps) for r in v] for s, v in sides.items()} for c, sides in runs.items()}
    timed = ", ".join(str(s) for s in p.timed_saves)
    figures = (
        ("stall_logged_s", "training's stall per save, as logged (async: until training goes on)", "s", "lower"),
        ("stall_steps_s", f"training's stall per save, from the step times (saves after steps {timed})", "s", "lower"),
        ("write_s", "seconds from a save until its checkpoint is complete", "s", "lower"),
        ("step_s", f"seconds per step, steps 2-{p.steps}", "s", "lower"),
        ("peak_rss_bytes", "peak RSS during training and saves, largest rank", "bytes", "lower"),
        ("rss_rise_bytes", "peak RSS less the RSS before step 1, largest rank", "bytes", "lower"),
        ("checkpoint_bytes", "checkpoint size on disk", "bytes", "lower"),
    )
    rows, acceptance = [], []
    for case, sides in summaries.items():
        params, total = sides["async"][0]["trainable_parameters"], harness.parameters(models[case])
        what = "--train_type full --quant none" if case == "full" else f"--quant bnb, LoRA r{p.lora_rank}"
        shape = f"{what}, {params:,} trainable of {total:,} parameters, {p.nproc} ranks, FSDP2"
        made = keyed_rows(case, figures, sides["async"], sides["sync"], suffix=f"_{case}",
                          ours_label=f"--async_save true; {shape}", peer_label="--async_save false (the same CLI)",
                          note=f"{case}: saves after steps {', '.join(map(str, p.saves))} of {p.steps}; {p.reps} "
                          "repetition(s), medians")  # fmt: skip
        rows += made.values()
        same = [c["identical"] for c in compared[case]]
        ratios = {k: made[f"stall_{k}_s"]["ratio"] for k in ("logged", "steps")}
        bar = STALL_BAR if case == "full" else None
        acceptance.append({
            "case": case, "stall_ratio": ratios, "stall_bar": bar, "checkpoints_identical": all(same),
            "stall_s": {side: {k: made[f"stall_{k}_s"][side] for k in ratios} for side in ("ours", "peer")},
            "checkpoint_bytes": {"async": made["checkpoint_bytes"]["ours"], "sync": made["checkpoint_bytes"]["peer"]},
            "passed": all(same) and (bar is None or all(r <= bar for r in ratios.values())),
        })  # fmt: skip
    return rows, {"acceptance": acceptance, "summaries": summaries, "compared": compared}


def render(results: dict[str, Any]) -> str:
    """The tables, then the acceptance checks and every save."""
    details, lines = results.get("details", {}), []
    for a in details.get("acceptance") or []:
        r, s = a["stall_ratio"], a["stall_s"]
        bar = f" (bar {a['stall_bar']:.2f}x: {report.verdict(a['passed'])})" if a["stall_bar"] else ""
        same = "identical" if a["checkpoints_identical"] else "DIFFERENT"
        size = a["checkpoint_bytes"]["async"]
        lines.append(f"- {a['case']}: stall per save, async / sync: logged {s['ours']['logged']:.2f} / "
                     f"{s['peer']['logged']:.2f} s = {r['logged']:.3f}x, from the step times "
                     f"{s['ours']['steps']:.2f} / {s['peer']['steps']:.2f} s = {r['steps']:.3f}x{bar}; "
                     f"checkpoint {fmt(size, 'bytes')} ({size:,.0f} bytes), async and sync checkpoints "
                     f"{same}.")  # fmt: skip
    lines = report.acceptance("Acceptance", lines)
    if summaries := details.get("summaries", {}):
        head = "| run | save after step | logged stall | stall from step times | complete after | found after step |"
        lines += ["", "### Saves", "", head, "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {case} {side} (rep {i + 1}) | {x['step']} | {x['logged_stall_s']:.2f} s | "
                  f"{format(x['steps_stall_s'], '.2f') + ' s' if 'steps_stall_s' in x else '-'} | "
                  f"{x['saved_s']:.2f} s | {x['completed_after_step']} |" for case, sides in summaries.items()
                  for side, reps in sides.items() for i, s in enumerate(reps) for x in s["saves"]]  # fmt: skip
        lines += ["", "Steps while a background write is in flight (async) against the others, and the rest:", ""]
        lines += [f"- {case} (rep {i + 1}): steps {s['steps_writing']} {s['step_s_writing']:.2f} s against "
                  f"{s['step_s_quiet']:.2f} s (sync run: {sides['sync'][i]['step_s']:.2f} s a step)."
                  for case, sides in summaries.items() for i, s in enumerate(sides["async"])
                  if s["step_s_writing"] is not None and s["step_s_quiet"] is not None]  # fmt: skip
    return report.render(results, lines)
