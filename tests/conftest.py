"""Shared fixtures: the tiny model (built once per session) and launchers for the real CLI."""

from __future__ import annotations

import atexit
import gc
import json
import multiprocessing.process
import os
import select
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import torch

from qlora_fsdp.compat import fsdp2_uint8_problem
from scripts.make_tiny_model import build_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[1]
TESTS = REPO_ROOT / "tests"
DATASET = REPO_ROOT / "data" / "alpaca_tiny.jsonl"
TORCHRUN = Path(sys.executable).with_name("torchrun")
# What torchrun sets that says a process is one rank of a job (qlora_fsdp/parallel/distributed.py reads them).
LAUNCHER_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
# Whether this torch's FSDP2 shards uint8 parameters (2.12+), as the trainer asks; older ones get the float view by
# default (qlora_fsdp/parallel/fsdp2.py).
UINT8_FSDP2 = fsdp2_uint8_problem() is None
# Threads of a test process: the cores shared among pytest-xdist's workers. Two workers of two threads on two cores
# spin-wait for each other's cores (OpenMP): the fast tier took 155 s of pytest instead of 93 s. Ranks a test
# launches run one thread each (worker_env).
THREADS = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
torch.set_num_threads(THREADS)
# Tokenized caches of a test session stay in a directory of its own (launched CLIs and pytest-xdist's workers inherit
# it), not the user's, removed when the process that made it exits.
if "HF_DATASETS_CACHE" not in os.environ:
    os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="qlora-test-datasets-")
    atexit.register(shutil.rmtree, os.environ["HF_DATASETS_CACHE"], ignore_errors=True)


# The longest test files (several multi-process launches each) first, longest first, as measured in a whole run; paths
# under tests/, since two folders may hold files of the same name (tests/unit/test_layout.py checks that each exists):
# pytest-xdist hands whole files to its workers in collection order, so a long file collected last would run alone at
# the end while the other worker idles.
LONG_FILES = (
    "distributed/test_after_training_bnb.py", "distributed/test_options.py", "distributed/test_after_training_hqq.py",
    "distributed/test_reliability.py", "distributed/test_packing_eval.py", "distributed/test_options_fsdp1.py",
    "benchmarks/test_harness.py", "distributed/test_elastic_resume.py", "distributed/test_preference_smollm2.py",
    "distributed/test_kto_smollm2.py", "distributed/test_vlm.py", "distributed/test_data_scale.py",
    "distributed/test_moe_e2e.py", "cli/test_chat_training.py", "distributed/test_train_e2e.py",
    "distributed/test_moe_matrix.py", "distributed/test_grpo.py", "distributed/test_sequence_parallel.py",
    "benchmarks/test_long_context_suite.py", "distributed/test_run_parity.py", "distributed/test_grpo_run_parity.py",
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    gpu_dir = TESTS / "gpu"
    stray = [item.nodeid for item in items if item.get_closest_marker("gpu") and gpu_dir not in item.path.parents]
    if stray:  # the GPU tier (benchmarks/gpu.sh) collects tests/gpu alone: a gpu test elsewhere would never run
        raise pytest.UsageError(f"gpu-marked tests outside tests/gpu: {', '.join(stray)}")
    for item in items:
        if "smollm2" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.smollm2)

    def rank(item: pytest.Item) -> int:
        name = item.path.relative_to(TESTS).as_posix() if TESTS in item.path.parents else ""
        return LONG_FILES.index(name) if name in LONG_FILES else len(LONG_FILES)

    items.sort(key=rank)  # stable: the order within a file, and of the other files, stays


def pytest_collection_finish(session: pytest.Session) -> None:
    """Everything imported and collected so far lives for the whole session: frozen, Python's full collections (the
    automatic ones and the trainer's at teardown) skip it instead of walking half a million objects each time."""
    gc.freeze()


_launched: list[str] = []


