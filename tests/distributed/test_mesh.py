"""The job mesh on 4 real gloo ranks: every parallelism's process groups are the ranks it had before there was one
mesh (sequence groups of consecutive ranks, FSDP shard groups of consecutive ranks holding whole sequence groups,
replicas across them), and the data is dealt to sequence groups."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from qlora_fsdp.config.options import FSDPConfig
from qlora_fsdp.parallel import fsdp1, fsdp2
from qlora_fsdp.parallel.distributed import free_port, init_distributed, teardown
from qlora_fsdp.parallel.sequence_parallel import sequence_groups

pytestmark = pytest.mark.distributed

WORLD = 4
LAYOUTS = {
    "full_shard": (FSDPConfig(), 1),
    "full_shard-s2": (FSDPConfig(), 2),
    "full_shard-s4": (FSDPConfig(), 4),
    "shard_grad_op-s2": (FSDPConfig(sharding_strategy="shard_grad_op"), 2),
    "no_shard": (FSDPConfig(sharding_strategy="no_shard"), 1),
    "hybrid_shard-g2": (FSDPConfig(sharding_strategy="hybrid_shard", shard_group_size=2), 1),
    "hybrid_shard-g2-s2": (FSDPConfig(sharding_strategy="hybrid_shard", shard_group_size=2), 2),
    "hybrid_shard_zero2-g4-s2": (FSDPConfig(sharding_strategy="hybrid_shard_zero2", shard_group_size=4), 2),
}


def _ranks(group: dist.ProcessGroup) -> list[int]:
    return dist.get_process_group_ranks(group)


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    seen = {}
    for name, (cfg, sequence_parallel) in LAYOUTS.items():
        env = init_distributed(device="cpu", timeout_s=60, fsdp=cfg, sequence_parallel=sequence_parallel)
        sequence = sequence_groups(env)
        mesh2 = fsdp2.shard_mesh(cfg, env)
        mesh1 = fsdp1.shard_mesh(cfg, env)
        seen[name] = {
            "sequence": None if sequence is None else [_ranks(sequence.group), sequence.index],
            "data": [env.data_rank, env.data_world_size],
            "fsdp2": [_ranks(group) for group in mesh2.get_all_groups()],
            "fsdp1": None if mesh1 is None else [_ranks(mesh1.get_group(d)) for d in ("shard", "replicate")],
            "fsdp1_root": None if mesh1 is None else mesh1._get_root_mesh() is mesh1,
        }
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    teardown()


def _consecutive(rank: int, size: int) -> list[int]:
    first = rank // size * size
    return list(range(first, first + size))


def _expected(rank: int, cfg: FSDPConfig, s: int) -> dict:
    """The groups as each parallelism built them for itself before the mesh (`s`: --sequence_parallel_size)."""
    hybrid = cfg.sharding_strategy.startswith("hybrid")
    everywhere = cfg.sharding_strategy in ("full_shard", "shard_grad_op")
    group = cfg.shard_group_size if hybrid else WORLD if everywhere else 1
    replicas = list(range(rank % group, WORLD, group))
    return {
        "sequence": None if s == 1 else [_consecutive(rank, s), rank % s],
        "data": [rank // s, WORLD // s],
        "fsdp2": [_consecutive(rank, group)] if everywhere else [replicas, _consecutive(rank, group)],
        "fsdp1": [_consecutive(rank, group), replicas] if hybrid else None,
        # A sliced mesh would make FSDP1 treat its state dicts as FSDP + tensor parallelism.
        "fsdp1_root": True if hybrid else None,
    }


def test_each_parallelism_gets_the_groups_it_had(tmp_path: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen == {name: _expected(rank, *layout) for name, layout in LAYOUTS.items()}, f"rank {rank}"
