"""The one harness every suite runs on: models, launch and contention, RSS, rows (ours / peer), the Runner, results.

Nothing here imports torch: Linux hands the orchestrator's RSS high-water mark to every child, so it stays light and
each measurement runs in a fresh process that imports only what it measures.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Self

REPO_ROOT = Path(__file__).resolve().parents[1]
FAILED_RANK_GRACE_S = 10.0
"""Seconds the other ranks get after one failed, before they are killed (else they wait in a collective)."""
EXIT_ABORT = "terminate called without an active exception"
"""The FSDP + gloo teardown race (benchmarks/README.md): a run that wrote every step and then aborted is kept."""
WORDS = REPO_ROOT / "data" / "alpaca_tiny.jsonl"


def llama(hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int, vocab: int,
          shards: int) -> dict[str, int]:  # fmt: skip
    """scripts/make_tiny_model.py's size flags."""
    return dict(hidden_size=hidden, num_layers=layers, intermediate_size=intermediate, num_heads=heads,
                num_kv_heads=kv_heads, vocab_size=vocab, num_shards=shards)  # fmt: skip


FULL_MODEL = llama(1024, 12, 2816, 16, 16, 8192, 3)
"""About 171M parameters: 12 Llama layers of 12.6M + 8192-token embeddings."""
QUICK_MODEL = llama(256, 2, 512, 4, 4, 512, 2)
LARGE_MODEL = llama(2048, 22, 5632, 32, 4, 32000, 5)
"""TinyLlama's shape, about 1.1B parameters in five fp32 shards of 0.88 GB: loading at a size where memory tells."""


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def alternating(reps: int, items: Sequence[Any], measure: Callable[[Any, int], Any]) -> dict[Any, list[Any]]:
    """`measure(item, rep)` of every item in each repetition, the order reversed on odd repetitions so that a machine
    that drifts favours no side; each item's results."""
    runs: dict[Any, list[Any]] = {item: [] for item in items}
    for rep in range(reps):
        for item in items if rep % 2 == 0 else items[::-1]:
            runs[item].append(measure(item, rep))
    return runs


def bundled_words() -> list[str]:
    """The words of data/alpaca_tiny.jsonl, sorted: every tiny model's tokenizer was trained on them."""
    lines = filter(str.strip, WORDS.read_text().splitlines())
    return sorted({w for line in lines for v in json.loads(line).values() for w in re.findall(r"[A-Za-z]+", str(v))})


def word_tokens(tokenizer_file: Path) -> tuple[Any, dict[str, int]]:
    """The tokenizer and each bundled word's tokens after a space: what rows of a chosen token count are built of."""
    from tokenizers import Tokenizer  # the Rust library alone: the harness stays without torch

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    return tokenizer, {w: len(tokenizer.encode(" " + w, add_special_tokens=False).ids) for w in bundled_words()}


def write_long_rows(path: Path, *, rows: int, words: int, seed: int) -> Path:
    """`rows` rows of `words` random bundled words (seeded): a word is a token or more, so rows fill any context."""
    rng, choices = random.Random(seed), bundled_words()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": " ".join(rng.choices(choices, k=words))}) + "\n" for _ in range(rows)))
    return path