def _audit(event: str, args: tuple) -> None:
    """Records the processes a test starts: forks (datasets' and multiprocessing's workers) and commands run from
    the repository (the CLI, scripts, benchmarks, torchrun). A library's own tool call (inductor asking the C++
    compiler) is not the test's doing."""
    if event in ("os.fork", "os.forkpty"):
        _launched.append(event)
    elif event == "subprocess.Popen":
        _executable, argv, cwd, _env = args
        words = [str(a) for a in (argv if isinstance(argv, (list, tuple)) else [argv])]
        program = Path(words[0]).name
        ours = [w for w in words[1:] if str(REPO_ROOT) in w and sys.prefix not in w]  # the venv's are not ours
        from_repo = str(cwd) == str(REPO_ROOT) or bool(ours)
        if program == "torchrun" or (program.startswith(("python", "bash")) and from_repo):
            _launched.append(f"{event}: {' '.join(words)[:100]}")


sys.addaudithook(_audit)


def _started_processes() -> int:
    """multiprocessing's count of Process objects created so far (its spawn start method raises no audit event)."""
    counter = multiprocessing.process._process_counter  # type: ignore[attr-defined]
    return int(repr(counter).removeprefix("count(").removesuffix(")"))


_BEFORE = pytest.StashKey[tuple[int, int]]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    item.stash[_BEFORE] = (len(_launched), _started_processes())
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A test that starts a process (in its fixtures too) must be marked `distributed`, whatever file it is in:
    the tiers select by marker, so an unmarked launcher would slip into the 5-minute tier."""
    outcome = yield
    report = outcome.get_result()
    if call.when != "teardown" or report.failed or item.get_closest_marker("distributed") or _BEFORE not in item.stash:
        return
    before, processes = item.stash[_BEFORE]
    launched = _launched[before:] or (["multiprocessing"] if _started_processes() > processes else [])
    if launched:
        report.outcome = "failed"
        report.longrepr = f"started a process ({launched[0]}) without @pytest.mark.distributed"


def without_weights(model: Path, out: Path) -> Path:
    """A copy of `model`'s directory without its weight files: a run that stops with an error about the data or
    the flags there shows the error came before the model loaded."""
    out.mkdir()
    for item in model.iterdir():
        if item.is_file() and "safetensors" not in item.name:
            (out / item.name).write_bytes(item.read_bytes())
    return out


def randomize_adapters(adapted: Iterable[object], *, seed: int) -> None:
    """Every trainable parameter of these LoRA layers set to seeded noise (B too), so each one has a gradient."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in adapted:
            for param in layer.parameters():  # type: ignore[attr-defined]
                if param.requires_grad:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """No torchrun around: init_distributed makes a one-rank group in this process (undone by teardown or when
    run returns)."""
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama in the real HF layout: config.json, 2 safetensors shards with index, tokenizer."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="session")
def moe_models(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Path]:
    """Tiny random Mixtral, Qwen2-MoE (shared expert) and Qwen3-MoE, saved by transformers itself."""
    from tests.moe_models import FAMILIES, build_moe_model

    root = tmp_path_factory.mktemp("moe")
    return {f: build_moe_model(f, root / f, tokenizer_from=tiny_model, seed=i) for i, f in enumerate(FAMILIES)}


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory (scripts/prepare_smollm2.py), built once per machine.

    Kept in the temporary directory under the package's version and the script's layout: test workers and later
    runs share it.
    """
    from importlib import metadata

    from scripts.prepare_smollm2 import LAYOUT, PACKAGE, prepare_smollm2

    version = metadata.version(PACKAGE)
    return prepare_smollm2(Path(tempfile.gettempdir()) / f"qlora-fsdp-smollm2-{version}-{LAYOUT}")


def worker_env() -> dict[str, str]:
    """One thread per process: the tests run several ranks on 2 cores."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT), TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline")
    return env


def _launch_env(env: dict[str, str]) -> dict[str, str]:
    """What a warm launcher must have been started with to serve `env`: all of it but pytest's name of the current
    test, which changes with every test (and is passed along with each launch)."""
    return {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}


