"""The CPU suite: loading, per-rank memory vs world size, training throughput, quantization quality and size;
the loss suite (--suite cpu-loss): chunked against whole-logit cross-entropy, in step memory and speed; and the
packing suite (--suite cpu-packing): packed against unpacked training on the bundled data.

Every measurement is a fresh process (or a fresh job of processes); ours and the peer's runs alternate, so slow
phases of a shared machine hit both sides alike, and every launch records the CPU other processes took meanwhile.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.common import (
    REPO_ROOT,
    Launch,
    base_env,
    launch,
    median,
    rank_envs,
    read_json,
    run_metrics,
    wait_for_idle,
    worker_cmd,
)
from benchmarks.rows import row

WORKERS = "benchmarks.cpu_workers"
EXIT_ABORT = "terminate called without an active exception"
PEER_LOAD = "HF from_pretrained 4-bit, 1 process"
PEER_TRAIN = "HF 4-bit + PEFT + AdamW, 1 process"
PEER_REPLICATED = "HF 4-bit model, replicated on every rank"
PEER_LIBRARY = "library called directly"
# The quantization formats of section 4: (key slug, name, QuantConfig fields).
FORMATS = (
    ("bnb_nf4_dq", "bnb nf4 + double quant", {"quant": "bnb", "bnb_quant_type": "nf4", "bnb_double_quant": True}),
    ("bnb_nf4", "bnb nf4", {"quant": "bnb", "bnb_quant_type": "nf4", "bnb_double_quant": False}),
    ("bnb_fp4_dq", "bnb fp4 + double quant", {"quant": "bnb", "bnb_quant_type": "fp4", "bnb_double_quant": True}),
    ("hqq_4bit", "hqq 4-bit g64", {"quant": "hqq", "hqq_bits": 4, "hqq_group_size": 64}),
    ("hqq_3bit", "hqq 3-bit g64", {"quant": "hqq", "hqq_bits": 3, "hqq_group_size": 64}),
    ("hqq_2bit", "hqq 2-bit g64", {"quant": "hqq", "hqq_bits": 2, "hqq_group_size": 64}),
)
# Section 3's runs of ours: (key slug, --quant, ranks, --fsdp_version).
TRAIN_RUNS = (
    ("bnb_1proc", "bnb", 1, 2),
    ("hqq_1proc", "hqq", 1, 2),
    ("bnb_2ranks_fsdp2", "bnb", 2, 2),
    ("hqq_2ranks_fsdp2", "hqq", 2, 2),
    ("bnb_2ranks_fsdp1", "bnb", 2, 1),
)
# Section 1 loads with each FSDP version; section 2 adds HQQ under FSDP2.
LOAD_VERSIONS = (2, 1)
WORLD_COMBOS = ((2, "bnb"), (2, "hqq"), (1, "bnb"))


@dataclass(kw_only=True)
class LaunchSettings:
    """How a suite's Runner launches and waits: what every CPU suite's plan holds besides its sizes."""

    threads: int = 2
    """Threads of a one-process run; each rank of an N-rank job gets threads // N (at least 1)."""
    idle_wait_s: float = 30.0
    """Before each launch, wait up to this long for other processes on the machine to go quiet."""
    idle_wait_budget_s: float = 150.0
    """All waiting of a suite together, so a busy machine cannot stretch the suite past its time limit."""
    retry_above_cores: float = 0.5
    """Measure again (once) when other processes took more than this many cores during a launch."""
    retries: int = 1
    launch_timeout_s: float = 600.0
    quick: bool = False
    precision: str = "bf16"
    """Both sides' parameter, storage and compute dtype: bf16, or fp32 on a CPU without native bf16 matmuls."""

    def set_launch(self, *, threads: int, precision: str | None, idle_wait_s: float | None) -> None:
        """The command line's launch flags; no --precision means bf16 where the CPU has native bf16 matmuls."""
        self.threads = threads
        self.precision = precision or ("bf16" if native_bf16() else "fp32")
        if idle_wait_s is not None:
            self.idle_wait_s = idle_wait_s


@dataclass
class CpuPlan(LaunchSettings):
    """Sizes and repetitions of one CPU suite run."""

    model: dict[str, int]
    """scripts/make_tiny_model.py size flags."""
    reps: int
    batch_size: int
    context_length: int
    warmup_steps: int
    measured_steps: int
    lora_rank: int = 16
    lora_alpha: float = 32.0
    gradient_checkpointing: bool = False
    world_sizes: tuple[int, ...] = (1, 2, 4)
    train_runs: tuple[tuple[str, str, int, int], ...] = TRAIN_RUNS
    """Section 3's runs of ours (TRAIN_RUNS' layout)."""
    large: bool = False
    """The loading section alone, on a 1.1B model (--suite cpu-large)."""
    loss: bool = False
    """The loss section alone (--suite cpu-loss)."""
    packing: bool = False
    """The packing section alone: --packing true against false on the bundled data (--suite cpu-packing)."""


