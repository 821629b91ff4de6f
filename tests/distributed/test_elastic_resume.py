"""Elastic resume on real torchrun jobs: checkpoints of trainable state and optimizer written with DCP resume on
another world size, batch split and FSDP version; format-1 checkpoints of the previous code still resume where
they can; --save_total_limit and --async_save keep every complete checkpoint whole, through SIGKILL and SIGTERM."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from qlora_fsdp.checkpoint.dcp import SHARDED, TRAINER_STATE, list_checkpoints
from qlora_fsdp.train.metrics import METRICS_FILE, read_metrics
from tests.conftest import DATASET, REPO_ROOT, TORCHRUN, launch, stopped_at, train, worker_env
from tests.distributed.test_reliability import kill_job, start, workers_of

pytestmark = pytest.mark.distributed

FORMAT1_COMMIT = "d70ad52"
"""The last commit whose checkpoints are of format 1 (an optimizer shard in each rank-R.pt, no sharded/)."""

BASE = [
    "--dataset", str(DATASET), "--precision", "fp32", "--context_length", "64", "--lr", "0.01",
    "--lr_scheduler", "constant", "--device", "cpu", "--log_to", "stdout", "--seed", "3", "--save_model", "false",
]  # fmt: skip
# Dropout off: a resume on another world size starts the random state afresh, so only without dropout can its
# trajectory be the saved run's. Saved by 2 ranks x --batch_size 2 (global batch 4) at step 3 of 6.
ELASTIC = [*BASE, "--lora_rank", "8", "--lora_dropout", "0", "--max_steps", "6", "--save_steps", "3"]
# Dropout on: at an unchanged world size each rank's random state is restored, so a resumed run must repeat the
# uninterrupted one bit for bit. 2 ranks x --batch_size 2.
SAME_RANKS = [*BASE, "--quant", "bnb", "--lora_rank", "16", "--lora_dropout", "0.1", "--batch_size", "2"]


def max_relative(got: list[dict[str, Any]], expected: list[dict[str, Any]], key: str) -> float:
    return max(abs(g[key] - e[key]) / abs(e[key]) for g, e in zip(got, expected, strict=True))


def steps_of(out: Path) -> list[int]:
    return [r["step"] for r in read_metrics(out)]


def names(out: Path) -> list[str]:
    return [p.name for p in list_checkpoints(out)]


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in flatten(value, f"{prefix}{key}/").items()}
    if isinstance(tree, list | tuple):
        return {k: v for i, value in enumerate(tree) for k, v in flatten(value, f"{prefix}{i}/").items()}
    return {prefix: tree}


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Keys of two flattened states that differ: missing on one side, or another value (tensors bit for bit)."""
    found = sorted(a.keys() ^ b.keys())
    for key in sorted(a.keys() & b.keys()):
        x, y = a[key], b[key]
        same = torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y
        if not same:
            found.append(key)
    return found


def sharded_state(checkpoint: Path, scratch: Path) -> dict[str, Any]:
    """A checkpoint's DCP state (trainable weights and optimizer), flattened, via one torch.save file."""
    scratch.parent.mkdir(parents=True, exist_ok=True)
    dcp_to_torch_save(checkpoint / SHARDED, scratch)
    return flatten(torch.load(scratch, weights_only=True))


def checkpoint_state(checkpoint: Path, scratch: Path) -> dict[str, Any]:
    """Everything a checkpoint holds, flattened: DCP state, adapter, per-rank files (torch's RNG state, the
    scaler) and the trainer state."""
    state = {f"sharded/{k}": v for k, v in sharded_state(checkpoint, scratch).items()}
    state |= {f"adapter/{k}": v for k, v in load_file(checkpoint / "adapter_model.safetensors").items()}
    for rank_file in sorted(checkpoint.glob("rank-*.pt")):
        loaded = torch.load(rank_file, weights_only=True)
        # Python's `random` is neither seeded nor drawn from by training: its state differs between any two runs.
        del loaded["rng"]["python"]
        state |= {f"{rank_file.stem}/{k}": v for k, v in flatten(loaded).items()}
    return state | {f"trainer/{k}": v for k, v in flatten(json.loads((checkpoint / TRAINER_STATE).read_text())).items()}


