"""Process launching, CPU-contention accounting and small statistics shared by the CPU and GPU suites.

Nothing here imports torch: the orchestrator stays light, and every measurement runs in fresh processes that
import only what they measure.
"""

from __future__ import annotations

import json
import os
import random
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
# Seconds the other ranks of a job get to finish after one rank failed, before they are killed (they would
# otherwise wait in a collective until the gloo timeout).
FAILED_RANK_GRACE_S = 10.0


def median(values: Sequence[float]) -> float:
    """The median; for an even count the mean of the middle two (statistics.median)."""
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


def free_port() -> int:
    """A free loopback port for a job's rendezvous (each launch gets its own, so jobs never collide)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def base_env(threads: int) -> dict[str, str]:
    """The environment of every measured process: repo importable, fixed thread count, nothing online."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
        WANDB_MODE="offline",
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def rank_envs(nproc: int, threads: int) -> list[dict[str, str]]:
    """The variables torchrun would set for `nproc` local ranks, so workers join one gloo/NCCL job directly."""
    port = str(free_port())
    envs = []
    for rank in range(nproc):
        env = base_env(threads)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        envs.append(env)
    return envs


def worker_cmd(module: str, name: str, args: dict[str, Any]) -> list[str]:
    """`python -m MODULE NAME JSON`: one measurement in a fresh interpreter."""
    return [sys.executable, "-m", module, name, json.dumps(args)]


# ---------------------------------------------------------------------------------------------------------------
# Contention: the machine may be shared, so every launch records how much CPU other processes took meanwhile.
# ---------------------------------------------------------------------------------------------------------------


