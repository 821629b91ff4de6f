"""FSDP1 (`FullyShardedDataParallel`): flat parameters, packed bytes viewed as the parameter dtype.

FSDP1 flattens the floating parameters of a unit into one tensor of one dtype and one requires_grad, so quantized
layers whose mixed precision is skipped get units of their own, and so do adapter leaves (frozen and trainable
parameters cannot share a flat parameter). Hence many small units: kept for compatibility, FSDP2 is the default.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffload, FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

from qlora_fsdp.compat import hybrid_shard_zero2, init_fsdp1_root
from qlora_fsdp.config.options import FSDPConfig
from qlora_fsdp.model.lora import is_trainable_leaf
from qlora_fsdp.parallel.distributed import DistEnv
from qlora_fsdp.parallel.precision import Precision
from qlora_fsdp.parallel.sharding import PackedLayout, ShardedModel, Sharder, ShardPlan, unwrapped

STRATEGIES = {
    "full_shard": ShardingStrategy.FULL_SHARD,
    "shard_grad_op": ShardingStrategy.SHARD_GRAD_OP,
    "no_shard": ShardingStrategy.NO_SHARD,
    "hybrid_shard": ShardingStrategy.HYBRID_SHARD,
    "hybrid_shard_zero2": hybrid_shard_zero2(),  # HYBRID_SHARD, SHARD_GRAD_OP inside each group
}


def mixed_precision(precision: Precision, *, ignore: tuple[type[nn.Module], ...]) -> MixedPrecision | None:
    """FSDP MixedPrecision for the run; `ignore`d (quantized) classes are never cast.

    FSDP puts each ignored module in its own unit without casting, which is what keeps packed bytes intact.
    """
    if precision.mixed_precision is None:
        return None
    param, reduce, buffer = precision.mixed_precision
    return MixedPrecision(
        param_dtype=param,
        reduce_dtype=reduce,
        buffer_dtype=buffer,
        # Adapter units receive their input from PEFT, cast to the adapter's stored dtype: cast it to param's.
        cast_forward_inputs=True,
        _module_classes_to_ignore=list(ignore),
    )


def shard_mesh(cfg: FSDPConfig, env: DistEnv) -> DeviceMesh | None:
    """hybrid_*: shard within groups of --shard_group_size ranks (default: a node), replicate across groups; the
    other strategies use every rank (the default group)."""
    return env.mesh.hybrid if cfg.sharding_strategy.startswith("hybrid") else None


def _never(module: nn.Module) -> bool:
    return False


def packed_layout(cfg: FSDPConfig, precision: Precision) -> PackedLayout:
    """Packed bytes viewed as the parameter dtype, their state replicated: one float dtype per flat parameter."""
    return PackedLayout(precision.param_dtype, state_sharded=False, why="FSDP1 flattens one float dtype per unit")


def planned_bytes(model: nn.Module, plan: ShardPlan) -> dict[nn.Parameter, int]:
    """FSDP1 flattens each unit's own parameters (those in no unit inside it) into one tensor, pads it to a multiple
    of the shard group and keeps one chunk per rank: a rank holds of each parameter what overlaps its chunk, the
    padding counted with the unit's last parameter. Units: the decoder layers, adapter leaves, and the `ignore`d
    (quantized) layers where mixed precision wraps them apart (inside a layer) or the root does (outside)."""
    layers = {id(m) for m in plan.units}
    units: list[list[nn.Parameter]] = []
    seen: set[int] = set()

    def own_unit(module: nn.Module, in_layer: bool) -> bool:
        if id(module) in layers or (plan.adapters_own_units and is_trainable_leaf(module)):
            return True
        return isinstance(module, plan.ignore) and (plan.mixed_precision or not in_layer)

    def collect(module: nn.Module, unit: list[nn.Parameter], in_layer: bool) -> None:
        for param in module.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                unit.append(param)
        for child in module.children():
            if own_unit(child, in_layer):
                units.append([])
                collect(child, units[-1], in_layer or id(child) in layers)
            else:
                collect(child, unit, in_layer)

    units.append([])
    collect(model, units[0], False)
    held: dict[nn.Parameter, int] = {}
    for unit in units:
        total = sum(p.numel() for p in unit)
        chunk = -(-total // plan.shards)
        start, end, offset = plan.index * chunk, (plan.index + 1) * chunk, 0
        for param in unit:
            overlap = max(0, min(end, offset + param.numel()) - max(start, offset))
            held[param] = overlap * param.element_size()
            offset += param.numel()
        if unit and end > total:  # the padding of the last chunk(s)
            held[unit[-1]] += (end - max(start, total)) * unit[-1].element_size()
    return held


class Fsdp1Sharder(Sharder):
    def __init__(
        self,
        cfg: FSDPConfig,
        *,
        env: DistEnv,
        precision: Precision,
        ignore: tuple[type[nn.Module], ...],
        adapters_own_units: bool,
    ) -> None:
        super().__init__(cfg, env=env, precision=precision)
        self.ignore = ignore
        self.adapters_own_units = adapters_own_units
        # FSDP puts each MixedPrecision-ignored (quantized) module in its own unit, but only under an auto-wrap policy.
        own_unit = is_trainable_leaf if adapters_own_units else _never
        leaves = functools.partial(lambda_auto_wrap_policy, lambda_fn=own_unit)
        self.options = dict(
            auto_wrap_policy=leaves,
            sharding_strategy=STRATEGIES[cfg.sharding_strategy],
            device_mesh=shard_mesh(cfg, env),
            mixed_precision=mixed_precision(precision, ignore=ignore),
            cpu_offload=CPUOffload(offload_params=True) if cfg.cpu_offload else None,
            device_id=env.device,
            use_orig_params=False,
            limit_all_gathers=True,
        )

    @property
    def layout(self) -> PackedLayout:
        return packed_layout(self.cfg, self.precision)

    def _shard(self, unit: nn.Module) -> nn.Module:
        return FSDP(unit, **self.options)

    def _shard_root(self, model: nn.Module) -> ShardedModel:
        # Units of their own outside the decoder layers: an adapter on the head, say.
        for name, module in self._leftover_units(model):
            parent_name, _, child = name.rpartition(".")
            # Auto-wrapping gives ignored classes units without mixed precision; a unit made by hand must say so.
            options = {**self.options, "mixed_precision": None} if isinstance(module, self.ignore) else self.options
            setattr(model.get_submodule(parent_name), child, FSDP(module, **options))
        # Every unit below the root is wrapped already; FSDP refuses auto-wrapping over existing units.
        return Fsdp1Model(FSDP(model, **{**self.options, "auto_wrap_policy": None}), env=self.env)

    def _leftover_units(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        units: list[tuple[str, nn.Module]] = []
        inside: tuple[str, ...] = ()
        for name, module in model.named_modules():
            if name and (isinstance(module, FSDP) or (inside and name.startswith(inside))):
                inside += (name + ".",)
                continue
            if isinstance(module, self.ignore) or (self.adapters_own_units and is_trainable_leaf(module)):
                units.append((name, module))
                inside += (name + ".",)
        return units


class Fsdp1Model(ShardedModel):
    # get_state_dict's ignore_frozen_params looks for the quantized layers' weights, which FSDP1's sharded state
    # dict leaves out (their modules are ignored): the checkpoint filters the trainable names itself.
    state_dict_skips_frozen = False

    def __init__(self, module: FSDP, *, env: DistEnv) -> None:
        super().__init__(module)
        self.env = env

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.module.no_sync()

    def clip_grad_norm(self, max_norm: float) -> float:
        return float(self.module.clip_grad_norm_(max_norm))

    def _units_of(self, modules: list[nn.Module]) -> Iterator[tuple[FSDP, nn.Module]]:
        """(unit, module) for each wanted module that is a unit's whole content, in the units' (rank-fixed) order.

        FSDP1 sets up its unit tree from whichever unit is used first: summoning a child before any forward (a
        resume loads adapters then) would make it a root, which the real root's first forward refuses. So the root
        is set up first (a no-op once it is).
        """
        init_fsdp1_root(self.module)
        wanted = {id(m) for m in modules}
        for unit in FSDP.fsdp_modules(self.module):
            (inner,) = unwrapped([unit.module])
            if id(inner) in wanted:
                yield unit, inner

    def gather(self, modules: list[nn.Module]) -> Iterator[tuple[nn.Module, dict[str, torch.Tensor]]]:
        found = dict(self._gather_units(modules))
        for module in modules:
            yield module, found.get(id(module), {})

    def _gather_units(self, modules: list[nn.Module]) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        for unit, inner in self._units_of(modules):
            with FSDP.summon_full_params(unit, recurse=False, writeback=False, rank0_only=True):
                if self.env.is_main:
                    yield id(inner), {n: p.detach().clone().cpu() for n, p in inner.named_parameters()}

    def load(self, module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        for unit, inner in self._units_of([module]):
            with FSDP.summon_full_params(unit, recurse=False, writeback=True), torch.no_grad():
                for name, param in inner.named_parameters():
                    param.copy_(tensors[name])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        # Offloading a CPU run's gathered tensors "to CPU" breaks FSDP1's unsharding on 2+ ranks (empty storage).
        gather = FullStateDictConfig(offload_to_cpu=self.env.device.type != "cpu", rank0_only=True)
        with FSDP.state_dict_type(self.module, StateDictType.FULL_STATE_DICT, gather):
            return self.module.state_dict()

    def local_parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.module.parameters())


SHARDER = Fsdp1Sharder
