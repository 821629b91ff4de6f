"""The warm launcher (tests/warm_launcher.py) launches as torchrun does: the ranks' environment, a gloo group, the
script's arguments, and torchrun's exit status, with a failed rank's peers stopped."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import launch

pytestmark = pytest.mark.distributed

# torchrun's variables that a rank of ours reads (qlora_fsdp/parallel/distributed.py) or that say where it sits;
# MASTER_PORT is a free port, different on each launch.
MIRRORED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
            "GROUP_WORLD_SIZE", "MASTER_ADDR", "OMP_NUM_THREADS", "TORCHELASTIC_RESTART_COUNT",
            "TORCHELASTIC_MAX_RESTARTS")  # fmt: skip

RANK_SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank() + 1])
dist.all_reduce(total)
env = {k: os.environ.get(k) for k in %r}
record = {"env": env, "argv": sys.argv[1:], "sum": int(total), "name": __name__}
os.write(1, (json.dumps(record) + "\\n").encode())  # one write: the ranks share the output
dist.destroy_process_group()
"""


def _records(stdout: str) -> list[dict]:
    records = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return sorted(records, key=lambda record: record["env"]["RANK"])


def test_ranks_see_what_torchrun_gives_them(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT % (MIRRORED,))
    warm = launch(script, ["--flag", "x y"], nproc=2)
    cold = launch(script, ["--flag", "x y"], nproc=2, cold=True)
    assert warm.returncode == cold.returncode == 0, warm.stderr[-3000:] + cold.stderr[-3000:]
    warm_records, cold_records = _records(warm.stdout), _records(cold.stdout)
    assert len(warm_records) == len(cold_records) == 2
    for got, expected in zip(warm_records, cold_records, strict=True):
        assert got == expected  # the environment, the arguments, the gloo sum 1 + 2 and __main__


def test_a_failed_rank_fails_the_job_and_stops_its_peer(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(120)\n")
    began = time.monotonic()
    result = launch(script, [], nproc=2, timeout=200)
    assert result.returncode == 1  # torchrun's status when any rank failed, whatever that rank's own
    assert time.monotonic() - began < 60, "rank 0 was left sleeping"


def test_one_process_keeps_its_exit_status_and_traceback(tmp_path: Path) -> None:
    usage = tmp_path / "usage.py"
    usage.write_text("import sys\nprint('error: --x is wrong', file=sys.stderr)\nsys.exit(2)\n")
    result = launch(usage, [], nproc=0)
    assert (result.returncode, result.stderr) == (2, "error: --x is wrong\n")
    crash = tmp_path / "crash.py"
    crash.write_text("raise ValueError('deep inside')\n")
    result = launch(crash, [], nproc=0)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "ValueError: deep inside" in result.stderr


def test_a_launch_past_its_timeout_is_stopped(tmp_path: Path) -> None:
    script = tmp_path / "hang.py"
    script.write_text("import time\ntime.sleep(300)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        launch(script, [], nproc=2, timeout=3)
    after = tmp_path / "after.py"
    after.write_text("print('next')\n")
    result = launch(after, [], nproc=0)  # the launcher, its hung ranks killed, takes the next launch
    assert (result.returncode, result.stdout) == (0, "next\n")


def test_a_rank_exits_as_the_interpreter_does(tmp_path: Path) -> None:
    """Its stdin is empty, a non-daemon thread is joined before it ends, and an abort at exit is its status."""
    script = tmp_path / "exit.py"
    script.write_text(
        "import sys, threading, time\n"
        "print(repr(sys.stdin.read()), flush=True)\n"
        "threading.Thread(target=lambda: (time.sleep(0.5), print('joined', flush=True))).start()\n"
    )
    result = launch(script, [], nproc=0)
    assert (result.returncode, result.stdout) == (0, "''\njoined\n"), result.stderr
    aborts = tmp_path / "aborts.py"
    aborts.write_text("import atexit, os\natexit.register(os.abort)\n")
    assert launch(aborts, [], nproc=0).returncode == -6  # SIGABRT, as `python aborts.py` ends
    assert launch(aborts, [], nproc=2).returncode == 1