def _busy_seconds() -> float:
    """CPU seconds all processes on the machine have spent busy since boot (from /proc/stat)."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _own_cpu_seconds() -> float:
    """CPU seconds of this process plus its reaped children (workers, torchrun and its ranks)."""
    return _cpu_seconds(resource.RUSAGE_SELF) + _cpu_seconds(resource.RUSAGE_CHILDREN)


class ForeignLoad:
    """Average number of cores that processes other than ours kept busy between start() and stop()."""

    def __init__(self) -> None:
        self._t = self._busy = self._own = 0.0

    def start(self) -> ForeignLoad:
        self._t, self._busy, self._own = time.perf_counter(), _busy_seconds(), _own_cpu_seconds()
        return self

    def stop(self) -> float:
        wall = max(time.perf_counter() - self._t, 1e-9)
        foreign = (_busy_seconds() - self._busy) - (_own_cpu_seconds() - self._own)
        return max(foreign, 0.0) / wall


def wait_for_idle(max_wait_s: float, *, threshold_cores: float = 0.3, sample_s: float = 1.0) -> float:
    """Wait (at most `max_wait_s`) until other processes use under `threshold_cores`; returns seconds waited."""
    start = time.perf_counter()
    while time.perf_counter() - start < max_wait_s:
        probe = ForeignLoad().start()
        time.sleep(sample_s)
        if probe.stop() < threshold_cores:
            break
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Launch:
    """What one launch of one or more processes did."""

    returncode: int
    wall_s: float
    cpu_s: float
    """CPU seconds the launched processes used (their own and their reaped children's)."""
    foreign_cores: float
    """Average cores other processes on the machine used meanwhile: contention that slows wall-clock figures."""
    log: str
    """The tail of every process's combined stdout/stderr."""

    def check(self, what: str) -> Launch:
        if self.returncode != 0:
            raise RuntimeError(f"{what} failed with exit status {self.returncode}:\n{self.log}")
        return self


def launch(
    cmds: Sequence[Sequence[str]], envs: Sequence[dict[str, str]], *, timeout_s: float, log_chars: int = 6000
) -> Launch:
    """Run the commands concurrently (the ranks of one job) and wait for all; kill the lot on timeout.

    Output goes to temporary files, not pipes, so a chatty rank can never block. Each process gets its own
    session, so a timeout kills exactly the processes this call started (and their children, e.g. torchrun's).
    """
    children_before = _cpu_seconds(resource.RUSAGE_CHILDREN)
    load = ForeignLoad().start()
    start = time.perf_counter()
    procs: list[tuple[subprocess.Popen, Any]] = []
    returncode = 0
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as tmp:
        try:
            for i, (cmd, env) in enumerate(zip(cmds, envs, strict=True)):
                out = open(Path(tmp) / f"{i}.log", "w+")  # noqa: SIM115 - closed below
                proc = subprocess.Popen(
                    list(cmd), cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
                procs.append((proc, out))
            first_failure: float | None = None
            while any(p.poll() is None for p, _ in procs):
                now = time.perf_counter()
                failed = [p.returncode for p, _ in procs if p.returncode not in (None, 0)]
                if failed and first_failure is None:
                    first_failure = now
                if now - start > timeout_s:
                    returncode = 124
                    break
                if first_failure is not None and now - first_failure > FAILED_RANK_GRACE_S:
                    break
                time.sleep(0.05)
        finally:
            for proc, _ in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        wall = time.perf_counter() - start
        foreign = load.stop()
        if returncode == 0:
            returncode = next((p.returncode for p, _ in procs if p.returncode != 0), 0)
        logs = []
        for i, (_, out) in enumerate(procs):
            out.seek(0)
            text = out.read()
            out.close()
            logs.append(f"--- process {i} ---\n{text[-log_chars:]}")
    cpu = _cpu_seconds(resource.RUSAGE_CHILDREN) - children_before
    return Launch(returncode=returncode, wall_s=wall, cpu_s=cpu, foreign_cores=foreign, log="\n".join(logs))


def run_metrics(output_dir: Path) -> list[dict[str, Any]]:
    """A training run's metrics.jsonl records so far ([] before it writes one): a launch is finished when it has
    its steps."""
    path = output_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def write_long_rows(path: Path, *, rows: int, words: int, seed: int) -> Path:
    """A JSONL of `rows` text rows, each `words` random words of data/alpaca_tiny.jsonl (seeded: the same file).

    Every word is at least one token of any tokenizer that splits at spaces, so with `words` above a run's context
    each row is truncated to exactly that many tokens: long-context runs train full rows, unlike `--dataset dummy`,
    whose rows end after about 3,000 words."""
    vocab: set[str] = set()
    for line in (REPO_ROOT / "data" / "alpaca_tiny.jsonl").read_text().splitlines():
        if line.strip():
            for value in json.loads(line).values():
                vocab.update(re.findall(r"[A-Za-z]+", str(value)))
    rng = random.Random(seed)
    choices = sorted(vocab)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": " ".join(rng.choices(choices, k=words))}) + "\n" for _ in range(rows)))
    return path


def read_json(path: str | os.PathLike) -> Any:
    with open(path) as fh:
        return json.load(fh)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write atomically: a reader (the orchestrator) never sees half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)


def peak_rss_bytes() -> int:
    """This process's own resident-set high-water mark: VmHWM of /proc/self/status.

    Not ru_maxrss: Linux carries the parent's high-water mark into a child through fork and exec, so a worker
    started by a process that once held 1.7 GiB reports at least 1.7 GiB there (see maxrss_bytes).
    """
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return maxrss_bytes()


def reset_peak_rss() -> None:
    """Restart this process's VmHWM from its current RSS (Linux's clear_refs "5"), so a peak after loading is the
    training's own; where the kernel refuses, the peak keeps counting from the start."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


def maxrss_bytes() -> int:
    """getrusage's ru_maxrss (KiB on Linux, bytes on macOS), which includes the launcher's peak; kept for reference."""
    scale = 1 if sys.platform == "darwin" else 1024
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale


def current_rss_bytes() -> int:
    """The resident set now, e.g. after the imports: the part of the peak that loading cannot be blamed for."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def machine_info() -> dict[str, Any]:
    """Where the figures come from: CPU model, core count, memory, and library versions."""
    info: dict[str, Any] = {"cores": os.cpu_count(), "python": sys.version.split()[0]}
    try:
        with open("/proc/cpuinfo") as fh:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), "unknown")
        with open("/proc/meminfo") as fh:
            info["memory_gib"] = round(int(fh.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    from importlib import metadata

    for dist in ("torch", "transformers", "peft", "bitsandbytes", "hqq"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = "not installed"
    return info
