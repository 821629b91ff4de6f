"""Long-run safety on real torchrun jobs: kill-and-resume, preemption, a dying rank, non-finite losses."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qlora_fsdp.checkpoint.dcp import TRAINER_STATE, list_checkpoints
from qlora_fsdp.train.metrics import read_metrics
from tests.conftest import DATASET, REPO_ROOT, TORCHRUN, launch, train, worker_env

pytestmark = pytest.mark.distributed

RESUME_ARGS = [
    "--dataset", str(DATASET), "--precision", "fp32", "--context_length", "96", "--lr", "0.01",
    "--batch_size", "1", "--gradient_accumulation_steps", "2", "--lr_scheduler", "cosine", "--warmup_ratio", "0.1",
    "--lora_rank", "8", "--lora_dropout", "0.1", "--device", "cpu", "--log_to", "stdout", "--seed", "3",
    "--max_steps", "12", "--save_steps", "3", "--save_total_limit", "2",
]  # fmt: skip


def start(args: list[str], *, nproc: int = 2) -> subprocess.Popen:
    """torchrun in its own session, so the test can signal or kill the whole job."""
    cmd = [str(TORCHRUN), "--standalone", f"--nproc_per_node={nproc}", str(REPO_ROOT / "train.py"), *args]
    return subprocess.Popen(
        cmd, cwd=REPO_ROOT, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip


def wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= step:
            return
        if proc.poll() is not None:
            raise AssertionError(f"job ended early ({proc.returncode}):\n{proc.stdout.read()[-4000:]}")
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within {timeout}s")


def workers_of(proc: subprocess.Popen) -> list[int]:
    """PIDs of torchrun's worker processes (its children), read from /proc."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == proc.pid:
                children.append(int(entry.name))
    return children


def kill_job(job: subprocess.Popen) -> None:
    """SIGKILL torchrun and its workers (they run in process groups of their own)."""
    workers = workers_of(job)
    os.killpg(job.pid, signal.SIGKILL)
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    job.wait(timeout=60)
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)


# Resume restores adapters, optimizer shards and RNG, never quantized weights: one backend per FSDP version suffices,
# and FSDP2's float view (the layout of torch < 2.12) once, with the other backend.
@pytest.mark.parametrize(("quant", "version", "layout"), [("bnb", 2, "auto"), ("bnb", 1, "auto"), ("hqq", 2, "float")])
def test_sigkill_then_resume_matches_uninterrupted(
    quant: str, version: int, layout: str, tiny_model: Path, tmp_path: Path
) -> None:
    args = ["--model", str(tiny_model), "--quant", quant, "--fsdp_version", str(version), *RESUME_ARGS]
    args += ["--packed_layout", layout]
    reference = tmp_path / "reference"
    train([*args, "--output_dir", str(reference), "--save_model", "false"], nproc=2)
    expected = [r["loss"] for r in read_metrics(reference)]

    out = tmp_path / "killed"
    job = start([*args, "--output_dir", str(out)])
    wait_for_step(out, 5, job)
    kill_job(job)
    killed_at = len(read_metrics(out))
    assert killed_at < 12, "the job finished before it could be killed"
    assert list_checkpoints(out), "no complete checkpoint survived the kill"

    result = train([*args, "--output_dir", str(out), "--resume_from", "auto"], nproc=2)
    resumed_from = int(result.stdout.split("at step ")[1].split()[0])
    assert 3 <= resumed_from <= killed_at
    got = [r["loss"] for r in read_metrics(out)]
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 13))
    deviation = max(abs(a - b) / abs(b) for a, b in zip(got, expected, strict=True))
    assert deviation <= 1e-4, f"resumed trajectory deviates by {deviation:.2e}: {got} vs {expected}"
    # save_total_limit 2: the two newest complete checkpoints remain, and the one resumed from; no temporary directory.
    kept = [int(p.name.split("-")[1]) for p in list_checkpoints(out)]
    assert kept == sorted({resumed_from, 9, 12})
    assert not list(out.glob(".checkpoint-*"))