def wait_for_save(out: Path, job: subprocess.Popen, *, first: int, timeout: float = 180) -> int | None:
    """Poll every 2 ms for `.checkpoint-K.tmp` with K >= first (a save under way); K, or None if the job ended."""
    pattern = re.compile(r"\.checkpoint-(\d+)\.tmp")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            entries = os.listdir(out)
        except FileNotFoundError:  # not made yet
            entries = []
        under_way = [int(m.group(1)) for m in map(pattern.fullmatch, entries) if m and int(m.group(1)) >= first]
        if under_way:
            return min(under_way)
        if job.poll() is not None:
            return None
        time.sleep(0.002)
    raise AssertionError(f"no save of step >= {first} within {timeout}s")


# ---------------------------------------------------------------------------------------------------------------
# Another world size, batch split, FSDP version or global batch.


@pytest.fixture(scope="module")
def references(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, int], tuple[list, Path]]:
    """Uninterrupted 2 ranks x --batch_size 2 runs of 6 steps, checkpointed at step 3, one per (quant, version),
    made on first use: their flags (without --fsdp_version and --batch_size) and output directory."""
    made: dict[tuple[str, int], tuple[list[str], Path]] = {}

    def reference(quant: str, version: int) -> tuple[list[str], Path]:
        if (quant, version) not in made:
            args = ["--model", str(tiny_model), "--quant", quant, *ELASTIC]
            out = tmp_path_factory.mktemp(f"reference-{quant}-fsdp{version}") / "run"
            train([*args, "--fsdp_version", str(version), "--batch_size", "2", "--output_dir", str(out)], nproc=2)
            assert names(out) == ["checkpoint-3", "checkpoint-6"]
            made[quant, version] = args, out
        return made[quant, version]

    return reference


@pytest.mark.parametrize(
    ("quant", "saved_by", "ranks", "batch", "version"),
    [
        pytest.param("bnb", 2, 4, 1, 2, id="bnb-fsdp2-to-4x1"),
        pytest.param("bnb", 2, 1, 4, 2, id="bnb-fsdp2-to-1x4"),
        pytest.param("hqq", 1, 4, 1, 1, id="hqq-fsdp1-to-4x1"),
        pytest.param("hqq", 1, 1, 4, 2, id="hqq-fsdp1-to-1x4-fsdp2"),
    ],
)
def test_other_world_size_continues_the_uninterrupted_run(
    references: Callable, quant: str, saved_by: int, ranks: int, batch: int, version: int, tmp_path: Path
) -> None:
    """The acceptance test of elastic resume: a 2 x 2 checkpoint of step 3 goes on as ranks x batch (the same
    global batch of 4), resharded: its steps 4-6 and the state it saves at step 6 are the uninterrupted run's."""
    args, reference = references(quant, saved_by)
    out = tmp_path / "run"
    stopped_at(reference, out, step=3, metrics=True)
    run_args = [*args, "--fsdp_version", str(version), "--batch_size", str(batch), "--output_dir", str(out)]
    log = train([*run_args, "--resume_from", "auto"], nproc=ranks).stdout
    assert f"resumed from {out / 'checkpoint-3'} at step 3" in log
    assert re.search(
        rf"^resumed with world size 2 -> {ranks} \(trainable weights and optimizer state resharded;.*\): "
        r"applied from step 4 on$",
        log,
        re.MULTILINE,
    ), log
    if version != saved_by:
        assert f"resumed with --fsdp_version {saved_by} -> {version}: applied from step 4 on" in log
    assert "global batch" not in log, "ranks x batch is the saved global batch: nothing to say about it"

    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, 7))
    # Steps 4-6 come from the resumed job (one peak-memory figure per rank), not from the copied records.
    assert [len(r["peak_memory_bytes_per_rank"]) for r in records] == [2] * 3 + [ranks] * 3
    expected = read_metrics(reference)[3:]
    for key in ("loss", "grad_norm"):
        deviation = max_relative(records[3:], expected, key)
        print(f"{quant} fsdp{saved_by} -> {ranks}x{batch} fsdp{version}: max relative {key} difference {deviation:.2e}")
        assert deviation <= 1e-4, f"steps 4-6 {key}: {[r[key] for r in records[3:]]} vs {[e[key] for e in expected]}"
    # What the resumed job saved at step 6 is the uninterrupted run's step-6 state: LoRA weights and Adam's moments
    # and step count, which a resume that lost or misplaced a shard of the optimizer state could not reach.
    got = sharded_state(out / "checkpoint-6", tmp_path / "resumed.pt")
    want = sharded_state(reference / "checkpoint-6", tmp_path / "uninterrupted.pt")
    assert got.keys() == want.keys()
    assert sum("exp_avg_sq" in key for key in want) == sum("lora_" in key for key in want if key.startswith("model/"))
    worst = 0.0
    for key, value in want.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            assert got[key].shape == value.shape, key
            worst = max(worst, (got[key] - value).abs().max().item() / max(value.abs().max().item(), 1e-30))
        else:
            assert got[key] == value, key
    print(f"{quant} fsdp{saved_by} -> {ranks}x{batch} fsdp{version}: step-6 state, max relative difference {worst:.2e}")
    assert worst <= 1e-4
    # It is this job's checkpoint: a later resume must see ranks (not 2) processes, or it would restore the wrong
    # per-rank random states, or call an unchanged world size a new one.
    state = json.loads((out / "checkpoint-6" / TRAINER_STATE).read_text())
    assert (state["step"], state["world_size"], state["samples_in_epoch"], state["format"]) == (6, ranks, 24, 2)
    assert sorted(p.name for p in (out / "checkpoint-6").glob("rank-*.pt")) == [f"rank-{r}.pt" for r in range(ranks)]


