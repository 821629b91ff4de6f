"""Multi-node launch scripts, with two "nodes" on this machine (one rank each) against one node with two ranks.

scripts/launch_multinode.sh runs as two concurrent launchers (c10d rendezvous), and scripts/slurm_multinode.sbatch
runs under stand-ins for `srun` and `scontrol` (static rendezvous, node rank from SLURM_NODEID). Both must give the
per-step losses of a single 2-rank job.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from qlora_fsdp.parallel.distributed import free_port
from qlora_fsdp.train.metrics import read_metrics
from tests.conftest import DATASET, REPO_ROOT, TORCHRUN, worker_env

pytestmark = pytest.mark.distributed

LAUNCHER = REPO_ROOT / "scripts" / "launch_multinode.sh"
SBATCH = REPO_ROOT / "scripts" / "slurm_multinode.sbatch"
TIMEOUT_S = 120
STEPS = 4

FAKE_SRUN = """#!/usr/bin/env bash
# Stand-in for srun: run the command once per node, concurrently, with that node's SLURM_NODEID.
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do
    SLURM_NODEID=$i "$@" > "$FAKE_SLURM_LOGS/node$i.log" 2>&1 &
    pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
exit $rc
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
# Stand-in for `scontrol show hostnames LIST`: both nodes are this machine.
echo 127.0.0.1
echo 127.0.0.1
"""


def _train_args(model: Path, output_dir: Path) -> list[str]:
    return [
        "--model", str(model), "--quant", "bnb", "--precision", "fp32", "--batch_size", "1", "--lora_dropout", "0",
        "--lr_scheduler", "constant", "--device", "cpu", "--dataset", str(DATASET), "--context_length", "64",
        "--max_steps", str(STEPS), "--save_model", "false", "--log_to", "stdout", "--output_dir", str(output_dir),
    ]  # fmt: skip


def _run_all(jobs: list[tuple[list[str], dict[str, str], Path]], *, succeed: bool = True) -> list[int]:
    """Start every (command, extra env, log file) concurrently and wait for all of them to exit (0 unless not
    `succeed`); returns their exit codes.

    Each runs in its own process group; all groups are killed if one fails (when they must succeed) or TIMEOUT_S
    passes.
    """
    procs: list[subprocess.Popen] = []
    try:
        for cmd, extra, log_path in jobs:
            env = worker_env()
            env.update(extra)
            with open(log_path, "w") as log:
                procs.append(
                    subprocess.Popen(
                        cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
        deadline = time.monotonic() + TIMEOUT_S
        while any(p.poll() is None for p in procs):
            if (succeed and any(p.returncode not in (None, 0) for p in procs)) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    codes = [p.returncode for p in procs]
    if succeed and any(codes):
        logs = sorted({path for _, _, log in jobs for path in log.parent.glob("*.log")})
        detail = "\n".join(f"--- {path.name} ---\n{path.read_text()[-4000:]}" for path in logs)
        raise AssertionError(f"not every launcher succeeded within {TIMEOUT_S}s: exit codes {codes}\n{detail}")
    return codes


def _rendezvous_env(**extra: str) -> dict[str, str]:
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RDZV_ID": uuid.uuid4().hex[:8],
        "TORCHRUN": str(TORCHRUN),
        **extra,
    }


def _check_same_run(output_dir: Path, node_logs: list[Path], reference: list[float]) -> list[bool]:
    """The 2-node run logged every step of one 2-rank job with the reference losses; which node printed steps."""
    records = read_metrics(output_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(len(r["peak_memory_bytes_per_rank"]) == 2 for r in records), "not one 2-rank job"
    losses = [r["loss"] for r in records]
    assert losses == pytest.approx(reference, rel=1e-5), f"2 nodes {losses} vs 1 node x 2 ranks {reference}"
    # --log_to stdout: only global rank 0 prints step lines.
    printed = ["step 1 loss" in log.read_text() for log in node_logs]
    assert sum(printed) == 1, [log.read_text()[-2000:] for log in node_logs]
    return printed


@pytest.fixture(scope="module")
def one_node_losses(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The reference: one launcher, one node, two ranks."""
    tmp = tmp_path_factory.mktemp("one-node")
    env = _rendezvous_env(NNODES="1", NODE_RANK="0", NPROC_PER_NODE="2")
    _run_all([(["bash", str(LAUNCHER), *_train_args(tiny_model, tmp / "run")], env, tmp / "node.log")])
    return [r["loss"] for r in read_metrics(tmp / "run")]


def test_two_launchers_match_one_node(one_node_losses: list[float], tiny_model: Path, tmp_path: Path) -> None:
    """Default c10d rendezvous: node ranks are assigned as launchers join, so either may hold global rank 0."""
    shared = _rendezvous_env(NNODES="2", NPROC_PER_NODE="1")
    cmd = ["bash", str(LAUNCHER), *_train_args(tiny_model, tmp_path / "run")]
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    _run_all([(cmd, {**shared, "NODE_RANK": str(rank)}, logs[rank]) for rank in (0, 1)])
    _check_same_run(tmp_path / "run", logs, one_node_losses)


def test_sbatch_script_matches_one_node(one_node_losses: list[float], tiny_model: Path, tmp_path: Path) -> None:
    """The sbatch script end to end under fake srun/scontrol, static rendezvous: node 0 holds global rank 0."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = _rendezvous_env(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="node[0-1]",
        SLURM_NNODES="2",
        SLURM_GPUS_ON_NODE="1",
        SLURM_CPUS_PER_TASK="1",
        SLURM_SUBMIT_DIR=str(REPO_ROOT),
        FAKE_SLURM_LOGS=str(tmp_path),
        VENV=str(tmp_path / "no-venv"),
        RDZV_BACKEND="static",
    )
    env.pop("MASTER_ADDR")  # the script derives it from scontrol
    del env["RDZV_ID"]  # and uses the job id
    _run_all([(["bash", str(SBATCH), *_train_args(tiny_model, tmp_path / "run")], env, tmp_path / "sbatch.log")])

    batch_log = (tmp_path / "sbatch.log").read_text()
    assert "2 nodes x 1 ranks, rendezvous at 127.0.0.1:" in batch_log, batch_log
    printed = _check_same_run(tmp_path / "run", [tmp_path / "node0.log", tmp_path / "node1.log"], one_node_losses)
    assert printed == [True, False], "with RDZV_BACKEND=static, SLURM node 0 must hold global rank 0"


def test_node_local_output_dirs_are_refused_when_checkpoints_are_asked_for(tiny_model: Path, tmp_path: Path) -> None:
    """Two "nodes" whose --output_dir is not the same directory (node-local disks): every rank would write its
    checkpoint shard where rank 0 never finalises it. Refused at start-up on every node, before any work."""
    shared = _rendezvous_env(NNODES="2", NPROC_PER_NODE="1")
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    jobs = []
    for rank in (0, 1):
        cmd = ["bash", str(LAUNCHER), *_train_args(tiny_model, tmp_path / f"disk{rank}" / "run"), "--save_steps", "2"]
        jobs.append((cmd, {**shared, "NODE_RANK": str(rank)}, logs[rank]))
    codes = _run_all(jobs, succeed=False)
    assert all(codes), codes
    for log in logs:
        errors = [line for line in log.read_text().splitlines() if line.startswith("error:")]
        assert errors and "is not the same directory on every node" in errors[0], log.read_text()[-3000:]
    assert not list(tmp_path.glob("disk*/run/checkpoint-*")) and not list(tmp_path.glob("disk*/run/metrics.jsonl"))