class _WarmLauncher:
    """tests/warm_launcher.py, started once per test worker (again only when the environment changes): launches fork
    their ranks from a process that has imported the training stack, instead of each rank importing it anew (about
    6.5 s of CPU per rank)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = _launch_env(env)
        script = Path(__file__).with_name("warm_launcher.py")
        self.proc = subprocess.Popen(
            [sys.executable, str(script)], cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        self._reply(timeout=300)

    def serves(self, env: dict[str, str]) -> bool:
        return self.proc.poll() is None and self.env == _launch_env(env)

    def stop(self) -> None:
        """SIGKILL and reap it: its ranks die with it (PR_SET_PDEATHSIG)."""
        self.proc.kill()
        self.proc.wait()

    def _reply(self, *, timeout: float) -> dict:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.stop()
            raise RuntimeError(f"the warm launcher did not answer (exit status {self.proc.returncode})")
        return json.loads(line)

    def run(self, script: Path, args: list[str], *, nproc: int, timeout: float,
            env: dict[str, str]) -> subprocess.CompletedProcess:  # fmt: skip
        cmd = ["warm_launcher", f"--nproc_per_node={nproc}", str(script), *args]
        _launched.append(f"warm launch: {' '.join(cmd)[:100]}")
        with tempfile.TemporaryDirectory(prefix="qlora-launch-") as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            request = {"script": str(script), "args": args, "nproc": nproc, "timeout": timeout, "stdout": str(out),
                       "stderr": str(err), "env": env}  # fmt: skip
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write(json.dumps(request) + "\n")
                self.proc.stdin.flush()
                reply = self._reply(timeout=timeout + 120)
            except BaseException:  # interrupted (Ctrl-C): its answer would go to the next launch
                self.stop()
                raise
            stdout = out.read_text(errors="replace") if out.exists() else ""
            stderr = err.read_text(errors="replace") if err.exists() else ""
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(cmd, reply["returncode"], stdout, stderr)


_warm: _WarmLauncher | None = None


def launch(
    script: str | Path,
    args: list[str],
    *,
    nproc: int,
    timeout: float = 300,
    torchrun_args: tuple[str, ...] = (),
    cold: bool = False,
) -> subprocess.CompletedProcess:
    """Run `script` as `python script` (nproc 0) or as torchrun would with `nproc` CPU ranks; output captured.

    The warm launcher (tests/warm_launcher.py) runs it, started anew when the environment changed (a variable
    read at import was read there), unless `cold` or `torchrun_args` ask for the real launcher, or
    QLORA_TEST_LAUNCH=cold is set: then it is `python script` or `torchrun --standalone`.
    """
    global _warm
    env = worker_env()
    if not (cold or torchrun_args or os.environ.get("QLORA_TEST_LAUNCH") == "cold"):
        if _warm is None or not _warm.serves(env):
            if _warm is not None:
                _warm.stop()
            _warm = _WarmLauncher(env)
        return _warm.run(Path(script), args, nproc=nproc, timeout=timeout, env=env)
    if nproc == 0:
        cmd = [sys.executable, str(script), *args]
    else:
        cmd = [str(TORCHRUN), "--standalone", f"--nproc_per_node={nproc}", *torchrun_args, str(script), *args]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def run_worker(script: Path, args: list[str], *, nproc: int, out: Path) -> dict[str, dict]:
    """A multi-scenario worker job: it must exit 0 and have written OUT/results.json with no scenario's error."""
    result = launch(script, args, nproc=nproc, timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]
    results = json.loads((out / "results.json").read_text())
    failed = {k: v["error"] for k, v in results.items() if v["error"]}
    assert not failed, failed
    return results


def train(args: list[str], *, nproc: int, timeout: float = 300, cold: bool = False) -> subprocess.CompletedProcess:
    """The real CLI: `torchrun ... train.py args` (or `python train.py args` for nproc 0), through launch(); fails
    loudly."""
    result = launch(REPO_ROOT / "train.py", args, nproc=nproc, timeout=timeout, cold=cold)
    if result.returncode != 0:
        raise AssertionError(f"train.py exited {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}")
    return result


def stopped_at(run: Path, out: Path, *, step: int, metrics: bool = False) -> None:
    """`out` as a run that stopped after `step` would leave it: `run`'s checkpoint of that step (and, with
    `metrics`, all of `run`'s records, standing for steps an interrupted run logged before it died). A resume test
    takes it from its uninterrupted run's mid-run checkpoint instead of launching a shorter run to write one."""
    out.mkdir(parents=True)
    shutil.copytree(run / f"checkpoint-{step}", out / f"checkpoint-{step}")
    if metrics:
        shutil.copy(run / "metrics.jsonl", out / "metrics.jsonl")
