"""Process group, device, rank and mesh: the only module that reads torchrun's environment variables."""

from __future__ import annotations

import datetime
import gc
import os
import random
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from qlora_fsdp.config.options import FSDPConfig
from qlora_fsdp.errors import InternalError, UserError

T = TypeVar("T")

# The lowest port free_port draws: above the registered services most hosts run.
PORT_FLOOR = 20000


@dataclass(frozen=True)
class JobMesh:
    """Every rank of the job laid out once, with the views each parallelism takes its process groups from.

    rank = (replicate x shards + shard) x sequence + sequence index: a sequence group is consecutive ranks, within
    one FSDP shard group of consecutive ranks. The flattened views are kept here, as torch asks, rather than sliced
    from `dims` again.
    """

    dims: DeviceMesh
    """("replicate", "shard", "sequence"); the sequence dim is this rank's sequence-parallel group."""
    fsdp: DeviceMesh
    """shard x sequence flattened: the ranks that shard each parameter between them (a sequence group's ranks hold
    different shards of the same layers)."""
    hybrid: DeviceMesh
    """("replicate", "shard"): replicate x fsdp, for hybrid sharding and no_shard. A mesh of its own over the same
    process groups, because FSDP1 takes a mesh sliced from a larger one for FSDP + tensor parallelism (its state
    dicts would then expect tensor-parallel shards)."""

    @classmethod
    def build(cls, device_type: str, shape: tuple[int, int, int]) -> JobMesh:
        """A collective: every rank builds the same mesh at the same point."""
        dims = init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard", "sequence"))
        fsdp = dims["shard", "sequence"]._flatten("fsdp")
        layout = torch.arange(dims.size()).view(shape[0], -1)
        hybrid = DeviceMesh.from_group(
            [dims.get_group("replicate"), fsdp.get_group()], device_type, layout, mesh_dim_names=("replicate", "shard")
        )
        return cls(dims, fsdp, hybrid)


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job; passed to every builder instead of reading the environment."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str
    job_mesh: JobMesh | None = None
    """Built by init_distributed; None only in a DistEnv made by hand for work without collectives (one process,
    tests)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def mesh(self) -> JobMesh:
        """The job's mesh, for the collectives of a parallelism."""
        if self.job_mesh is None:
            raise InternalError("a DistEnv made without init_distributed has no mesh to take process groups from")
        return self.job_mesh

    @property
    def sequence_parallel(self) -> int:
        """Ranks that split each row along the sequence (--sequence_parallel_size): consecutive ranks, reading the
        same rows. The data is dealt to groups of them, not to ranks."""
        return 1 if self.job_mesh is None else self.job_mesh.dims["sequence"].size()

    @property
    def data_rank(self) -> int:
        """Which share of the data this rank reads: its sequence-parallel group's."""
        return self.rank // self.sequence_parallel

    @property
    def data_world_size(self) -> int:
        """How many shares the data is dealt into: world size / sequence-parallel size."""
        return self.world_size // self.sequence_parallel