# About 171M parameters in 3 shards: 12 Llama layers of 12.6M (mostly quantized linears) + 8192-token embeddings.
FULL_MODEL = dict(
    hidden_size=1024,
    num_layers=12,
    intermediate_size=2816,
    num_heads=16,
    num_kv_heads=16,
    vocab_size=8192,
    num_shards=3,
)
SIZE_KEYS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size")
QUICK_MODEL = dict(
    hidden_size=256, num_layers=2, intermediate_size=512, num_heads=4, num_kv_heads=4, vocab_size=512, num_shards=2
)
# TinyLlama's shape, about 1.1B parameters in five fp32 shards of 0.88 GB: loading at a size where memory tells.
LARGE_MODEL = dict(
    hidden_size=2048,
    num_layers=22,
    intermediate_size=5632,
    num_heads=32,
    num_kv_heads=4,
    vocab_size=32000,
    num_shards=5,
)


# The loss suite's memory models: one decoder too small to matter, so the head and its logits decide the peak.
LOSS_MODEL = dict(hidden_size=256, num_layers=2, intermediate_size=512, num_heads=4, num_kv_heads=4, num_shards=1)
LOSS_VOCABS = (512, 128256)  # a toy vocabulary, and Llama 3's
LOSS_SHAPE = {"batch_size": 1, "context_length": 2048}
LOSS_CHUNK = 512  # --loss_chunk_tokens' default


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware; without it PyTorch's bf16 matmul is ~100x slower than
    fp32 (seen: 0.5 s against 5 ms for 64 x 2816 x 1024), which would measure that path instead of either side."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.is_file() else ""
    return "avx512_bf16" in flags or "amx_bf16" in flags


def plan(
    *,
    quick: bool,
    threads: int,
    reps: int | None,
    idle_wait_s: float | None,
    large: bool = False,
    loss: bool = False,
    packing: bool = False,
    precision: str | None = None,
) -> CpuPlan:
    """The full suite (about 12 minutes on 2 cores), the --quick one the test runs (small model, one rep), or the
    large loading suite (about 5 minutes, one rep, plus 1-2 minutes to build the model once)."""
    if packing:
        # 2 ranks at context 512 on data/alpaca_tiny.jsonl, the suite's model (the quick one with --quick).
        p = CpuPlan(QUICK_MODEL if quick else FULL_MODEL, reps=1 if quick else 3, batch_size=4, context_length=512,
                    warmup_steps=2, measured_steps=3, packing=True, quick=quick)  # fmt: skip
    elif loss:
        # Speed on the suite's model (the quick one with --quick); memory on LOSS_MODEL at LOSS_SHAPE.
        p = CpuPlan(QUICK_MODEL if quick else FULL_MODEL, reps=1 if quick else 3, batch_size=4, context_length=256,
                    warmup_steps=2, measured_steps=3, loss=True, quick=quick)  # fmt: skip
    elif large:
        p = CpuPlan(LARGE_MODEL, reps=1, batch_size=1, context_length=64, warmup_steps=0, measured_steps=0, large=True)
    elif quick:
        p = CpuPlan(QUICK_MODEL, reps=1, batch_size=2, context_length=64, warmup_steps=1, measured_steps=2, quick=True)
        # 4 ranks on 2 cores cost the test suite a minute and show nothing 2 ranks do not; training once in one
        # process and once under torchrun covers both of the harness's launch paths.
        p.idle_wait_s, p.retries, p.launch_timeout_s, p.world_sizes = 0.0, 0, 180.0, (1, 2)
        p.train_runs = tuple(r for r in TRAIN_RUNS if r[0] in ("bnb_1proc", "bnb_2ranks_fsdp2"))
    else:
        p = CpuPlan(FULL_MODEL, reps=3, batch_size=4, context_length=256, warmup_steps=2, measured_steps=3)
    p.set_launch(threads=threads, precision=precision, idle_wait_s=idle_wait_s)
    if reps is not None:
        p.reps = reps
    return p


def ensure_model(plan: CpuPlan, cache: Path) -> Path:
    """Build the random Llama for these sizes once with scripts/make_tiny_model.py (deterministic, so cacheable).

    The builder runs in its own process: the harness must stay small, because Linux hands a process's RSS
    high-water mark down to every child it launches (ru_maxrss), and the builder holds the fp32 model twice.
    """
    name = "llama-" + "-".join(f"{v}" for v in plan.model.values())
    path = cache / name
    if not (path / "model.safetensors.index.json").is_file():
        flags = [f"--{k}={v}" for k, v in plan.model.items()]
        cmd = [sys.executable, str(REPO_ROOT / "scripts" / "make_tiny_model.py"), f"--output={path}", *flags]
        launch([cmd], [base_env(plan.threads)], timeout_s=plan.launch_timeout_s).check("building the model")
    return path


