"""FSDP2 (`fully_shard`): per-parameter sharding, one unit per decoder layer, packed bytes and state sharded.

A decoder layer's quantized weights, their quantization state and its adapters form one unit: one all-gather in
forward, one in backward, one reduce-scatter. On torch 2.12+ mixed precision skips non-floating parameters, so
packed bytes and state are uint8 parameters, sharded and gathered as bytes, never cast. Older FSDP2 cannot shard a
uint8 parameter (it makes every sharded parameter require grad) and would cast it: there they are viewed as the
dtype FSDP2 gathers in, which its mixed precision leaves alone (shared/FINDINGS.md). `Fsdp2Sharder.layout`
decides which, as `compat.fsdp2_uint8_problem` finds this torch's FSDP2.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from qlora_fsdp.compat import fsdp2_uint8_problem
from qlora_fsdp.config.options import FSDPConfig
from qlora_fsdp.errors import UserError
from qlora_fsdp.parallel.distributed import DistEnv
from qlora_fsdp.parallel.precision import Precision
from qlora_fsdp.parallel.sharding import PackedLayout, ShardedModel, Sharder, ShardPlan

# shard_grad_op keeps gathered parameters from forward to backward (ZeRO-2); no_shard is a shard group of one.
RESHARD_AFTER_FORWARD = {
    "full_shard": True,
    "shard_grad_op": False,
    "no_shard": True,
    "hybrid_shard": True,
    "hybrid_shard_zero2": False,
}


def shard_mesh(cfg: FSDPConfig, env: DistEnv) -> DeviceMesh:
    """1-D over every rank, or (replicate, shard) for hybrid sharding and no_shard (shard groups of one): the job
    mesh's FSDP dims, which init_distributed laid out for `cfg`."""
    if cfg.sharding_strategy == "full_shard" or cfg.sharding_strategy == "shard_grad_op":
        return env.mesh.fsdp
    return env.mesh.hybrid


def packed_layout(cfg: FSDPConfig, precision: Precision, *, mesh: DeviceMesh | None = None) -> PackedLayout:
    """uint8 where this torch's FSDP2 shards integer parameters, else viewed as the dtype it gathers in: the
    mixed-precision parameter dtype, else the parameter dtype. `--packed_layout` forces either. Probed over the
    run's `mesh`, or over a one-rank world of its own (scripts/plan.py, which has no job)."""
    mp = precision.mixed_precision
    gathered = mp[0] if mp is not None else precision.param_dtype
    if cfg.packed_layout == "float":
        return PackedLayout(gathered, state_sharded=True, why="--packed_layout float")
    problem = fsdp2_uint8_problem(mesh)
    if problem is None:
        return PackedLayout(torch.uint8, state_sharded=True, why=f"torch {torch.__version__}")
    if cfg.packed_layout == "uint8":
        raise UserError(
            f"--packed_layout uint8: the FSDP2 of torch {torch.__version__} cannot shard uint8 parameters "
            f"({problem}); use --packed_layout auto, which views them as {str(gathered)[6:]} there"
        )
    return PackedLayout(
        gathered, state_sharded=True, why=f"the FSDP2 of torch {torch.__version__} cannot shard uint8 parameters"
    )


