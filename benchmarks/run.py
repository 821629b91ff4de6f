"""Run a benchmark suite and write OUT/results.json and OUT/results.md.

    python benchmarks/run.py --suite cpu [--model DIR] [--out results/] [--quick]
    python benchmarks/run.py --suite cpu-large [--out DIR]   (loading only, on a 1.1B model built once)
    python benchmarks/run.py --suite cpu-loss [--out DIR] [--quick]   (chunked vs whole-logit loss: memory, speed)
    python benchmarks/run.py --suite cpu-packing [--out DIR] [--quick]   (packed vs unpacked training, 2 ranks)
    python benchmarks/run.py --suite cpu-data [--out DIR] [--quick] [--rows N]   (tokenized cache, padding, memory)
    python benchmarks/run.py --suite cpu-moe [--out DIR] [--quick] [--quants bnb,hqq]   (a Mixtral-shaped model:
        resident bytes per rank at 1, 2, 4 ranks against HF 4-bit; step time against a dense model, same active size)
    python benchmarks/run.py --suite cpu-preference [--out DIR] [--quick] [--objectives dpo,ipo,orpo,simpo]
        (preference objectives against SFT over the same tokens, 2 ranks: parameter bytes, step peak RSS, step time)
    python benchmarks/run.py --suite cpu-checkpoint [--out DIR] [--quick]   (training's stall per save, --async_save
        true against false, 2 ranks: a 483M full fine-tune and a LoRA case; stall seconds, write time, peak RSS, bytes)
    python benchmarks/run.py --suite cpu-long-context [--out DIR] [--quick]   (--sequence_parallel_size S and
        --tiled_mlp: a step's peak tensor bytes and RSS per rank, tokens/s, the longest context in a fixed budget)
    python benchmarks/run.py --suite cpu-generation [--out DIR] [--quick]   (GRPO's sampling, --generation_mode
        gathered against sharded, 2 ranks: sampling tokens/s, step tokens/s, peak RSS per rank)
    python benchmarks/run.py --suite gpu [--out DIR] [--dry-run] [--only tests,bnb,...] [--peak_flops 989e12]
        (benchmarks/gpu.sh wraps it: it installs the carried wheels first)

Without --model the CPU suite builds its own random Llama (scripts/make_tiny_model.py; about 171M parameters in 3
shards, cached under --cache). Each measurement runs in fresh processes; see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
from pathlib import Path
from typing import Any

# `python benchmarks/run.py` puts benchmarks/ first on sys.path; the harness imports itself as a package.
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    suites = (
        "cpu",
        "cpu-large",
        "cpu-loss",
        "cpu-packing",
        "cpu-data",
        "cpu-moe",
        "cpu-preference",
        "cpu-checkpoint",
        "cpu-long-context",
        "cpu-generation",
        "gpu",
    )
    p.add_argument("--suite", required=True, choices=suites)
    p.add_argument("--out", type=Path, default=Path("results"), help="directory for results.json and results.md")
    p.add_argument("--model", type=Path, default=None, help="CPU suite: use this model directory instead of building")
    p.add_argument("--quick", action="store_true", help="small model, one repetition (what the test runs)")
    p.add_argument("--reps", type=int, default=None, help="repetitions per measurement (default 3; quick 1)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of a one-process run")
    p.add_argument(
        "--idle_wait", type=float, default=None, help="seconds to wait for a quiet machine before each launch"
    )
    p.add_argument(
        "--cache",
        type=Path,
        default=Path(os.environ.get("TMPDIR", "/tmp")) / "qlora-fsdp-bench",
        help="where built models are kept between runs",
    )
    p.add_argument(
        "--precision",
        choices=("bf16", "fp32"),
        default=None,
        help="CPU suites: both sides' dtype (default: bf16 where the CPU has native bf16 matmuls, else fp32)",
    )
    p.add_argument(
        "--rows", type=int, default=None, help="data suite: rows of the synthetic file (default 1,000,000; quick 2,000)"
    )
    p.add_argument(
        "--quants",
        default=None,
        help="MoE suite: comma-separated backends of the memory section, bnb and/or hqq (default bnb; quick both)",
    )
    p.add_argument(
        "--objectives",
        default=None,
        help="preference suite: comma-separated objectives to compare with SFT, of dpo, ipo, orpo, simpo "
        "(default all; quick dpo)",
    )
    p.add_argument("--dry-run", dest="dry_run", action="store_true", help="GPU suite: tiny shapes on the CPU")
    p.add_argument("--peak_flops", type=float, default=989e12, help="GPU suite: the device's dense bf16 peak FLOP/s")
    p.add_argument(
        "--budget_s", type=float, default=None, help="GPU suite: seconds for all of it (default 500; dry run 1100)"
    )
    p.add_argument(
        "--only",
        default=None,
        help="GPU suite: comma-separated plan items to run (tests, bnb, hqq, compile, whole-logits, fsdp1, bnb-1x512, "
        "long-context)",
    )
    args = p.parse_args(argv)
    if args.only is not None:
        from benchmarks.gpu_suite import parse_only

        try:
            args.only = parse_only(args.only)
        except ValueError as exc:
            p.error(str(exc))
    if args.quants is not None:
        args.quants = tuple(q.strip() for q in args.quants.split(",") if q.strip())
        if args.suite != "cpu-moe":
            p.error("--quants is an option of --suite cpu-moe")
    if args.objectives is not None:
        args.objectives = tuple(o.strip() for o in args.objectives.split(",") if o.strip())
        if args.suite != "cpu-preference":
            p.error("--objectives is an option of --suite cpu-preference")
    if args.suite == "cpu-preference" and args.model is not None:
        p.error("--suite cpu-preference builds its own model (its size sets how much of a step is activations)")
    if args.suite == "cpu-long-context" and args.model is not None:
        p.error("--suite cpu-long-context builds its own model (its size sets how much of a step is activations)")
    if args.suite == "cpu-generation" and args.model is not None:
        p.error("--suite cpu-generation builds its own model (a random one runs every completion to its limit)")
    if args.suite == "cpu-checkpoint" and args.model is not None:
        p.error("--suite cpu-checkpoint builds its own models (a full fine-tune's and a LoRA case's)")
    if args.suite == "cpu-moe" and args.model is not None:
        p.error("--suite cpu-moe builds its own pair of models (an MoE and its dense twin); --model is not used")
    if args.model is not None and not (args.model / "config.json").is_file():
        p.error(f"--model {args.model}: no config.json there")
    if args.reps is not None and args.reps < 1:
        p.error("--reps must be >= 1")
    if args.threads < 1:
        p.error("--threads must be >= 1")
    if args.rows is not None and args.rows < 80:
        p.error("--rows must be >= 80 (the small run trains a tenth of them, 2 ranks x batch 2 a step)")
    return args


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import machine_info, write_json
    from benchmarks.report import render

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.UTC)
    command = " ".join(["python", "benchmarks/run.py", *(sys.argv[1:] if argv is None else argv)])

    def save(results: dict[str, Any]) -> None:
        results["date"] = started.strftime("%Y-%m-%d %H:%M UTC")
        results["command"] = command
        write_json(args.out / "results.json", results)
        if args.suite == "cpu-data":
            from benchmarks.data_suite import render_data

            (args.out / "results.md").write_text(render_data(results))
        elif args.suite == "cpu-moe":
            from benchmarks.moe_suite import render_moe

            (args.out / "results.md").write_text(render_moe(results))
        elif args.suite == "cpu-preference":
            from benchmarks.preference_suite import render_preference

            (args.out / "results.md").write_text(render_preference(results))
        elif args.suite == "cpu-checkpoint":
            from benchmarks.checkpoint_suite import render_checkpoint

            (args.out / "results.md").write_text(render_checkpoint(results))
        elif args.suite == "cpu-long-context":
            from benchmarks.long_context_suite import render_long_context

            (args.out / "results.md").write_text(render_long_context(results))
        elif args.suite == "cpu-generation":
            from benchmarks.generation_suite import render_generation

            (args.out / "results.md").write_text(render_generation(results))
        else:
            (args.out / "results.md").write_text(render(results))

    if args.suite == "cpu-data":
        from benchmarks.data_suite import plan as data_plan
        from benchmarks.data_suite import run_data_suite

        try:
            suite_plan = data_plan(quick=args.quick, rows=args.rows, threads=args.threads, reps=args.reps,
                                   idle_wait_s=args.idle_wait, precision=args.precision)  # fmt: skip
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        results = run_data_suite(suite_plan, model=args.model, cache=args.cache)
        results["machine"] = machine_info()
    elif args.suite == "cpu-moe":
        from benchmarks.moe_suite import plan as moe_plan
        from benchmarks.moe_suite import run_moe_suite

        try:
            suite_plan = moe_plan(quick=args.quick, threads=args.threads, reps=args.reps, idle_wait_s=args.idle_wait,
                                  precision=args.precision, quants=args.quants)  # fmt: skip
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        results = run_moe_suite(suite_plan, cache=args.cache)
        results["machine"] = machine_info()
    elif args.suite == "cpu-preference":
        from benchmarks.preference_suite import plan as preference_plan
        from benchmarks.preference_suite import run_preference_suite

        try:
            suite_plan = preference_plan(quick=args.quick, threads=args.threads, reps=args.reps,
                                         idle_wait_s=args.idle_wait, precision=args.precision,
                                         objectives=args.objectives)  # fmt: skip
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        results = run_preference_suite(suite_plan, cache=args.cache)
        results["machine"] = machine_info()
    elif args.suite == "cpu-checkpoint":
        from benchmarks.checkpoint_suite import plan as checkpoint_plan
        from benchmarks.checkpoint_suite import run_checkpoint_suite

        try:
            suite_plan = checkpoint_plan(quick=args.quick, threads=args.threads, reps=args.reps,
                                         idle_wait_s=args.idle_wait, precision=args.precision)  # fmt: skip
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        results = run_checkpoint_suite(suite_plan, cache=args.cache)
        results["machine"] = machine_info()
    elif args.suite == "cpu-long-context":
        from benchmarks.long_context_suite import plan as long_context_plan
        from benchmarks.long_context_suite import run_long_context_suite

        try:
            suite_plan = long_context_plan(quick=args.quick, threads=args.threads, reps=args.reps,
                                           idle_wait_s=args.idle_wait, precision=args.precision)  # fmt: skip
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        results = run_long_context_suite(suite_plan, cache=args.cache)
        results["machine"] = machine_info()
    elif args.suite == "cpu-generation":
        from benchmarks.generation_suite import plan as generation_plan
        from benchmarks.generation_suite import run_generation_suite

        suite_plan = generation_plan(quick=args.quick, threads=args.threads, reps=args.reps,
                                     idle_wait_s=args.idle_wait, precision=args.precision)  # fmt: skip
        results = run_generation_suite(suite_plan, cache=args.cache)
        results["machine"] = machine_info()
    elif args.suite in ("cpu", "cpu-large", "cpu-loss", "cpu-packing"):
        from benchmarks.cpu_suite import plan, run_cpu_suite

        cpu_plan = plan(
            quick=args.quick,
            threads=args.threads,
            reps=args.reps,
            idle_wait_s=args.idle_wait,
            large=args.suite == "cpu-large",
            loss=args.suite == "cpu-loss",
            packing=args.suite == "cpu-packing",
            precision=args.precision,
        )
        results = run_cpu_suite(cpu_plan, model=args.model, cache=args.cache)
        results["machine"] = machine_info()
    else:
        from benchmarks.gpu_suite import NAMES, run_gpu_suite

        # gpu.sh's hard stop sends SIGTERM: as an exception it lets the launcher kill the running worker, which has
        # a session of its own and would otherwise keep the GPU after this process is gone.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        results = run_gpu_suite(
            args.out,
            dry_run=args.dry_run,
            peak_flops=args.peak_flops,
            budget_s=args.budget_s,
            quick=args.quick,
            only=args.only or NAMES,
            save=save,
        )
    save(results)
    print((args.out / "results.md").read_text())
    return 0 if not results.get("errors") else 1


if __name__ == "__main__":
    sys.exit(main())
