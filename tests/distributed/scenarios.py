"""The loop of the multi-scenario workers (options_worker, packing_worker, sequence_worker): many short trainings in
one torchrun job, so the imports and the process group are paid once."""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

import torch.distributed as dist

from qlora_fsdp.parallel.distributed import DistEnv, teardown


def run_scenarios(
    names: Iterable[str], one: Callable[[str], dict], out: Path, env: DistEnv, *, failed: dict | None = None
) -> None:
    """`one(name)` for every scenario, in order, on every rank; rank 0 writes OUT/results.json ({name: its result
    and "error"}), then the job leaves its process group. A scenario that raises is recorded with its traceback
    (`failed` holds its other fields) and the next one still runs: every failure is reported, not the first."""
    results: dict[str, dict] = {}
    for name in names:
        try:
            results[name] = {**one(name), "error": None}
        except Exception as exc:
            results[name] = {"losses": [], **(failed or {}), "error": traceback.format_exc()[-3000:]}
            print(f"{name}: {exc}", file=sys.stderr)
        dist.barrier()
    if env.rank == 0:
        (out / "results.json").write_text(json.dumps(results, indent=1))
    teardown()
