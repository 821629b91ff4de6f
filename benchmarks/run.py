"""Run a benchmark suite and write OUT/results.json and OUT/results.md.

    python benchmarks/run.py --suite NAME [--quick] [--out DIR] [--model DIR] [--reps N] [suite options]
    python benchmarks/run.py --suite gpu [--dry-run] [--only tests,bnb,...]   (benchmarks/gpu.sh wraps it)
    python benchmarks/run.py --render OUT/results.json                          (its results.md, again)

Suites: cpu, cpu-large, cpu-loss, cpu-packing, cpu-data (--rows), cpu-moe (--quants), cpu-preference
(--objectives), cpu-checkpoint, cpu-long-context, cpu-generation, gpu. benchmarks/README.md says what each measures.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

# `python benchmarks/run.py` puts benchmarks/ first on sys.path; the harness imports itself as a package.
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

SUITES = {"cpu": "cpu_suite", "cpu-large": "cpu_suite", "cpu-loss": "cpu_suite", "cpu-packing": "cpu_suite",
          "cpu-data": "data_suite", "cpu-moe": "moe_suite", "cpu-preference": "preference_suite",
          "cpu-checkpoint": "checkpoint_suite", "cpu-long-context": "long_context_suite",
          "cpu-generation": "generation_suite", "cpu-formats": "formats_suite", "gpu": "gpu_suite"}  # fmt: skip
"""Each suite's module: `plan(...)`, `run(plan, model=, cache=)` and, beside report.render's tables, `render`."""
OWN_MODEL = {
    "cpu-preference": "its own model (its size sets how much of a step is activations)",
    "cpu-long-context": "its own model (its size sets how much of a step is activations)",
    "cpu-generation": "its own model (a random one runs every completion to its limit)",
    "cpu-checkpoint": "its own models (a full fine-tune's and a LoRA case's)",
    "cpu-moe": "its own pair of models (an MoE and its dense twin); --model is not used",
}
"""Suites that refuse --model, and why."""
OPTIONS = {"rows": "cpu-data", "quants": "cpu-moe", "objectives": "cpu-preference"}
"""Suite options: the suite that takes each."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", required=True, choices=tuple(SUITES))
    p.add_argument("--out", type=Path, default=Path("results"), help="directory for results.json and results.md")
    p.add_argument("--model", type=Path, default=None, help="use this model directory instead of building one")
    p.add_argument("--quick", action="store_true", help="small model, one repetition (what the test runs)")
    p.add_argument("--reps", type=int, default=None, help="repetitions per measurement (default 3; quick 1)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of a one-process run")
    p.add_argument("--idle_wait", type=float, default=None, help="seconds to wait for a quiet machine per launch")
    p.add_argument("--cache", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "qlora-fsdp-bench",
                   help="where built models are kept between runs")  # fmt: skip
    p.add_argument("--precision", choices=("bf16", "fp32"), help="CPU suites: both sides' dtype (default: bf16 where "
                   "the CPU multiplies bf16 natively)")  # fmt: skip
    p.add_argument("--rows", type=int, default=None, help="data suite: rows of the synthetic file (default 1,000,000)")
    p.add_argument("--quants", default=None, help="MoE suite: backends of the memory section, bnb and/or hqq")
    p.add_argument("--objectives", default=None, help="preference suite: of dpo, ipo, orpo, simpo (default all)")
    p.add_argument("--dry-run", dest="dry_run", action="store_true", help="GPU suite: tiny shapes on the CPU")
    p.add_argument("--peak_flops", type=float, default=989e12, help="GPU suite: the device's dense bf16 peak FLOP/s")
    p.add_argument("--budget_s", type=float, default=None, help="GPU suite: seconds for all of it (default 500)")
    p.add_argument("--only", default=None, help="GPU suite: comma-separated plan items to run")
    args = p.parse_args(argv)
    for name, suite in OPTIONS.items():
        if (value := getattr(args, name)) is not None and args.suite != suite:
            p.error(f"--{name} is an option of --suite {suite}")
        if isinstance(value, str):  # --quants, --objectives: comma-separated
            setattr(args, name, tuple(x.strip() for x in value.split(",") if x.strip()))
    if args.suite in OWN_MODEL and args.model is not None:
        p.error(f"--suite {args.suite} builds {OWN_MODEL[args.suite]}")
    if args.model is not None and not (args.model / "config.json").is_file():
        p.error(f"--model {args.model}: no config.json there")
    if args.reps is not None and args.reps < 1:
        p.error("--reps must be >= 1")
    if args.threads < 1:
        p.error("--threads must be >= 1")
    if args.rows is not None and args.rows < 80:
        p.error("--rows must be >= 80 (the small run trains a tenth of them, 2 ranks x batch 2 a step)")
    if args.only is not None:
        from benchmarks.gpu_suite import parse_only

        try:
            args.only = parse_only(args.only)
        except ValueError as exc:
            p.error(str(exc))
    return args


def render(results: dict[str, Any]) -> str:
    """results.md of a results.json: the suite's own render, else the common tables."""
    from benchmarks import report

    return getattr(importlib.import_module(f"benchmarks.{SUITES[results['suite']]}"), "render", report.render)(results)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.harness import machine_info, write_json

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = " ".join(["python", "benchmarks/run.py", *(sys.argv[1:] if argv is None else argv)])
    suite = importlib.import_module(f"benchmarks.{SUITES[args.suite]}")

    def save(results: dict[str, Any]) -> None:
        results.update(date=started, command=command)
        write_json(args.out / "results.json", results)
        (args.out / "results.md").write_text(render(results))

    if args.suite == "gpu":
        # gpu.sh's hard stop sends SIGTERM: as an exception it lets the launcher kill the running worker, which has
        # a session of its own and would otherwise keep the GPU after this process is gone.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        results = suite.run(dry_run=args.dry_run, peak_flops=args.peak_flops, budget_s=args.budget_s,
                            quick=args.quick, only=args.only or suite.NAMES, save=save)  # fmt: skip
    else:
        extra = {name: getattr(args, name) for name, owner in OPTIONS.items() if owner == args.suite}
        if SUITES[args.suite] == "cpu_suite":
            extra["kind"] = args.suite
        try:
            plan = suite.plan(quick=args.quick, threads=args.threads, reps=args.reps, idle_wait_s=args.idle_wait,
                              precision=args.precision, **extra)  # fmt: skip
        except ValueError as exc:  # sizes the suite cannot measure with
            print(f"error: {exc}", file=sys.stderr)
            return 2
        results = {**suite.run(plan, model=args.model, cache=args.cache), "machine": machine_info()}
    save(results)
    print((args.out / "results.md").read_text())
    return 0 if not results.get("errors") else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--render"]:  # python benchmarks/run.py --render RESULTS_JSON: its results.md, again
        sys.stdout.write(render(json.loads(Path(sys.argv[2]).read_text())))
        sys.exit(0)
    sys.exit(main())