def planned_bytes(model: nn.Module, plan: ShardPlan) -> dict[nn.Parameter, int]:
    """The bytes of each parameter that rank `plan.index` of a shard group would hold: fully_shard splits every
    parameter along dim 0 as torch.chunk does (ceil(rows / shards) rows each, the last ranks less or none)."""
    held = {}
    for param in model.parameters():
        rows = param.shape[0] if param.dim() else 1
        per_rank = -(-rows // plan.shards)
        mine = max(0, min(rows, (plan.index + 1) * per_rank) - plan.index * per_rank)
        held[param] = mine * (param.numel() // max(rows, 1)) * param.element_size()
    return held


class Fsdp2Sharder(Sharder):
    def __init__(
        self,
        cfg: FSDPConfig,
        *,
        env: DistEnv,
        precision: Precision,
        ignore: tuple[type[nn.Module], ...] = (),
        adapters_own_units: bool = False,
    ) -> None:
        super().__init__(cfg, env=env, precision=precision)
        mp = MixedPrecisionPolicy()
        if precision.mixed_precision is not None:
            param, reduce, _ = precision.mixed_precision
            mp = MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)
        self.options = dict(
            mesh=shard_mesh(cfg, env),
            reshard_after_forward=RESHARD_AFTER_FORWARD[cfg.sharding_strategy],
            mp_policy=mp,
            offload_policy=CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy(),
        )

    @functools.cached_property
    def layout(self) -> PackedLayout:
        return packed_layout(self.cfg, self.precision, mesh=self.options["mesh"])

    def _shard(self, unit: nn.Module) -> nn.Module:
        return fully_shard(unit, **self.options)

    def _shard_root(self, model: nn.Module) -> ShardedModel:
        # The root (embeddings, norm, head) is the last module forward uses and the first backward needs: keeping
        # it gathered saves one all-gather a step (2L+1 in all for L layers).
        root = fully_shard(model, **{**self.options, "reshard_after_forward": False})
        return Fsdp2Model(root, reshard_after_forward=self.options["reshard_after_forward"], env=self.env)


def _full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param


class Fsdp2Model(ShardedModel):
    def __init__(self, module: nn.Module, *, reshard_after_forward: bool, env: DistEnv) -> None:
        super().__init__(module)
        self.reshard_after_forward = reshard_after_forward
        """The decoder-layer units' setting (the root's is always False)."""
        self.env = env

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every unit's full parameters held until the context exits, so forwards inside run no collective and each
        rank may run as many as it needs (GRPO's --generation_mode gathered). Entering is a collective."""
        units = [m for m in self.module.modules() if isinstance(m, FSDPModule)]
        layers = [unit for unit in units if unit is not self.module]
        for unit in layers:
            unit.set_reshard_after_forward(False, recurse=False)
        try:
            for unit in units:
                unit.unshard()
            yield
        finally:
            for unit in layers:
                unit.set_reshard_after_forward(self.reshard_after_forward, recurse=False)
            for unit in units:
                unit.reshard()

    def no_sync(self) -> contextlib.AbstractContextManager:
        return _without_gradient_sync(self.module)

    def clip_grad_norm(self, max_norm: float) -> float:
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(_full(norm))

    def gather(self, modules: list[nn.Module]) -> Iterator[tuple[nn.Module, dict[str, torch.Tensor]]]:
        for module in modules:
            full = {n: _full(p.detach()) for n, p in module.named_parameters()}
            yield module, ({n: t.cpu().clone() for n, t in full.items()} if self.env.is_main else {})

    def load(self, module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, param in module.named_parameters():
                value = tensors[name].to(device=param.device, dtype=param.dtype)
                if isinstance(param, DTensor):
                    # Every rank holds the full tensor: each keeps its own shard, no communication.
                    local = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
                    param.to_local().copy_(local.to_local())
                else:
                    param.copy_(value)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        state = {}
        for name, tensor in self.module.state_dict().items():
            full = _full(tensor)
            if self.env.is_main:
                state[name] = full.cpu()
        return state

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        optimizer.load_state_dict(state)
        # load_state_dict gives plain tensors; the optimizer's arithmetic needs them sharded like their parameter.
        for param, param_state in optimizer.state.items():
            if not isinstance(param, DTensor):
                continue
            local = param.to_local()
            for name, value in param_state.items():
                if not isinstance(value, torch.Tensor) or not value.dim():  # a step count
                    continue
                if value.shape != local.shape:
                    raise UserError(
                        f"--resume_from: a saved optimizer shard is {list(value.shape)}, this rank's parameter shard "
                        f"{list(local.shape)}: the ranks are grouped otherwise than when it was saved; resume with "
                        "the same number of nodes and processes per node"
                    )
                param_state[name] = DTensor.from_local(
                    value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
                )

    def local_parameter_bytes(self) -> int:
        total = 0
        for param in self.module.parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            total += local.numel() * local.element_size()
        return total


@contextlib.contextmanager
def _without_gradient_sync(module: nn.Module) -> Iterator[None]:
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


SHARDER = Fsdp2Sharder