def test_other_global_batch_goes_on_from_the_saved_sample(references: Callable, tmp_path: Path) -> None:
    """2 x 2 -> 2 x 4: the data continues at sample 12 of the same global order, 8 samples a step."""
    args, reference = references("bnb", 2)
    out = tmp_path / "run"
    stopped_at(reference, out, step=3, metrics=True)
    run_args = [*args, "--fsdp_version", "2", "--batch_size", "4", "--output_dir", str(out), "--resume_from", "auto"]
    log = train(run_args, nproc=2).stdout
    lines = [line for line in log.splitlines() if line.startswith("resumed with global batch")]
    assert len(lines) == 1, log
    (line,) = lines
    assert line.startswith(
        "resumed with global batch 4 (2 ranks x --batch_size 2 x --gradient_accumulation_steps 1) -> "
        "8 (2 ranks x --batch_size 4 x --gradient_accumulation_steps 1): the data goes on from sample 12 of epoch 0"
    ), line
    assert line.endswith("applied from step 4 on")
    assert "resumed with world size" not in log
    assert "resumed with --batch_size 2 -> 4: applied from step 4 on" in log

    records, saved = read_metrics(out), read_metrics(reference)
    assert [r["step"] for r in records] == list(range(1, 7)), "the step count goes on from the checkpoint"
    # Step 4 at global batch 8 reads samples 12-19 of the order: what steps 4 and 5 of the saved run read.
    for key in ("label_tokens", "tokens"):
        assert records[3][key] == saved[3][key] + saved[4][key], key
    state = json.loads((out / "checkpoint-6" / TRAINER_STATE).read_text())
    assert (state["step"], state["epoch"], state["samples_in_epoch"], state["world_size"]) == (6, 0, 12 + 3 * 8, 2)