def launch_conditions(launches: list[dict[str, Any]]) -> dict[str, Any]:
    """results.json's record of the conditions a suite's launches ran under (other processes' cores, waits)."""
    foreign = [entry["foreign_cores"] for entry in launches if not entry["discarded"]]
    return {
        "launches": launches,
        "foreign_cores_median": median(foreign) if foreign else 0.0,
        "foreign_cores_max": max(foreign, default=0.0),
        "waited_for_idle_s": round(sum(entry["waited_for_idle_s"] for entry in launches), 1),
        "discarded_launches": sum(entry["discarded"] for entry in launches),
        "aborted_at_exit_after_finishing": sum("aborted_at_exit_after_finishing" in e for e in launches),
    }


def launches_markdown(results: dict[str, Any]) -> list[str]:
    """results.md's table of every launch of a suite and the conditions it ran under (empty without launches)."""
    launches = results.get("conditions", {}).get("launches") or []
    if not launches:
        return []
    lines = ["", "### Launches", "", "| launch | wall | other processes' cores | waited |", "|---|---:|---:|---:|"]
    for e in launches:
        kept = "" if not e["discarded"] else " (discarded)"
        lines.append(
            f"| {e['what']}{kept} | {e['wall_s']:.1f} s | {e['foreign_cores']:.2f} | {e['waited_for_idle_s']:.0f} s |"
        )
    return lines