@pytest.fixture(scope="module")
def three_steps(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Path]:
    """A 2-rank run stopped by --max_steps 3 with a checkpoint at step 3: its flags and output directory."""
    out = tmp_path_factory.mktemp("three-steps") / "run"
    args = ["--model", str(tiny_model), "--quant", "bnb", *RESUME_ARGS, "--output_dir", str(out)]
    train([*args, "--max_steps", "3", "--save_model", "false"], nproc=2)
    return args, out


def test_checkpoint_is_self_contained_peft_adapter(three_steps: tuple[list[str], Path], tiny_model: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, out = three_steps
    ckpt = out / "checkpoint-3"
    state = json.loads((ckpt / TRAINER_STATE).read_text())
    assert state["step"] == 3 and state["world_size"] == 2
    assert {p.name for p in ckpt.iterdir()} >= {"adapter_model.safetensors", "sharded", "rank-0.pt", "rank-1.pt"}
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), ckpt)
    assert any("lora_B" in n for n, _ in model.named_parameters())


def test_sigterm_saves_checkpoint_and_exits_zero(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["--model", str(tiny_model), "--quant", "bnb", *RESUME_ARGS, "--max_steps", "500", "--save_steps", "0"]
    job = start([*args, "--output_dir", str(out)])
    wait_for_step(out, 2, job)
    workers = workers_of(job)
    assert len(workers) == 2
    for pid in workers:  # as SLURM does: every process of the step gets the signal
        os.kill(pid, signal.SIGTERM)
    output, _ = job.communicate(timeout=120)
    assert job.returncode == 0, output[-4000:]
    checkpoints = list_checkpoints(out)
    assert len(checkpoints) == 1
    step = json.loads((checkpoints[0] / TRAINER_STATE).read_text())["step"]
    assert step == len(read_metrics(out)) < 500
    assert f"preempted: saved checkpoint {checkpoints[0].resolve()}" in output
    assert not (out / "adapter_model.safetensors").exists(), "a preempted run is not a finished run"


def test_dead_rank_ends_the_job(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["--model", str(tiny_model), "--quant", "bnb", *RESUME_ARGS, "--max_steps", "5000", "--save_steps", "0"]
    job = start([*args, "--output_dir", str(out), "--dist_timeout_s", "60"])
    wait_for_step(out, 2, job)
    killed = time.monotonic()
    os.kill(max(workers_of(job)), signal.SIGKILL)
    try:
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            kill_job(job)
    assert job.returncode != 0
    assert time.monotonic() - killed < 120


def test_non_finite_loss_stops_naming_the_step(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["--model", str(tiny_model), "--quant", "bnb", *RESUME_ARGS, "--lr", "1e30", "--warmup_ratio", "0"]
    result = launch(REPO_ROOT / "train.py", [*args, "--output_dir", str(out), "--save_steps", "0"], nproc=2)
    assert result.returncode != 0
    errors = {line for line in result.stderr.splitlines() if line.startswith("error:")}
    assert len(errors) == 1, result.stderr[-3000:]
    (message,) = errors
    step = len(read_metrics(out)) + 1
    assert f"step {step}: non-finite loss" in message and "--nan_policy skip" in message
    assert step > 1


def test_nan_policy_skip_leaves_weights_untouched(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["--model", str(tiny_model), "--quant", "bnb", *RESUME_ARGS, "--lr", "1e30", "--warmup_ratio", "0"]
    train(
        [
            *args,
            "--output_dir",
            str(out),
            "--max_steps",
            "4",
            "--save_steps",
            "1",
            "--save_total_limit",
            "0",
            "--nan_policy",
            "skip",
        ],
        nproc=2,
    )
    records = read_metrics(out)
    skipped = [r["step"] for r in records if r["skipped"]]
    assert skipped and skipped == list(range(skipped[0], 5)), skipped
    # The last good step's adapter is what the run ends with: skipped steps changed nothing.
    last_good = load_file(out / f"checkpoint-{skipped[0] - 1}" / "adapter_model.safetensors")
    final = load_file(out / "adapter_model.safetensors")
    assert set(last_good) == set(final)
    assert all(torch.equal(last_good[k], final[k]) for k in final)


def test_overwrite_removes_the_previous_runs_checkpoints(tiny_model: Path, tmp_path: Path) -> None:
    """Left behind, they would be pruned together with the new run's, and --resume_from auto could pick them."""
    out = tmp_path / "run"
    args = ["--model", str(tiny_model), "--quant", "bnb", *RESUME_ARGS, "--output_dir", str(out)]
    train([*args, "--max_steps", "6", "--save_steps", "3", "--save_model", "false"], nproc=0)
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-3", "checkpoint-6"]
    train([*args, "--max_steps", "2", "--save_steps", "1", "--overwrite", "true"], nproc=0)
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-1", "checkpoint-2"]
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


def test_resume_with_another_learning_rate_applies_it_and_says_so(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["--model", str(tiny_model), "--quant", "bnb", *RESUME_ARGS, "--output_dir", str(out), "--save_steps", "2"]
    train([*args, "--max_steps", "4", "--save_model", "false"], nproc=0)
    result = train([*args, "--max_steps", "6", "--lr", "0.005", "--resume_from", "auto"], nproc=0)
    log = result.stdout + result.stderr
    assert "resumed with --lr 0.01 -> 0.005: applied from step 5 on" in log
    assert "resumed with --max_steps 4 -> 6: applied from step 5 on" in log
    # The new schedule from step 5: cosine over 6 steps with warmup ceil(0.1 x 6) = 1, floor 0.1, peak 0.005.
    lrs = [r["lr"] for r in read_metrics(out)]
    expected = [0.005 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - 1) / 5))) for step in (4, 5)]
    assert lrs[4:] == pytest.approx(expected, rel=1e-9)


def test_full_fine_tuning_checkpoint_resumes_on_another_world_size(tiny_model: Path, tmp_path: Path) -> None:
    """--train_type full checkpoints the whole model and its optimizer state in DCP's sharded form: 2 ranks x 2
    resume as 1 rank x 4, whose own checkpoint resumes on 2 ranks again, on the uninterrupted trajectory."""
    args = [
        "--model", str(tiny_model), "--dataset", str(DATASET), "--train_type", "full", "--quant", "none",
        "--precision", "fp32", "--context_length", "64", "--lr", "1e-3", "--lr_scheduler", "constant",
        "--device", "cpu", "--log_to", "stdout", "--seed", "3", "--save_model", "false", "--save_steps", "2",
    ]  # fmt: skip
    reference = tmp_path / "reference"
    train([*args, "--batch_size", "2", "--max_steps", "6", "--output_dir", str(reference)], nproc=2)
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    (reference / "checkpoint-2").rename(resumed / "checkpoint-2")
    once = [*args, "--batch_size", "4", "--max_steps", "4", "--output_dir", str(resumed), "--resume_from", "auto"]
    assert "resumed with world size 2 -> 1" in train(once, nproc=1).stdout
    # A checkpoint written by a resumed run records its own world size, so it resumes (and reshards) in turn.
    state = json.loads((resumed / "checkpoint-4" / TRAINER_STATE).read_text())
    assert (state["world_size"], state["format"]) == (1, 2)
    twice = [*args, "--batch_size", "2", "--max_steps", "6", "--output_dir", str(resumed), "--resume_from", "auto"]
    assert "resumed with world size 1 -> 2" in train(twice, nproc=2).stdout
    want = {r["step"]: r for r in read_metrics(reference)}
    got = {r["step"]: r for r in read_metrics(resumed)}
    assert sorted(got) == [3, 4, 5, 6]  # the checkpoint came without the metrics of steps 1-2
    for step in (3, 4, 5, 6):
        for key in ("loss", "grad_norm"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-4), (step, key)