def base_env(threads: int, *, pin_tokenizers: bool = True) -> dict[str, str]:
    """Every measured process's environment: repo importable, fixed thread count, nothing online."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), WANDB_MODE="offline", HF_HUB_OFFLINE="1",
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")  # fmt: skip
    if not pin_tokenizers:
        env.pop("TOKENIZERS_PARALLELISM")
    return env


def rank_envs(nproc: int, threads: int) -> list[dict[str, str]]:
    """torchrun's variables for `nproc` local ranks, so workers join one job directly (a fresh port each launch)."""
    from qlora_fsdp.parallel.distributed import free_port  # here: the harness imports no torch of its own

    port = str(free_port())
    return [{**base_env(threads), "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
             "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            for r in range(nproc)]  # fmt: skip


def worker_cmd(module: str, name: str, args: dict[str, Any]) -> list[str]:
    return [sys.executable, "-m", module, name, json.dumps(args)]


def worker_main(workers: Sequence[Callable[[dict[str, Any]], None]]) -> None:
    """`python -m MODULE NAME JSON_ARGS`: one measurement in a fresh interpreter."""
    by_name = {f.__name__: f for f in workers}
    if len(sys.argv) != 3 or sys.argv[1] not in by_name:
        raise SystemExit(f"usage: python -m MODULE {{{','.join(by_name)}}} JSON_ARGS")
    by_name[sys.argv[1]](json.loads(sys.argv[2]))


def _busy_seconds() -> float:
    """CPU seconds every process on the machine has spent busy since boot (/proc/stat: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _cpu_seconds(*who: int) -> float:
    return sum(resource.getrusage(w).ru_utime + resource.getrusage(w).ru_stime for w in who)


class ForeignLoad:
    """Average cores that processes other than ours (this one and its reaped children) kept busy meanwhile."""

    def __init__(self) -> None:
        self._t, self._busy = time.perf_counter(), _busy_seconds()
        self._own = _cpu_seconds(resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)

    def stop(self) -> float:
        own = _cpu_seconds(resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) - self._own
        return max(_busy_seconds() - self._busy - own, 0.0) / max(time.perf_counter() - self._t, 1e-9)


def wait_for_idle(max_wait_s: float, threshold_cores: float = 0.3) -> float:
    """Wait (at most `max_wait_s`) until other processes use under `threshold_cores`; returns seconds waited."""
    start = time.perf_counter()
    while time.perf_counter() - start < max_wait_s:
        probe = ForeignLoad()
        time.sleep(1.0)
        if probe.stop() < threshold_cores:
            break
    return time.perf_counter() - start


@dataclass
class Launch:
    """What one launch of one or more processes did."""

    returncode: int
    wall_s: float
    cpu_s: float
    foreign_cores: float
    """Average cores other processes used meanwhile: contention that slows wall-clock figures."""
    log: str
    """The tail of every process's combined stdout/stderr."""

    def check(self, what: str) -> Launch:
        if self.returncode != 0:
            raise RuntimeError(f"{what} failed with exit status {self.returncode}:\n{self.log}")
        return self


def launch(cmds: Sequence[Sequence[str]], envs: Sequence[dict[str, str]], *, timeout_s: float) -> Launch:
    """Run the ranks of one job and wait for all; output to files (a chatty rank never blocks a pipe), a session
    each (a kill on timeout reaches exactly what this call started, torchrun's ranks included)."""
    children_before, load, start = _cpu_seconds(resource.RUSAGE_CHILDREN), ForeignLoad(), time.perf_counter()
    procs: list[subprocess.Popen] = []
    returncode, failed_at = 0, math.inf
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as tmp:
        logs = [Path(tmp) / f"{i}.log" for i in range(len(cmds))]
        try:
            for cmd, env, log in zip(cmds, envs, logs, strict=True):
                with open(log, "w") as out:  # the child holds its own copy of the descriptor
                    procs.append(subprocess.Popen(list(cmd), cwd=REPO_ROOT, env=env, stdout=out,
                                                  stderr=subprocess.STDOUT, start_new_session=True))  # fmt: skip
            while any(p.poll() is None for p in procs):
                now = time.perf_counter()
                if any(p.returncode not in (None, 0) for p in procs):
                    failed_at = min(failed_at, now)
                if now - start > timeout_s:
                    returncode = 124
                if returncode or now - failed_at > FAILED_RANK_GRACE_S:
                    break
                time.sleep(0.05)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        wall, foreign = time.perf_counter() - start, load.stop()
        returncode = returncode or next((p.returncode for p in procs if p.returncode != 0), 0)
        log = "\n".join(f"--- process {i} ---\n{path.read_text()[-6000:]}" for i, path in enumerate(logs[: len(procs)]))
    cpu = _cpu_seconds(resource.RUSAGE_CHILDREN) - children_before
    return Launch(returncode=returncode, wall_s=wall, cpu_s=cpu, foreign_cores=foreign, log=log)


def shell(cmd: Sequence[str]) -> str:
    """A command line as one would type it (the venv's python shown as `python`)."""
    return " ".join("python" if c == sys.executable else c for c in cmd).replace(str(REPO_ROOT) + "/", "")


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text())


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Atomically: a reader never sees half a file."""
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    tmp.replace(path)


def run_metrics(output_dir: Path) -> list[dict[str, Any]]:
    """A training run's metrics.jsonl records so far ([] before the first)."""
    path = output_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def peak_rss_bytes() -> int:
    """This process's own RSS high-water mark, VmHWM; not ru_maxrss, which Linux carries over from the parent."""
    status = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def reset_peak_rss() -> None:
    """Restart VmHWM from the current RSS (clear_refs "5"); where the kernel refuses, it keeps counting."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def maxrss_bytes() -> int:
    """ru_maxrss (KiB on Linux), the launcher's peak included; kept for reference."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def current_rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def machine_info() -> dict[str, Any]:
    """Where the figures come from: CPU model, cores, memory, library versions."""
    cpu = Path("/proc/cpuinfo").read_text().splitlines()
    info: dict[str, Any] = {
        "cores": os.cpu_count(), "python": sys.version.split()[0],
        "cpu": next((ln.split(":", 1)[1].strip() for ln in cpu if ln.startswith("model name")), "unknown"),
        "memory_gib": round(int(Path("/proc/meminfo").read_text().split()[1]) / 2**20, 1),
    }  # fmt: skip
    for dist in ("torch", "transformers", "peft", "bitsandbytes", "hqq"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = "not installed"
    return info


def row(section: str, key: str, figure: str, unit: str, better: str, ours_runs: Sequence[float],
        peer_runs: Sequence[float], *, ours_label: str = "", peer_label: str = "",
        note: str = "") -> dict[str, Any]:  # fmt: skip
    """One comparison row; every suite reports through these, so results.json has one shape."""
    if better not in ("higher", "lower"):
        raise ValueError(f"better must be higher or lower, got {better!r}")
    ours, peer = median(ours_runs), median(peer_runs)
    if peer == 0:
        raise ValueError(f"{key}: the peer's figure is zero, no ratio")
    out = {"section": section, "key": key, "figure": figure, "unit": unit, "better": better, "ours": ours,
           "peer": peer, "ratio": ours / peer,
           "runs": {"ours": [float(v) for v in ours_runs], "peer": [float(v) for v in peer_runs]}}  # fmt: skip
    out.update({k: v for k, v in (("ours_label", ours_label), ("peer_label", peer_label), ("note", note)) if v})
    return out


def figure_rows(section: str, figures: Iterable[tuple[str, str, str, str]], ours: Sequence[dict[str, Any]],
                peer: Sequence[dict[str, Any]], *, suffix: str = "", prefix: str = "",
                **labels: str) -> list[dict]:  # fmt: skip
    """A row per (key, figure, unit, better), from each repetition's summary dict of either side."""
    return [row(section, f"{key}{suffix}", f"{prefix}{figure}", unit, better, [s[key] for s in ours],
                [s[key] for s in peer], **labels) for key, figure, unit, better in figures]  # fmt: skip


def keyed_rows(section: str, figures: Sequence[tuple[str, ...]], *sides: Any, **kw: Any) -> dict[str, dict]:
    """figure_rows by each figure's own key (without `suffix`): a suite reads the ratios its bars are judged on."""
    return dict(zip((f[0] for f in figures), figure_rows(section, figures, *sides, **kw), strict=True))


def behind(rows: Sequence[dict[str, Any]], n: int = 3) -> list[dict[str, Any]]:
    """The `n` rows where we trail the peer most."""
    badness = {id(r): r["ratio"] if r["better"] == "lower" else 1.0 / r["ratio"] for r in rows}
    return sorted((r for r in rows if badness[id(r)] > 1.0), key=lambda r: badness[id(r)], reverse=True)[:n]


def brief(run: dict[str, Any], keep: tuple[str, ...], drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """A run for results.json: without its raw records, and of each step the fields in `keep`."""
    out = {k: v for k, v in run.items() if k not in ("metrics", *drop)}
    out["steps"] = [{k: m[k] for k in keep if k in m} for m in run["metrics"]]
    return out


def tensor_headers(model: Path) -> dict[str, dict[str, Any]]:
    """Every tensor's dtype and shape from the safetensors headers, reading no tensor."""
    tensors: dict[str, dict[str, Any]] = {}
    for file in sorted(model.glob("*.safetensors")):
        with open(file, "rb") as fh:
            tensors.update(json.loads(fh.read(int.from_bytes(fh.read(8), "little"))))
    tensors.pop("__metadata__", None)
    return tensors


def parameters(model: Path) -> int:
    return sum(math.prod(v["shape"]) for v in tensor_headers(model).values())


def model_record(model: Path, sizes: dict[str, Any] | None = None) -> dict[str, Any]:
    """results.json's model: its path, parameters, shards and sizes (by default from its config)."""
    if sizes is None:
        config = read_json(model / "config.json")
        keys = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size")
        sizes = {k: config.get(k) for k in keys}
    return {"path": str(model), "parameters": parameters(model), "shards": len(list(model.glob("*.safetensors"))),
            "sizes": sizes}  # fmt: skip


@dataclass(kw_only=True)
class Settings:
    """How a suite launches and waits: what every CPU plan holds besides its sizes."""

    threads: int = 2
    """Threads of a one-process run; each rank of an N-rank job gets threads // N (at least 1)."""
    idle_wait_s: float = 30.0
    """Before each launch, wait up to this long for other processes to go quiet."""
    idle_wait_budget_s: float = 150.0
    retry_above_cores: float = 0.5
    """Measure again (once) when other processes took more than this many cores during a launch."""
    retries: int = 1
    launch_timeout_s: float = 600.0
    quick: bool = False
    precision: str = "bf16"
    """Both sides' dtype: bf16, or fp32 on a CPU without native bf16 matmuls (there torch's bf16 matmul is ~100x
    slower than fp32)."""
    lora_rank: int = 16
    lora_alpha: float = 32.0

    def configure(self, *, threads: int = 2, precision: str | None = None, idle_wait_s: float | None = None,
                  reps: int | None = None) -> Self:  # fmt: skip
        """The command line's launch flags, then `check`: the plan, ready. A quick plan waits for nobody unless told,
        and keeps a contended launch (its figures mean nothing; a test's other worker keeps the machine busy)."""
        flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
        self.threads = threads
        self.precision = precision or ("bf16" if "avx512_bf16" in flags or "amx_bf16" in flags else "fp32")
        self.idle_wait_s = idle_wait_s if idle_wait_s is not None else 0.0 if self.quick else self.idle_wait_s
        self.retries = 0 if self.quick else self.retries
        for name in ("reps", "build_reps", "train_reps"):
            if reps is not None and hasattr(self, name):
                setattr(self, name, reps)
        self.check()
        return self

    def check(self) -> None:
        """A suite's refusal (ValueError) of sizes it cannot measure with; `configure` ends with it."""


class Runner:
    """Launches in a scratch directory after a quiet wait; re-measures a failed or contended launch once; logs all."""

    def __init__(self, plan: Settings, work: Path, env: Callable[[int], dict[str, str]] = base_env) -> None:
        self.plan, self.work, self.env = plan, work, env
        self.launches: list[dict[str, Any]] = []
        self.waited = self.build_s = 0.0
        self.started = time.perf_counter()
        self._n = 0

    def model(self, sizes: dict[str, int], cache: Path) -> Path:
        """The random Llama of these sizes, built once under `cache` in a process of its own (it holds fp32 twice)."""
        start, path = time.perf_counter(), cache / ("llama-" + "-".join(f"{v}" for v in sizes.values()))
        if not (path / "model.safetensors.index.json").is_file():
            flags = [f"--{k}={v}" for k, v in sizes.items()]
            cmd = [sys.executable, str(REPO_ROOT / "scripts" / "make_tiny_model.py"), f"--output={path}", *flags]
            job = launch([cmd], [base_env(self.plan.threads)], timeout_s=self.plan.launch_timeout_s)
            job.check("building the model")
        self.build_s += time.perf_counter() - start
        return path

    def go(self, what: str, cmds: list[list[str]], envs: list[dict[str, str]], *,
           reset: Callable[[], None] | None = None, finished: Callable[[], bool] | None = None) -> Launch:  # fmt: skip
        """Launch and record; a non-zero exit is kept when `finished()` and the log shows EXIT_ABORT."""
        contention_retries, failure_retries = self.plan.retries, 1
        for attempt in range(1, 10):
            if reset is not None:
                reset()
            budget = min(self.plan.idle_wait_s, self.plan.idle_wait_budget_s - self.waited)
            waited = wait_for_idle(budget) if budget > 0 else 0.0
            self.waited += waited
            result = launch(cmds, envs, timeout_s=self.plan.launch_timeout_s)
            entry = {"what": what, "attempt": attempt, "wall_s": round(result.wall_s, 2),
                     "cpu_s": round(result.cpu_s, 2), "foreign_cores": round(result.foreign_cores, 3),
                     "waited_for_idle_s": round(waited, 1), "discarded": False}  # fmt: skip
            self.launches.append(entry)
            if result.returncode != 0:
                if finished is not None and finished() and EXIT_ABORT in result.log:
                    entry["aborted_at_exit_after_finishing"] = True
                elif failure_retries > 0:
                    failure_retries -= 1
                    entry.update(discarded=True, failed=f"exit status {result.returncode}")
                    print(f"  {what}: failed with exit status {result.returncode}; trying once more")
                    continue
                else:
                    result.check(what)
            if result.foreign_cores > self.plan.retry_above_cores and contention_retries > 0:
                contention_retries -= 1
                entry["discarded"] = True
                print(f"  {what}: other processes used {result.foreign_cores:.2f} cores; measuring again")
                continue
            print(f"  {what}: {result.wall_s:.1f} s (other processes used {result.foreign_cores:.2f} cores)")
            return result
        raise RuntimeError(f"{what}: no usable measurement in 9 attempts")

    def result_path(self, stem: str) -> Path:
        self._n += 1
        return self.work / f"{self._n:03d}-{stem}"

    def worker(self, what: str, name: str, args: dict[str, Any], *, nproc: int = 1) -> list[dict[str, Any]]:
        """A benchmarks.cpu_workers measurement on `nproc` ranks (load_ours always as a job); each rank's record."""
        result = str(self.result_path(name))
        cmd = worker_cmd("benchmarks.cpu_workers", name, {**args, "result": result})
        if nproc == 1 and name != "load_ours":
            self.go(what, [cmd], [base_env(self.plan.threads)])
            return [read_json(result)]
        self.go(what, [cmd] * nproc, rank_envs(nproc, max(1, self.plan.threads // nproc)))
        return [read_json(f"{result}.rank{r}.json") for r in range(nproc)]

    def flags(self, stem: str, **flags: Any) -> dict[str, Any]:
        """train.py's flags every CPU run shares (LoRA on every linear, no saving, stdout), then `flags`."""
        p = self.plan
        return {"precision": p.precision, "lora_rank": p.lora_rank, "lora_alpha": p.lora_alpha, "lora_dropout": 0.0,
                "lora_target_modules": "all", "lr": 1e-5, "log_to": "stdout", "save_model": "false",
                "device": "cpu", "output_dir": self.result_path(stem), **flags}  # fmt: skip

    def profiled(self, what: str, stem: str, *, nproc: int, steps: int, fills: tuple[int, int, float],
                 **flags: Any) -> dict[str, Any]:  # fmt: skip
        """A torchrun job of bnb LoRA under the step probe, its last step profiled (the log left out); every step
        must train `fills` (tokens, label tokens, packing efficiency): rows that fill, unpadded."""
        flags = self.flags(stem, quant="bnb", dataset_cache_dir=self.work / "tokenized", dataset_num_proc=1,
                           max_steps=steps, profile="true", profile_steps=f"{steps},{steps}", **flags)  # fmt: skip
        run = self.train(what, flags, nproc=nproc, steps=steps, probe="steps", torchrun=True)
        del run["log"]
        got = [(m["tokens"], m["label_tokens"], m["packing_efficiency"]) for m in run["metrics"]]
        if any(g != fills for g in got):
            raise RuntimeError(f"{what}: (tokens, label tokens, packing efficiency) per step {got}, expected {fills} "
                               "at every step")  # fmt: skip
        return run

    def train(self, what: str, flags: dict[str, Any], *, nproc: int, steps: int, probe: str = "peak",
              torchrun: bool = False, torchrun_args: Sequence[str] = (), wrap: Sequence[str] = (),
              reset: Callable[[], None] | None = None,
              done: Callable[[], bool] = lambda: True) -> dict[str, Any]:  # fmt: skip
        """Our real CLI, `train.py` (torchrun for several ranks) inside benchmarks/probe.py: probe "peak" gives each
        rank's VmHWM at exit, "steps" each rank's per-step RSS and the profiled step's tensor peak (`ranks`). `wrap`
        prefixes the command (a timer); `done` is what a launch that aborted at exit must leave besides the steps."""
        out, files = Path(flags["output_dir"]), f"{flags['output_dir']}.{probe}"
        cmd = [sys.executable, "-m", "benchmarks.probe", str(REPO_ROOT / "train.py"),
               *(f"--{k}={v}" for k, v in flags.items())]  # fmt: skip
        if nproc > 1 or torchrun:
            cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *torchrun_args]
        env = self.env(max(1, self.plan.threads // nproc))
        env["BENCH_STEP_RSS_FILE" if probe == "steps" else "BENCH_PEAK_RSS_FILE"] = files
        rank_files = [Path(f"{files}.rank{r}") for r in range(nproc)]

        def fresh() -> None:
            shutil.rmtree(out, ignore_errors=True)
            for f in rank_files:
                f.unlink(missing_ok=True)
            if reset is not None:
                reset()

        result = self.go(what, [[*wrap, *cmd]], [env], reset=fresh,
                         finished=lambda: len(run_metrics(out)) == steps and done())  # fmt: skip
        records = run_metrics(out)
        if len(records) != steps:
            raise RuntimeError(f"{what}: {len(records)} metrics records, expected {steps}:\n{result.log}")
        if missing := [r for r, f in enumerate(rank_files) if not f.is_file()]:
            raise RuntimeError(f"{what}: no probe record from rank(s) {missing}:\n{result.log}")
        run = {"command": shell(cmd), "wall_s": result.wall_s, "foreign_cores": result.foreign_cores,
               "metrics": records, "log": result.log}  # fmt: skip
        if probe == "peak":
            return {**run, "exit_peak_rss_bytes": [int(f.read_text()) for f in rank_files]}
        run["ranks"] = [read_json(f) for f in rank_files]
        for r in run["ranks"]:
            if not r["reset"] or r["baseline_rss_bytes"] is None or len(r["steps"]) != steps:
                raise RuntimeError(f"{what}: rank {r['rank']}'s probe did not measure every step: {r}")
            if flags.get("profile") == "true":
                trace = out / "profile" / f"trace-rank{r['rank']}.json"
                events = [e["args"] for e in read_json(trace)["traceEvents"] if e.get("name") == "[memory]"]
                cpu = [a["Total Allocated"] for a in events if a.get("Device Type") == 0]  # live tensor bytes
                if not cpu:
                    raise RuntimeError(f"{trace}: no CPU memory events (was the profiler run with profile_memory?)")
                r["tensor_peak_bytes"], r["memory_events"] = max(cpu), len(cpu)
                trace.unlink()  # tens of MB a rank, hundreds at long context
        return run

    def results(self, suite: str, rows: list[dict[str, Any]], details: dict[str, Any], settings: dict[str, Any],
                **extra: Any) -> dict[str, Any]:  # fmt: skip
        """results.json: the plan and `settings` (precision as its flag and the thread layout by default), rows,
        details, every launch."""
        launches = self.launches
        foreign = [e["foreign_cores"] for e in launches if not e["discarded"]]
        conditions = {"build_model_s": round(self.build_s, 1), "launches": launches,
                      "foreign_cores_median": median(foreign) if foreign else 0.0,
                      "foreign_cores_max": max(foreign, default=0.0),
                      "waited_for_idle_s": round(sum(e["waited_for_idle_s"] for e in launches), 1),
                      "discarded_launches": sum(e["discarded"] for e in launches),
                      "aborted_at_exit_after_finishing": sum("aborted_at_exit_after_finishing" in e for e in launches),
                      }  # fmt: skip
        threads = self.plan.threads
        settings = {**asdict(self.plan), "precision": f"--precision {self.plan.precision}",
                    "threads": f"OMP_NUM_THREADS={threads} for a one-process run, {threads} // N (at least 1) per rank "
                               "of an N-rank job", **settings}  # fmt: skip
        return {"suite": suite, "quick": self.plan.quick, **extra, "settings": settings, "rows": rows,
                "details": details, "conditions": conditions,
                "wall_time_s": time.perf_counter() - self.started}  # fmt: skip


@contextlib.contextmanager
def session(plan: Settings, suite: str, **kw: Any) -> Iterator[Runner]:
    """A Runner in a scratch directory that is removed afterwards."""
    with tempfile.TemporaryDirectory(prefix=f"bench-{suite}-") as tmp:
        yield Runner(plan, Path(tmp), **kw)


def step_peaks(run: dict[str, Any], steps: int) -> dict[str, int]:
    """A `probe="steps"` run's peaks, largest rank: the profiled last step's tensors, RSS (growth) of the others."""
    measured = [(s, r) for r in run["ranks"] for s in r["steps"][: steps - 1]]
    return {"tensor_peak_bytes": max(r["tensor_peak_bytes"] for r in run["ranks"]),
            "rss_peak_growth_bytes": max(s["peak_rss_bytes"] - r["baseline_rss_bytes"] for s, r in measured),
            "peak_rss_bytes": max(s["peak_rss_bytes"] for s, _ in measured)}  # fmt: skip


def choose(flag: str, given: tuple[str, ...], allowed: tuple[str, ...]) -> tuple[str, ...]:
    """A suite option's values, once each in the order given; ValueError names the choices."""
    if set(given) - set(allowed) or not given:
        raise ValueError(f"{flag}: choose from {', '.join(allowed)} (got {','.join(given) or 'nothing'})")
    return tuple(dict.fromkeys(given))