class Runner:
    """Launches measurements, waits for a quiet machine first, and keeps a log of every launch's conditions."""

    def __init__(self, plan: LaunchSettings, work: Path, log: Callable[[str], None]) -> None:
        self.plan = plan
        self.work = work
        self.say = log
        self.launches: list[dict[str, Any]] = []
        self.waited = 0.0
        self._n = 0

    def _wait(self) -> float:
        budget = min(self.plan.idle_wait_s, self.plan.idle_wait_budget_s - self.waited)
        waited = wait_for_idle(budget) if budget > 0 else 0.0
        self.waited += waited
        return waited

    def _go(
        self,
        what: str,
        cmds: list[list[str]],
        envs: list[dict[str, str]],
        *,
        reset: Callable[[], None] | None = None,
        finished: Callable[[], bool] | None = None,
    ) -> Launch:
        """Launch; measure once more if other processes took much CPU meanwhile, or if the launch failed.

        `finished` says whether a launch that exited non-zero had nevertheless written its whole measurement: a
        job aborting at exit with "terminate called without an active exception" (an FSDP + gloo teardown race
        in the package, see benchmarks/README.md) is recorded as such and kept, not hidden or re-measured.
        """
        contention_retries, failure_retries = self.plan.retries, 1
        for attempt in range(1, 10):
            if reset is not None:
                reset()
            waited = self._wait()
            result = launch(cmds, envs, timeout_s=self.plan.launch_timeout_s)
            entry = {
                "what": what,
                "attempt": attempt,
                "wall_s": round(result.wall_s, 2),
                "cpu_s": round(result.cpu_s, 2),
                "foreign_cores": round(result.foreign_cores, 3),
                "waited_for_idle_s": round(waited, 1),
                "discarded": False,
            }
            self.launches.append(entry)
            if result.returncode != 0:
                if finished is not None and finished() and EXIT_ABORT in result.log:
                    entry["aborted_at_exit_after_finishing"] = True
                elif failure_retries > 0:
                    failure_retries -= 1
                    entry.update(discarded=True, failed=f"exit status {result.returncode}")
                    self.say(f"  {what}: failed with exit status {result.returncode}; trying once more")
                    continue
                else:
                    result.check(what)
            if result.foreign_cores > self.plan.retry_above_cores and contention_retries > 0:
                contention_retries -= 1
                entry["discarded"] = True
                self.say(f"  {what}: other processes used {result.foreign_cores:.2f} cores; measuring again")
                continue
            self.say(f"  {what}: {result.wall_s:.1f} s (other processes used {result.foreign_cores:.2f} cores)")
            return result
        raise RuntimeError(f"{what}: no usable measurement in 9 attempts")

    def result_path(self, stem: str) -> str:
        self._n += 1
        return str(self.work / f"{self._n:03d}-{stem}")

    def worker(self, what: str, name: str, args: dict[str, Any], *, nproc: int = 1) -> list[dict[str, Any]]:
        """Run a worker in `nproc` ranks; returns each rank's JSON record."""
        result = self.result_path(name)
        cmd = worker_cmd(WORKERS, name, {**args, "result": result})
        if nproc == 1 and name != "load_ours":
            self._go(what, [cmd], [base_env(self.plan.threads)])
            return [read_json(result)]
        self._go(what, [cmd] * nproc, rank_envs(nproc, max(1, self.plan.threads // nproc)))
        return [read_json(f"{result}.rank{r}.json") for r in range(nproc)]

    def train_cli(
        self, what: str, model: Path, quant: str, *, nproc: int, version: int, flags: dict[str, Any] | None = None
    ) -> tuple[list[dict[str, Any]], list[int]]:
        """Our real CLI (train.py; torchrun for several ranks) with --max_steps.

        Returns metrics.jsonl's records and each rank's peak RSS (VmHWM, written by benchmarks/cli_probe.py).
        `flags` overrides the plan's.
        """
        p = self.plan
        out = Path(self.result_path(f"train-{quant}-{nproc}-fsdp{version}"))
        if p.batch_size % nproc:
            raise ValueError(f"batch {p.batch_size} does not split over {nproc} ranks")
        overrides = flags or {}
        flags = {
            "model": model,
            "quant": quant,
            "fsdp_version": version,
            "precision": p.precision,
            "dataset": "dummy",
            "dataset_samples": p.batch_size * (p.warmup_steps + p.measured_steps),
            "context_length": p.context_length,
            # The same global batch at any world size, so tokens per optimizer step are equal.
            "batch_size": p.batch_size // nproc,
            "lora_rank": p.lora_rank,
            "lora_alpha": p.lora_alpha,
            "lora_dropout": 0.0,
            "lora_target_modules": "all",
            "gradient_checkpointing": str(p.gradient_checkpointing).lower(),
            "max_steps": p.warmup_steps + p.measured_steps,
            "lr": 1e-5,
            "log_to": "stdout",
            "save_model": "false",
            "device": "cpu",
            "output_dir": out,
            **overrides,
        }
        args = ["-m", "benchmarks.cli_probe", str(REPO_ROOT / "train.py")] + [f"--{k}={v}" for k, v in flags.items()]
        if nproc == 1:
            cmd, env = [sys.executable, *args], base_env(p.threads)
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
            env = base_env(max(1, p.threads // nproc))
        peaks = f"{out}.peak-rss"
        env["BENCH_PEAK_RSS_FILE"] = peaks
        steps = p.warmup_steps + p.measured_steps

        self._go(
            what,
            [cmd],
            [env],
            reset=lambda: shutil.rmtree(out, ignore_errors=True),
            finished=lambda: len(run_metrics(out)) == steps,
        )
        return run_metrics(out), [int(Path(f"{peaks}.rank{r}").read_text()) for r in range(nproc)]


def run_cpu_suite(
    plan: CpuPlan, *, model: Path | None, cache: Path, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run every CPU measurement and return results.json's content."""
    suite_start = time.perf_counter()
    build_start = time.perf_counter()
    model_dir = model or ensure_model(plan, cache)
    build_s = time.perf_counter() - build_start
    config = json.loads((model_dir / "config.json").read_text())
    rows: list[dict[str, Any]] = []
    details: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-cpu-") as tmp:
        runner = Runner(plan, Path(tmp), log)
        if plan.loss:
            log("loss: --loss_chunk_tokens 512 against 0 (whole logits), step memory and tokens/s")
            _loss(runner, model_dir, cache, rows, details)
        elif plan.packing:
            log("packing: 2 ranks, --packing true against false on the bundled data")
            _packing(runner, model_dir, rows, details)
        else:
            log("1/4 loading (ours: 2 ranks, streaming, FSDP2 and FSDP1; peer: HF from_pretrained)")
            loads = _loading(runner, model_dir, rows, details)
            if not plan.large:
                # Not on the 1.1B model: one unsplit HQQ load there runs past the 600 s launch timeout on 2 cores.
                _hqq_split(runner, model_dir, rows)
                log("2/4 per-rank memory vs world size")
                _world_sizes(runner, model_dir, loads, rows, details)
                log("3/4 training throughput")
                _training(runner, model_dir, rows, details)
                log("4/4 quantization quality and size")
                _quality(runner, model_dir, config, rows, details)
        launches = runner.launches
    return {
        "suite": "cpu-large" if plan.large else "cpu-loss" if plan.loss else "cpu-packing" if plan.packing else "cpu",
        "quick": plan.quick,
        "model": model_record(model_dir, {k: config.get(k) for k in SIZE_KEYS}),
        "settings": {
            **asdict(plan),
            "precision": f"{plan.precision} parameters, storage and compute (ours --precision {plan.precision}; "
            f"peer dtype and bnb compute/storage {plan.precision})"
            + ("" if plan.precision == "bf16" else "; this CPU has no native bf16 matmul (AVX512-BF16/AMX)"),
            "quantization": "bnb nf4 + double quant, blocksize 64 (both sides) unless a row says otherwise",
            "threads": (
                f"OMP_NUM_THREADS={plan.threads} for one-process runs (ours and peer); "
                f"{max(1, plan.threads // 2)} per rank for 2-rank jobs, {max(1, plan.threads // 4)} per rank for 4"
            ),
            "our_training": "the real CLI: python train.py / torchrun train.py --max_steps, metrics.jsonl tokens_per_s",
            "adapters": f"ours: LoRA weights in {plan.precision} (qlora-fsdp stores them in --precision); "
            "peer: PEFT default fp32",
        },
        "rows": rows,
        "details": details,
        "conditions": {"build_model_s": round(build_s, 1), **launch_conditions(launches)},
        "wall_time_s": time.perf_counter() - suite_start,
    }


def _slug(version: int, quant: str) -> str:
    return f"fsdp{version}_{quant}"


def _loading(runner: Runner, model: Path, rows: list, details: dict) -> dict[int, list[list[dict[str, Any]]]]:
    """Section 1: our 2-rank streaming load (quantize + shard per layer), FSDP2 and FSDP1, against HF's 4-bit load
    in one process. Returns each version's runs (a list of per-rank records per repetition)."""
    ours: dict[int, list[list[dict[str, Any]]]] = {version: [] for version in LOAD_VERSIONS}
    peer_runs = []
    for rep in range(runner.plan.reps):
        for version in LOAD_VERSIONS:
            args = {"model": str(model), "fsdp_version": version, "quant": "bnb", "precision": runner.plan.precision}
            ours[version].append(runner.worker(f"load ours FSDP{version} 2 ranks (rep {rep + 1})", "load_ours", args,
                                               nproc=2))  # fmt: skip
        peer_args = {"model": str(model), "precision": runner.plan.precision}
        peer_runs.append(runner.worker(f"load peer (rep {rep + 1})", "load_peer", peer_args)[0])
    ours_model = ours[LOAD_VERSIONS[0]][0][0]["quantized_model_bytes"]
    peer_model = peer_runs[0]["quantized_model_bytes"]
    details["parameters"] = _parameters(model)
    details["quantized_model_bytes"] = {"ours": ours_model, "peer": peer_model}
    peer_peak = [p["peak_rss_bytes"] for p in peer_runs]
    for version, runs in ours.items():
        sec = "loading"
        kw = {"ours_label": f"qlora-fsdp FSDP{version}, 2 ranks (gloo), streaming", "peer_label": PEER_LOAD}
        v = f"_fsdp{version}"
        rows.append(row(sec, f"load_wall_s{v}", f"FSDP{version}: wall time to load + quantize + shard (slowest rank)",
                        "s", "lower", [max(r["total_s"] for r in ranks) for ranks in runs],
                        [p["load_s"] for p in peer_runs], **kw))  # fmt: skip
        for rank in range(2):
            rows.append(row(sec, f"load_peak_rss_rank{rank}_bytes{v}",
                            f"FSDP{version}: peak RSS, rank {rank} (peer: its one process)", "bytes", "lower",
                            [ranks[rank]["peak_rss_bytes"] for ranks in runs], peer_peak, **kw))  # fmt: skip
            rows.append(row(sec, f"load_rss_growth_rank{rank}_bytes{v}",
                            f"FSDP{version}: peak RSS minus RSS after imports, rank {rank}", "bytes", "lower",
                            [r[rank]["peak_rss_bytes"] - r[rank]["rss_after_imports_bytes"] for r in runs],
                            [p["peak_rss_bytes"] - p["rss_after_imports_bytes"] for p in peer_runs],
                            **kw))  # fmt: skip
        sums = [sum(r["peak_rss_bytes"] for r in ranks) for ranks in runs]
        rows.append(row(sec, f"load_peak_rss_sum_bytes{v}", f"FSDP{version}: sum of peak RSS over ranks", "bytes",
                        "lower", sums, peer_peak, **kw))  # fmt: skip
        rows.append(row(sec, f"load_rss_sum_over_model{v}",
                        f"FSDP{version}: sum of peak RSS over ranks / quantized model bytes", "x", "lower",
                        [total / ours_model for total in sums], [p / peer_model["total"] for p in peer_peak],
                        **kw))  # fmt: skip
    rows.append(row("loading", "quantized_model_bytes",
                    "quantized model bytes (packed + quant state + unquantized weights)", "bytes", "lower",
                    [ours_model], [peer_model["total"]],
                    ours_label=f"qlora-fsdp, bnb nf4, {runner.plan.precision}", peer_label=PEER_LOAD))  # fmt: skip
    return ours


def _hqq_split(runner: Runner, model: Path, rows: list) -> None:
    """Section 1, HQQ: our 2-rank FSDP2 load with the ranks sharing HQQ's whole weights out, against the same code
    streaming without the job's DistEnv (load_ours `split` false), where every rank quantizes every weight."""
    runs: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(runner.plan.reps):
        for split in (True, False):
            args = {"model": str(model), "fsdp_version": 2, "quant": "hqq", "precision": runner.plan.precision}
            ranks = runner.worker(f"load hqq 2 ranks, split {split} (rep {rep + 1})", "load_ours",
                                  {**args, "split": split}, nproc=2)  # fmt: skip
            runs[split].append(max(r["total_s"] for r in ranks))
    rows.append(row("loading", "load_wall_s_hqq_split",
                    "HQQ 4-bit, FSDP2: wall time to load + quantize + shard (slowest rank)", "s", "lower",
                    runs[True], runs[False], ours_label="qlora-fsdp, 2 ranks, each quantizes its share of the weights",
                    peer_label="the same, every rank quantizing every weight"))  # fmt: skip


def _world_sizes(runner: Runner, model: Path, loads: dict[int, list], rows: list, details: dict) -> None:
    """Section 2: what each rank holds after full_shard wrapping at 1, 2 and 4 ranks, per FSDP version and backend."""
    peer = details["quantized_model_bytes"]["peer"]
    sec = "memory vs world size"
    details["world_sizes"] = {}
    for version, quant in WORLD_COMBOS:
        slug = _slug(version, quant)
        by_world: dict[int, list[dict[str, Any]]] = {}
        for n in runner.plan.world_sizes:
            if n == 2 and quant == "bnb" and loads.get(version):
                by_world[n] = loads[version][0]  # the loading runs are this very measurement
            else:
                args = {"model": str(model), "fsdp_version": version, "quant": quant}
                args["precision"] = runner.plan.precision
                by_world[n] = runner.worker(f"load {slug} {n} rank(s)", "load_ours", args, nproc=n)
        label = f"qlora-fsdp FSDP{version} full_shard, {quant}, {runner.plan.precision}"
        kw = {"ours_label": label, "peer_label": PEER_REPLICATED}
        one = {key: max(r[key] for r in by_world[1]) for key in ("param_shard_bytes", "resident_bytes")}
        for n, ranks in by_world.items():
            params = max(r["param_shard_bytes"] for r in ranks)
            resident = max(r["resident_bytes"] for r in ranks)
            rows.append(row(sec, f"param_shard_bytes_per_rank_{slug}_n{n}",
                            f"FSDP{version} {quant}, {n} rank(s): parameter bytes per rank (largest rank)",
                            "bytes", "lower", [params], [peer["params"]], **kw))  # fmt: skip
            rows.append(row(sec, f"resident_bytes_per_rank_{slug}_n{n}",
                            f"FSDP{version} {quant}, {n} rank(s): parameters + replicated quant state + buffers",
                            "bytes", "lower", [resident], [peer["total"]], **kw))  # fmt: skip
            if n > 1:
                rows.append(row(sec, f"resident_efficiency_{slug}_n{n}",
                                f"FSDP{version} {quant}, {n} ranks: (resident bytes at 1 rank / {n}) / resident "
                                f"bytes per rank; 1.0 = everything sharded, peer 1/{n}", "x", "higher",
                                [(one["resident_bytes"] / n) / resident], [1.0 / n], **kw))  # fmt: skip
        details["world_sizes"][slug] = {
            n: {key: [r[key] for r in ranks] for key in ("param_shard_bytes", "replicated_state_bytes",
                                                          "resident_bytes")}
            for n, ranks in by_world.items()
        }  # fmt: skip


def _training(runner: Runner, model: Path, rows: list, details: dict) -> None:
    """Section 3: tokens/s of our CLI (bnb, hqq; 1 process and 2 ranks, FSDP2 and FSDP1) against HF + PEFT."""
    p = runner.plan
    skip = p.warmup_steps
    peer_tps, peer_rss = [], []
    ours: dict[str, list[float]] = {key: [] for key, *_ in p.train_runs}
    ours_rss: dict[str, list[float]] = {key: [] for key, *_ in p.train_runs}
    peer_args = {
        "model": str(model),
        "precision": p.precision,
        "lora_rank": p.lora_rank,
        "lora_alpha": p.lora_alpha,
        "batch_size": p.batch_size,
        "context_length": p.context_length,
        "steps": p.warmup_steps + p.measured_steps,
        "checkpointing": p.gradient_checkpointing,
    }
    for rep in range(p.reps):
        record = runner.worker(f"train peer (rep {rep + 1})", "train_peer", peer_args)[0]
        peer_tps.append(median([s["tokens_per_s"] for s in record["steps"][skip:]]))
        peer_rss.append(record["peak_rss_bytes"])
        for key, quant, nproc, version in p.train_runs:
            what = f"train ours {quant} x{nproc} FSDP{version} (rep {rep + 1})"
            metrics, peaks = runner.train_cli(what, model, quant, nproc=nproc, version=version)
            ours[key].append(median([m["tokens_per_s"] for m in metrics[skip:]]))
            ours_rss[key].append(max(peaks))
    shape = f"batch {p.batch_size} x {p.context_length}, LoRA r{p.lora_rank} on all linears"
    peer_label = f"{PEER_TRAIN} x {p.threads} threads"
    note = f"tokens/s: median of steps {skip + 1}-{skip + p.measured_steps} of each run, then over {p.reps} run(s)"
    for key, quant, nproc, version in p.train_runs:
        kind = "bnb nf4" if quant == "bnb" else "hqq 4-bit"
        per_rank = max(1, p.threads // nproc)
        layout = f"1 process x {p.threads} threads" if nproc == 1 else f"{nproc} ranks x {per_rank} thread(s)"
        label = f"qlora-fsdp CLI{' (torchrun)' if nproc > 1 else ''} FSDP{version}, {kind}, {layout}"
        kw = {"ours_label": f"{label}; {shape}", "peer_label": peer_label, "note": note}
        rows.append(row("training", f"tokens_per_s_{key}", f"tokens/s, {kind}, {layout}, FSDP{version}",
                        "tokens/s", "higher", ours[key], peer_tps, **kw))  # fmt: skip
        rows.append(row("training", f"train_peak_rss_{key}_bytes",
                        f"peak RSS while training (largest rank), {kind}, {layout}, FSDP{version}", "bytes", "lower",
                        ours_rss[key], peer_rss, **kw))  # fmt: skip
    details["training"] = {"peer_tokens_per_s_runs": peer_tps, "ours_tokens_per_s_runs": ours}


def _packing(runner: Runner, model: Path, rows: list, details: dict) -> None:
    """--suite cpu-packing: label tokens/s (what learning advances by) and row efficiency, packed against unpacked.

    Both train bnb on 2 ranks on the bundled data at the plan's context; the unpacked run (the same CLI, --packing
    false) is the baseline in the peer's column. Per run, over the measured steps: label tokens / seconds (a step's
    seconds are its tokens / tokens_per_s) and the median of real tokens / row tokens.
    """
    p = runner.plan
    details["parameters"] = _parameters(model)
    figures: dict[bool, dict[str, list[float]]] = {k: {"label_tps": [], "efficiency": []} for k in (True, False)}
    for rep in range(p.reps):
        for packing in (False, True):
            data = {"dataset": REPO_ROOT / "data" / "alpaca_tiny.jsonl", "dataset_samples": 0, "packing": packing}
            what = f"train {'packed' if packing else 'unpacked'} bnb x2 (rep {rep + 1})"
            metrics, _ = runner.train_cli(what, model, "bnb", nproc=2, version=2, flags=data)
            steps = metrics[p.warmup_steps :]
            seconds = sum(m["tokens"] / m["tokens_per_s"] for m in steps)
            figures[packing]["label_tps"].append(sum(m["label_tokens"] for m in steps) / seconds)
            figures[packing]["efficiency"].append(median([m["packing_efficiency"] for m in steps]))
    shape = f"data/alpaca_tiny.jsonl, batch {p.batch_size} x {p.context_length}, 2 ranks, bnb, FSDP2"
    measured = f"steps {p.warmup_steps + 1}-{p.warmup_steps + p.measured_steps} of each run, median over {p.reps}"
    kw = {"ours_label": f"--packing true; {shape}", "peer_label": "--packing false (the same CLI)", "note": measured}
    rows.append(row("packing", "label_tokens_per_s_2ranks", "label tokens/s, 2 ranks", "tokens/s", "higher",
                    figures[True]["label_tps"], figures[False]["label_tps"], **kw))  # fmt: skip
    rows.append(row("packing", "packing_efficiency", "real tokens / row tokens", "ratio", "higher",
                    figures[True]["efficiency"], figures[False]["efficiency"], **kw))  # fmt: skip
    details["packing"] = {"packed": figures[True], "unpacked": figures[False]}


def _loss(runner: Runner, model: Path, cache: Path, rows: list, details: dict) -> None:
    """--suite cpu-loss: the chunked loss (ours) against whole logits (--loss_chunk_tokens 0, the previous loss).

    Memory: peak RSS of one process training LOSS_MODEL at LOSS_SHAPE, at vocabulary 128256 minus at 512, so what
    grows is what the vocabulary costs (head, embeddings, logits). Speed: tokens/s on the suite's model, bnb.
    """
    p = runner.plan
    details["parameters"] = _parameters(model)
    peaks: dict[tuple[int, int], list[int]] = {}
    speed: dict[int, list[float]] = {LOSS_CHUNK: [], 0: []}
    for rep in range(p.reps):
        # Each repetition swaps which setting runs first, so a machine that slows down or warms up favours neither.
        order = (LOSS_CHUNK, 0) if rep % 2 == 0 else (0, LOSS_CHUNK)
        for vocab in LOSS_VOCABS:
            small = ensure_model(replace(p, model={**LOSS_MODEL, "vocab_size": vocab}), cache)
            for chunk in order:
                what = f"loss memory, vocabulary {vocab}, --loss_chunk_tokens {chunk} (rep {rep + 1})"
                flags = {**LOSS_SHAPE, "loss_chunk_tokens": chunk}
                _, rss = runner.train_cli(what, small, "bnb", nproc=1, version=2, flags=flags)
                peaks.setdefault((vocab, chunk), []).append(rss[0])
        for chunk in order:
            what = f"loss speed, --loss_chunk_tokens {chunk} (rep {rep + 1})"
            metrics, _ = runner.train_cli(what, model, "bnb", nproc=1, version=2, flags={"loss_chunk_tokens": chunk})
            speed[chunk].append(median([m["tokens_per_s"] for m in metrics[p.warmup_steps :]]))
    small_vocab, large_vocab = LOSS_VOCABS
    growth = {
        chunk: [big - base for big, base in zip(peaks[(large_vocab, chunk)], peaks[(small_vocab, chunk)], strict=True)]
        for chunk in (LOSS_CHUNK, 0)
    }
    shape = f"hidden {LOSS_MODEL['hidden_size']}, {LOSS_MODEL['num_layers']} layers, batch 1 x 2048, 1 process, bnb"
    labels = {"ours_label": f"--loss_chunk_tokens {LOSS_CHUNK}", "peer_label": "--loss_chunk_tokens 0 (whole logits)"}
    rows.append(row("loss", "loss_peak_rss_growth_bytes",
                    f"peak RSS at vocabulary {large_vocab} minus at {small_vocab} ({shape})", "bytes", "lower",
                    growth[LOSS_CHUNK], growth[0], **labels))  # fmt: skip
    for vocab in LOSS_VOCABS:
        rows.append(row("loss", f"loss_peak_rss_vocab{vocab}_bytes", f"peak RSS at vocabulary {vocab} ({shape})",
                        "bytes", "lower", peaks[(vocab, LOSS_CHUNK)], peaks[(vocab, 0)], **labels))  # fmt: skip
    layout = f"batch {p.batch_size} x {p.context_length}, 1 process x {p.threads} threads, bnb"
    rows.append(row("loss", "loss_tokens_per_s", f"tokens/s on the suite's model ({layout})", "tokens/s", "higher",
                    speed[LOSS_CHUNK], speed[0], **labels))  # fmt: skip
    details["loss"] = {"peak_rss": {f"{v}/{c}": r for (v, c), r in peaks.items()}, "tokens_per_s": speed}


def _quality(runner: Runner, model: Path, config: dict[str, Any], rows: list, details: dict) -> None:
    """Section 4: stored bits per parameter and dequantization error per format, on real weight matrices."""
    n = config["num_hidden_layers"]
    layers = sorted({0, n // 2, n - 1})
    formats = [{"name": name, "config": cfg} for _, name, cfg in FORMATS]
    record = runner.worker(
        "quantization quality", "quant_quality", {"model": str(model), "layers": layers, "formats": formats}
    )[0]
    details["quality"] = {
        "layers": [f"model.layers.{i}" for i in layers],
        "matrices": record["matrices"],
        "params": record["params"],
    }
    for slug, name, _ in FORMATS:
        sides = record["formats"][name]
        for metric, figure, unit in (
            ("bits_per_param", "stored bits per parameter (packed + quant state)", "bits"),
            ("mean_abs_error", "mean absolute error of the dequantized weights", "abs"),
            ("max_abs_error", "max absolute error of the dequantized weights", "abs"),
        ):
            rows.append(
                row(
                    "quantization",
                    f"{metric}_{slug}",
                    f"{name}: {figure}",
                    unit,
                    "lower",
                    [sides["ours"][metric]],
                    [sides["reference"][metric]],
                    ours_label="qlora_fsdp.quant backend, uint8 storage, bf16 compute",
                    peer_label=PEER_LIBRARY,
                    note=f"{record['matrices']} matrices of layers {layers}, {record['params']:,} weights",
                )
            )


def model_record(model: Path, sizes: dict[str, Any]) -> dict[str, Any]:
    """results.json's record of a suite's model: where it is, its parameters and shards, the sizes it was built
    with (or read from its config)."""
    shards = len(list(model.glob("*.safetensors")))
    return {"path": str(model), "parameters": _parameters(model), "shards": shards, "sizes": sizes}


def _parameters(model: Path) -> int:
    """Parameter count from the safetensors headers (8-byte length + JSON), without reading any tensor."""
    total = 0
    for file in sorted(model.glob("*.safetensors")):
        with open(file, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, info in header.items():
            if name != "__metadata__":
                count = 1
                for dim in info["shape"]:
                    count *= dim
                total += count
    return total
