"""distributed.leaders_first on 2 real gloo ranks: the other rank waits for the leader's work and gets its failure
in one line, whatever the leader raised, instead of waiting for a leader that died."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qlora_fsdp.errors import UserError
from qlora_fsdp.parallel.distributed import DistEnv, leaders_first

pytestmark = pytest.mark.distributed


def _rank(rank: int, init: str, what: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    env = DistEnv(rank, rank, 2, 2, torch.device("cpu"), "gloo")
    marker = Path(out) / "built"

    def work() -> str:
        if rank == 0:
            if what == "crash":
                raise RuntimeError("disk full")
            if what == "user":
                raise UserError("--dataset x: no such file")
            marker.write_text("ok")
        return marker.read_text()  # the others find the leader's result

    try:
        result = f"ok {leaders_first(work, env)}"
    except Exception as exc:  # the test records what each rank saw
        result = f"{type(exc).__name__}: {exc}"
    Path(out, f"rank{rank}").write_text(result)
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "what, expected",
    [
        ("ok", ["ok ok", "ok ok"]),
        ("user", ["UserError: --dataset x: no such file"] * 2),
        ("crash", ["RuntimeError: disk full", "UserError: RuntimeError('disk full')"]),
    ],
)
def test_every_rank_learns_the_leaders_outcome(tmp_path: Path, what: str, expected: list[str]) -> None:
    init = f"file://{tmp_path / 'rendezvous'}"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank, args=(init, what, str(tmp_path)), nprocs=2, join=True)
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == expected
