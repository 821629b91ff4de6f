"""mesh_shape: the job mesh's (replicate, shard, sequence) sizes from the flags, and the layouts they cannot give,
refused with the flag that fixes them before any process group is joined."""

from __future__ import annotations

import re

import pytest

from qlora_fsdp.config.options import FSDPConfig
from qlora_fsdp.errors import UserError
from qlora_fsdp.parallel.distributed import mesh_shape


@pytest.mark.parametrize(
    ("flags", "world", "local", "shape"),
    [
        ({}, 8, 4, (1, 8, 1)),
        ({"sharding_strategy": "shard_grad_op", "sequence_parallel_size": 4}, 8, 4, (1, 2, 4)),
        ({"sharding_strategy": "no_shard"}, 8, 4, (8, 1, 1)),
        ({"sharding_strategy": "hybrid_shard"}, 8, 4, (2, 4, 1)),  # a node by default
        ({"sharding_strategy": "hybrid_shard", "shard_group_size": 2}, 8, 8, (4, 2, 1)),
        ({"sharding_strategy": "hybrid_shard_zero2", "sequence_parallel_size": 2}, 8, 4, (2, 2, 2)),
        ({"sharding_strategy": "hybrid_shard", "shard_group_size": 4, "sequence_parallel_size": 4}, 8, 8, (2, 1, 4)),
    ],
)
def test_shape(flags: dict, world: int, local: int, shape: tuple[int, int, int]) -> None:
    sequence_parallel = flags.pop("sequence_parallel_size", 1)
    assert mesh_shape(FSDPConfig(**flags), sequence_parallel=sequence_parallel, world_size=world,
                      local_world_size=local) == shape  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "world", "needle"),
    [
        ({"sequence_parallel_size": 3}, 4, "--sequence_parallel_size 3 does not divide the 4 ranks"),
        (
            {"sharding_strategy": "hybrid_shard", "shard_group_size": 3},
            4,
            "4 ranks do not split into shard groups of 3; set --shard_group_size",
        ),
        (
            {"sharding_strategy": "hybrid_shard", "shard_group_size": 2, "sequence_parallel_size": 4},
            8,
            "hybrid_shard shards over 2 rank(s): use --shard_group_size a multiple of 4",
        ),
        (
            {"sharding_strategy": "no_shard", "sequence_parallel_size": 2},
            4,
            "--sequence_parallel_size 2 puts each group of 2 ranks inside one shard group",
        ),
    ],
)
def test_layouts_the_flags_cannot_give_are_refused(flags: dict, world: int, needle: str) -> None:
    with pytest.raises(UserError, match=re.escape(needle)):
        sequence_parallel = flags.pop("sequence_parallel_size", 1)
        mesh_shape(FSDPConfig(**flags), sequence_parallel=sequence_parallel, world_size=world, local_world_size=world)