def free_port() -> int:
    """A port free now on every interface (where rank 0's store listens), for a launcher to hand its ranks (the
    tests', the benchmarks').

    It is drawn below the kernel's ephemeral range: a port that bind(0) hands out can be handed again, as another
    connection's source port, before rank 0 binds it. Drawn by the system's randomness, as two test workers that
    seeded `random` alike would draw the same ports.
    """
    draw, ceiling = random.SystemRandom(), _ephemeral_floor()
    for _ in range(100):
        port = draw.randrange(PORT_FLOOR, ceiling)
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    raise UserError(f"no free port found between {PORT_FLOOR} and {ceiling}: set MASTER_PORT yourself")


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands out on its own (Linux's default, 32768, where it does not say)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
    return max(low, PORT_FLOOR + 1000)


def resolve_device(preference: str, local_rank: int) -> torch.device:
    """auto picks CUDA when visible; asking for cuda without a GPU is a user error, not a crash later."""
    if preference == "cpu" or (preference == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError("--device cuda was given but no CUDA GPU is visible; use --device cpu or auto")
    return torch.device("cuda", local_rank)


def mesh_shape(
    fsdp: FSDPConfig, *, sequence_parallel: int, world_size: int, local_world_size: int
) -> tuple[int, int, int]:
    """The sizes of JobMesh.dims for `fsdp` and --sequence_parallel_size on this job; a layout the flags cannot
    give is the user's to fix.

    FSDP shards over groups of consecutive ranks (hybrid_*: --shard_group_size, else a node; no_shard: one rank;
    otherwise every rank), and sequence groups are consecutive ranks too: for both to be dims of one mesh, a shard
    group holds whole sequence groups.
    """
    strategy, sequence = fsdp.sharding_strategy, sequence_parallel
    group = {"no_shard": 1}.get(strategy, world_size)
    if strategy.startswith("hybrid"):
        group = fsdp.shard_group_size or local_world_size
        if world_size % group:
            raise UserError(
                f"--sharding_strategy {strategy}: {world_size} ranks do not split into shard groups of {group}; "
                "set --shard_group_size to a divisor of the world size"
            )
    if world_size % sequence:
        raise UserError(
            f"--sequence_parallel_size {sequence} does not divide the {world_size} ranks torchrun started; use a "
            "divisor of the world size"
        )
    if group % sequence:
        fix = f"--shard_group_size a multiple of {sequence}" if strategy.startswith("hybrid") else "full_shard"
        raise UserError(
            f"--sequence_parallel_size {sequence} puts each group of {sequence} ranks inside one shard group, and "
            f"--sharding_strategy {strategy} shards over {group} rank(s): use {fix}"
        )
    return world_size // group, group // sequence, sequence


def init_distributed(
    *, device: str = "auto", timeout_s: int = 600, fsdp: FSDPConfig | None = None, sequence_parallel: int = 1
) -> DistEnv:
    """Join the torchrun job (or make a one-process group) so FSDP runs the same code at any world size, and lay its
    ranks out as the mesh `fsdp` and `sequence_parallel` ask for (default: full sharding, no sequence parallelism).

    Without torchrun, a single-rank group is created. A caller that joined already keeps its group: each call
    builds a mesh of its own, for its own flags.
    """
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    shape = mesh_shape(fsdp or FSDPConfig(), sequence_parallel=sequence_parallel, world_size=world_size,
                       local_world_size=local_world_size)  # fmt: skip
    dev = resolve_device(device, local_rank)
    # CUDA tensors go over NCCL; CPU tensors (FSDP2's CPU-offloaded shards, gradient norms, small control
    # messages) over gloo, in the same process group.
    backend = "cuda:nccl,cpu:gloo" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        # Without torchrun, the one rank's store listens on a port the kernel picks as it binds: nothing can take
        # it between choosing and binding.
        store = None if "MASTER_ADDR" in os.environ else dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timeout)
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=dev if dev.type == "cuda" else None,
        )
    return DistEnv(rank, local_rank, world_size, local_world_size, dev, backend, JobMesh.build(dev.type, shape))


def teardown() -> None:
    """Leave the process group; collect first so no FSDP state outlives it.

    Destroying a gloo group while FSDP objects still hold work on it intermittently aborted the process at exit
    ("terminate called without an active exception").
    """
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def broadcast_object(obj: object, env: DistEnv) -> object:
    """Rank 0's value on every rank (used for decisions that must agree, such as an error found on rank 0)."""
    if env.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=env.device)
    return box[0]


def gather_ints(value: int, env: DistEnv) -> list[int]:
    """Every rank's `value`, in rank order (for per-rank memory figures)."""
    out = [torch.zeros((), dtype=torch.int64, device=env.device) for _ in range(env.world_size)]
    dist.all_gather(out, torch.tensor(value, dtype=torch.int64, device=env.device))
    return [int(t) for t in out]


def leaders_first(work: Callable[[], T], env: DistEnv, *, timeout_s: float = 6 * 3600) -> T:
    """`work()` on each node's local rank 0, then, once every leader is done, on the other ranks.

    For work whose first run leaves its result on disk (a tokenized cache): the others then find it there. The
    wait uses a gloo group of its own with a long timeout, since a first build may outlast the job's collective
    timeout; a leader's failure is raised there and, as a UserError with its message, on every other rank.
    """
    if env.world_size == 1 or not dist.is_initialized():
        return work()
    leader = env.local_rank == 0
    result: object = None
    failure: Exception | None = None
    if leader:
        try:
            result = work()
        except Exception as exc:  # passed on: no rank may wait for a leader that died
            failure = exc
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        messages: list[str | None] = [None] * env.world_size
        mine = None if failure is None else (str(failure) if isinstance(failure, UserError) else repr(failure))
        dist.all_gather_object(messages, mine, group=group)
    finally:
        dist.destroy_process_group(group)
    if failure is not None:
        raise failure
    failed = next((message for message in messages if message is not None), None)
    if failed is not None:
        raise UserError(failed)
    return result if leader else work()  # type: ignore[return-value]