def test_group_by_length_refuses_another_global_micro_batch(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["--model", str(tiny_model), "--quant", "bnb", *ELASTIC, "--group_by_length", "true", "--output_dir"]
    train([*args, str(out), "--batch_size", "2", "--max_steps", "1", "--save_steps", "1"], nproc=0)
    assert names(out) == ["checkpoint-1"]
    result = launch(REPO_ROOT / "train.py", [*args, str(out), "--batch_size", "4", "--resume_from", "auto"], nproc=0)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert (
        "--group_by_length orders rows in global batches of 2 (world size x --batch_size), so it continues only "
        "with world size x --batch_size = 2" in errors[0]
    ), errors[0]
    assert steps_of(out) == [1], "refused before training"


# ---------------------------------------------------------------------------------------------------------------
# The same world size, dropout on: checkpoints of format 1 (the code before DCP).


@pytest.fixture(scope="module")
def same_rank_runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """Uninterrupted 6-step SAME_RANKS runs saving every step, synchronously and with --async_save (the references
    of the format-1, async-save and SIGKILL tests): their output directories and stdout."""
    runs = {}
    for mode in ("sync", "async"):
        out = tmp_path_factory.mktemp(f"same-ranks-{mode}") / "run"
        args = ["--model", str(tiny_model), *SAME_RANKS, "--max_steps", "6", "--save_steps", "1"]
        result = train([*args, "--async_save", str(mode == "async").lower(), "--output_dir", str(out)], nproc=2)
        runs[mode] = out, result.stdout
    return runs


@pytest.fixture(scope="module")
def format1(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Path]:
    """A format-1 checkpoint of step 2, written by 2 ranks running the code of FORMAT1_COMMIT: flags and output."""
    git = ["git", "-C", str(REPO_ROOT)]
    try:
        probe = [*git, "cat-file", "-e", f"{FORMAT1_COMMIT}^{{commit}}"]
        known = subprocess.run(probe, capture_output=True, check=False).returncode == 0
    except FileNotFoundError:
        known = False
    if not known:
        pytest.skip(f"commit {FORMAT1_COMMIT}, which wrote format-1 checkpoints, is not in this clone (shallow?)")
    code = tmp_path_factory.mktemp("format1-code")
    archive = subprocess.run(
        [*git, "archive", FORMAT1_COMMIT, "qlora_fsdp", "train.py"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(code)], input=archive.stdout, check=True)

    out = tmp_path_factory.mktemp("format1") / "run"
    args = ["--model", str(tiny_model), *SAME_RANKS, "--save_steps", "2"]
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", str(code / "train.py"), *args]
    env = {**worker_env(), "PYTHONPATH": str(code)}
    result = subprocess.run(
        [*cmd, "--max_steps", "2", "--output_dir", str(out)], cwd=code, env=env, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-6000:]
    checkpoint = out / "checkpoint-2"
    # The old code wrote it, not this tree's: format 1's layout.
    assert not (checkpoint / SHARDED).exists()
    assert "batch_in_epoch" in json.loads((checkpoint / TRAINER_STATE).read_text())
    assert {"optimizer", "rng"} <= torch.load(checkpoint / "rank-0.pt", weights_only=True).keys()
    return args, out


def test_format1_checkpoint_resumes_at_its_world_size(
    format1: tuple[list[str], Path], same_rank_runs: dict[str, tuple[Path, str]], tmp_path: Path
) -> None:
    args, old = format1
    out = tmp_path / "run"
    shutil.copytree(old, out)
    log = train([*args, "--max_steps", "4", "--output_dir", str(out), "--resume_from", "auto"], nproc=2).stdout
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in log
    assert "resumed with world size" not in log
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    expected = read_metrics(same_rank_runs["sync"][0])
    old_code = max_relative(records[:2], expected[:2], "loss")
    print(f"format 1: steps 1-2 of the old code, max relative loss difference {old_code:.2e}")
    for key in ("loss", "grad_norm"):
        deviation = max_relative(records[2:], expected[2:4], key)
        print(f"format 1 resumed at 2 ranks: max relative {key} difference of steps 3-4 {deviation:.2e}")
        assert deviation <= 1e-6, f"{key}: {[r[key] for r in records[2:]]} vs {[e[key] for e in expected[2:4]]}"
    # A resumed format-1 run saves in the new format and says so: recorded as format 1, its checkpoint would be
    # read back as one (an optimizer shard in each rank-R.pt, which it lacks).
    new = out / "checkpoint-4"
    assert (new / SHARDED).is_dir()
    state = json.loads((new / TRAINER_STATE).read_text())
    assert "batch_in_epoch" not in state
    assert (state["step"], state["world_size"], state["samples_in_epoch"], state["format"]) == (4, 2, 16, 2)
    assert "optimizer" not in torch.load(new / "rank-0.pt", weights_only=True)


def test_format1_checkpoint_refuses_another_world_size(format1: tuple[list[str], Path], tmp_path: Path) -> None:
    args, old = format1
    resume = ["--resume_from", str(old / "checkpoint-2"), "--output_dir", str(tmp_path / "run")]
    result = launch(REPO_ROOT / "train.py", [*args, "--max_steps", "4", *resume], nproc=1)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert "saved by 2 processes but this job has 1" in errors[0]
    assert "predates resharded checkpoints" in errors[0] and "--nproc_per_node/--nnodes giving 2" in errors[0]
    assert not (tmp_path / "run" / METRICS_FILE).exists(), "refused before training"


# ---------------------------------------------------------------------------------------------------------------
# --save_total_limit and --async_save.


def test_save_total_limit_keeps_the_newest_and_the_resumed_checkpoint(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["--model", str(tiny_model), *SAME_RANKS, "--save_steps", "1", "--output_dir", str(out)]
    first = train([*args, "--max_steps", "5", "--save_total_limit", "2", "--async_save", "true"], nproc=2).stdout
    assert first.count("the rest is written in the background") == 5, "every save went to the background"
    assert names(out) == ["checkpoint-4", "checkpoint-5"], "the end of training completes the save in flight"
    assert not list(out.glob(".checkpoint-*"))

    # Resumed by one process (the checkpoints reshard): pruning is rank 0's alone.
    second = train([*args, "--max_steps", "6", "--save_total_limit", "2", "--resume_from", "auto"], nproc=0).stdout
    assert f"resumed from {out / 'checkpoint-5'} at step 5" in second
    assert names(out) == ["checkpoint-5", "checkpoint-6"]

    # From the older checkpoint-5, named as a user would (relative to the job's working directory), keeping 1: the
    # limit alone would delete checkpoint-5 once step 6 is saved again, and checkpoint-6 once step 7 is.
    older = os.path.relpath(out / "checkpoint-5", REPO_ROOT)
    third = train([*args, "--max_steps", "7", "--save_total_limit", "1", "--resume_from", older], nproc=0).stdout
    assert f"resumed from {older} at step 5" in third
    assert names(out) == ["checkpoint-5", "checkpoint-7"]
    assert json.loads((out / "checkpoint-5" / TRAINER_STATE).read_text())["step"] == 5
    assert steps_of(out) == list(range(1, 8))


def test_async_save_writes_what_a_synchronous_save_writes(
    same_rank_runs: dict[str, tuple[Path, str]], tmp_path: Path
) -> None:
    """Each background write holds the state of its own step, though the next step updated the weights and Adam's
    moments in place while it was written."""
    (sync, _), (background, log) = same_rank_runs["sync"], same_rank_runs["async"]
    assert log.count("the rest is written in the background") == 6
    assert [r["loss"] for r in read_metrics(background)] == [r["loss"] for r in read_metrics(sync)]
    assert [r["grad_norm"] for r in read_metrics(background)] == [r["grad_norm"] for r in read_metrics(sync)]
    assert names(background) == names(sync) == [f"checkpoint-{s}" for s in range(1, 7)]
    previous = None
    for name in names(sync):
        expected = checkpoint_state(sync / name, tmp_path / "sync" / f"{name}.pt")
        got = checkpoint_state(background / name, tmp_path / "async" / f"{name}.pt")
        assert sum(isinstance(v, torch.Tensor) for k, v in got.items() if k.startswith("sharded/optim")) >= 2
        assert not differences(got, expected), f"{name}: {differences(got, expected)[:10]}"
        if previous is not None:  # steps apart, the states differ: the comparison would see a later step's
            assert differences(got, previous)
        previous = got


def test_dcp_async_save_writes_the_state_as_it_was_when_called(tmp_path: Path) -> None:
    """The premise of --async_save, on this torch: DCP stages (copies) CPU tensors before async_save returns, so
    in-place updates right after it (the next optimizer step) do not reach the file. The runs above cannot show it
    by themselves: their few kilobytes are likely written before the next step's update."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if dist.is_initialized():
        pytest.skip("this process already belongs to a process group")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        weight, moment = torch.randn(1 << 22), torch.rand(1 << 22)  # 16 MiB each: the write outlasts the update
        state = {"model": {"w": weight}, "optim": {"state": {"w": {"exp_avg": moment}}, "param_groups": [{"lr": 1}]}}
        expected = {"w": weight.clone(), "exp_avg": moment.clone()}
        future = dcp.async_save(state, checkpoint_id=tmp_path / SHARDED, process_group=dist.new_group(backend="gloo"))
        weight.add_(1.0)
        moment.mul_(-1.0)
        future.result()
    finally:
        dist.destroy_process_group()
    saved = sharded_state(tmp_path, tmp_path / "saved.pt")
    assert torch.equal(saved["model/w/"], expected["w"])
    assert torch.equal(saved["optim/state/w/exp_avg/"], expected["exp_avg"])


def test_sigkill_mid_async_save_leaves_the_last_complete_checkpoint(
    tiny_model: Path, same_rank_runs: dict[str, tuple[Path, str]], tmp_path: Path
) -> None:
    (background, _) = same_rank_runs["async"]  # uninterrupted, with the same flags
    args = ["--model", str(tiny_model), *SAME_RANKS, "--max_steps", "6", "--save_steps", "1", "--async_save", "true"]
    attempts = []
    for attempt in range(3):
        out = tmp_path / f"attempt-{attempt}"
        job = start([*args, "--output_dir", str(out)])
        try:
            in_flight = wait_for_save(out, job, first=3)
        finally:
            if job.poll() is None:
                kill_job(job)
            job.stdout.close()
        hit = (
            in_flight is not None
            and (out / f".checkpoint-{in_flight}.tmp").is_dir()
            and not (out / f"checkpoint-{in_flight}" / TRAINER_STATE).exists()
        )
        attempts.append((in_flight, hit))
        if hit:
            break
    print(f"SIGKILL attempts (save in flight, hit it): {attempts}")
    assert attempts[-1][1], f"no SIGKILL landed during a save: {attempts}"

    # One save at a time: checkpoint-K begins only once checkpoint-(K-1) is complete, and the kill left it whole.
    newest = list_checkpoints(out)[-1]
    assert newest.name == f"checkpoint-{in_flight - 1}"
    scratch = tmp_path / "scratch"
    got = checkpoint_state(newest, scratch / "killed.pt")
    assert not differences(got, checkpoint_state(background / newest.name, scratch / "uninterrupted.pt"))

    log = train([*args, "--output_dir", str(out), "--resume_from", "auto"], nproc=2).stdout
    assert f"resumed from {newest} at step {in_flight - 1}" in log
    records, expected = read_metrics(out), read_metrics(background)
    assert [r["step"] for r in records] == list(range(1, 7))
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in records] == [e[key] for e in expected], key
    assert not list(out.glob(".checkpoint-*.tmp")), "the killed save's directory was swept"


def test_sigterm_during_async_save_completes_it_and_the_preemption_checkpoint(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["--model", str(tiny_model), *SAME_RANKS, "--max_steps", "500", "--save_steps", "2", "--async_save", "true"]
    job = start([*args, "--output_dir", str(out)])
    try:
        in_flight = wait_for_save(out, job, first=2)
        assert in_flight is not None, job.stdout.read()[-4000:]
        # As SLURM does, every worker gets the signal. (Signalled itself, torchrun forwards it to the workers but
        # then exits 1 whatever they do: torch.distributed.elastic re-raises its SignalException.)
        workers = workers_of(job)
        assert len(workers) == 2
        for pid in workers:
            os.kill(pid, signal.SIGTERM)
        output, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            kill_job(job)
    assert job.returncode == 0, output[-4000:]
    checkpoints = list_checkpoints(out)
    steps = [json.loads((p / TRAINER_STATE).read_text())["step"] for p in checkpoints]
    print(f"SIGTERM with checkpoint-{in_flight} in flight: complete checkpoints {steps}")
    assert steps[0] == in_flight and steps[-1] == len(read_metrics(out)) > in_flight, steps
    assert f"preempted: saved checkpoint {checkpoints[-1].resolve()} at step {steps[-1]}" in output
    # The save in flight was completed before the preemption's began.
    completed = [line for line in output.splitlines() if line.startswith("checkpoint saved to")]
    assert completed[0].startswith(f"checkpoint saved to {checkpoints[0]} ")
    assert completed[-1].startswith(f"checkpoint saved to {checkpoints[-1]} ")
    assert not list(out.glob(".checkpoint-*.tmp"))
