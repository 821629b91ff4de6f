"""FSDP wrapping: per-decoder-layer units, adapters in their own units, mixed precision that skips packed storage."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

from qlora_fsdp.config import FSDPConfig
from qlora_fsdp.distributed import DistEnv, broadcast_object
from qlora_fsdp.errors import UserError
from qlora_fsdp.lora import is_trainable_leaf
from qlora_fsdp.quant.base import QuantBackend

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

STRATEGIES = {
    "full_shard": ShardingStrategy.FULL_SHARD,
    "shard_grad_op": ShardingStrategy.SHARD_GRAD_OP,
    "no_shard": ShardingStrategy.NO_SHARD,
    "hybrid_shard": ShardingStrategy.HYBRID_SHARD,
    # FSDP1 names it privately; it is HYBRID_SHARD with SHARD_GRAD_OP inside each group.
    "hybrid_shard_zero2": ShardingStrategy._HYBRID_SHARD_ZERO2,
}


@dataclass(frozen=True)
class Precision:
    """What `--precision` means for parameters, FSDP MixedPrecision and autocast."""

    param_dtype: torch.dtype
    """Dtype of every unquantized parameter, and so of the quantized storage flattened with them."""
    autocast_dtype: torch.dtype | None = None
    """Forward/backward run under torch.autocast in this dtype (None: no autocast)."""
    mixed_precision: tuple[torch.dtype, torch.dtype, torch.dtype] | None = None
    """FSDP MixedPrecision (param, reduce, buffer) dtypes; None: no MixedPrecision policy."""
    grad_scaler: bool = False
    """fp16 needs loss scaling."""

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.autocast_dtype or self.param_dtype


_FP32, _BF16, _FP16 = torch.float32, torch.bfloat16, torch.float16
PRECISIONS = {
    "fp32": Precision(_FP32),
    "bf16": Precision(_BF16),
    "fp16_autocast": Precision(_FP32, _FP16, (_FP32, _FP32, _FP32), grad_scaler=True),
    "bf16_autocast": Precision(_FP32, _BF16, (_FP32, _FP32, _FP32)),
    "bf16_buffers_autocast": Precision(_BF16, _BF16, (_BF16, _BF16, _FP32)),
}


def mixed_precision(precision: Precision, *, ignore: tuple[type[nn.Module], ...]) -> MixedPrecision | None:
    """FSDP MixedPrecision for the run; quantized classes are never cast.

    FSDP puts each ignored module in its own unit without casting, which is what keeps packed bytes intact.
    """
    if precision.mixed_precision is None:
        return None
    param, reduce, buffer = precision.mixed_precision
    return MixedPrecision(
        param_dtype=param, reduce_dtype=reduce, buffer_dtype=buffer, _module_classes_to_ignore=list(ignore)
    )


def _device_mesh(cfg: FSDPConfig, env: DistEnv) -> DeviceMesh | None:
    """hybrid_*: shard within groups of --shard_group_size ranks (default: a node), replicate across groups."""
    if not cfg.sharding_strategy.startswith("hybrid"):
        return None
    shard = cfg.shard_group_size or env.local_world_size
    if env.world_size % shard:
        raise UserError(
            f"--sharding_strategy {cfg.sharding_strategy}: {env.world_size} ranks do not split into shard groups of "
            f"{shard}; set --shard_group_size to a divisor of the world size"
        )
    return init_device_mesh(env.device.type, (env.world_size // shard, shard), mesh_dim_names=("replicate", "shard"))


def wrap_model(
    model: nn.Module,
    cfg: FSDPConfig,
    *,
    env: DistEnv,
    precision: Precision,
    layer_classes: tuple[type[nn.Module], ...],
    ignore: tuple[type[nn.Module], ...],
    adapters_own_units: bool,
    sync_from_rank0: bool,
) -> FSDP:
    """Shard `model` over the job, one decoder layer at a time, then the root.

    With `sync_from_rank0` (low-memory loading), each layer is materialized on the other ranks and receives rank
    0's tensors just before it is sharded, so no rank ever holds more than one unsharded layer beyond its shards.
    This is FSDP's `sync_module_states` done per unit by hand: FSDP's own refuses CPU tensors, and this way the
    same code runs on GPUs and in the CPU tests. Quantization state is not sent: every rank computed it itself.
    """
    # FSDP puts each MixedPrecision-ignored (quantized) module in its own unit, but only under an auto-wrap policy.
    leaves = functools.partial(lambda_auto_wrap_policy, lambda_fn=is_trainable_leaf if adapters_own_units else _never)
    options = dict(
        auto_wrap_policy=leaves,
        sharding_strategy=STRATEGIES[cfg.sharding_strategy],
        device_mesh=_device_mesh(cfg, env),
        mixed_precision=mixed_precision(precision, ignore=ignore),
        cpu_offload=CPUOffload(offload_params=True) if cfg.cpu_offload else None,
        device_id=env.device,
        use_orig_params=False,
        limit_all_gathers=True,
    )
    for name, unit in _units(model, layer_classes, ignore=ignore, adapters_own_units=adapters_own_units):
        if sync_from_rank0:
            _sync_from_rank0(unit, env=env)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, FSDP(unit, **options))
    if sync_from_rank0:
        _sync_from_rank0(model, env=env)
    # Every unit below the root is wrapped already; FSDP refuses auto-wrapping over existing units.
    wrapped = FSDP(model, **{**options, "auto_wrap_policy": None})
    if cfg.gradient_checkpointing:
        impl = CheckpointImpl.REENTRANT if cfg.reentrant_checkpointing else CheckpointImpl.NO_REENTRANT
        apply_activation_checkpointing(
            wrapped,
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
            check_fn=lambda m: isinstance(m, layer_classes),
        )
    return wrapped


def _never(module: nn.Module) -> bool:
    return False


def _units(
    model: nn.Module,
    layer_classes: tuple[type[nn.Module], ...],
    *,
    ignore: tuple[type[nn.Module], ...],
    adapters_own_units: bool,
) -> list[tuple[str, nn.Module]]:
    """Decoder layers, plus any adapter leaf or quantized module outside them (e.g. a LoRA on lm_head)."""
    units: list[tuple[str, nn.Module]] = []
    inside: tuple[str, ...] = ()
    for name, module in model.named_modules():
        if inside and name.startswith(inside):
            continue
        own_unit = isinstance(module, ignore) or (adapters_own_units and is_trainable_leaf(module))
        if isinstance(module, layer_classes) or own_unit:
            units.append((name, module))
            inside += (name + ".",)
    return units


def _unwrapped_tensors(module: nn.Module) -> list[tuple[nn.Module, str, bool]]:
    """(owner, name, is_param) for every tensor under `module` that no FSDP unit owns yet, in a fixed order."""
    out = []
    for sub in module.children():
        if not isinstance(sub, FSDP):
            out += _unwrapped_tensors(sub)
    out += [(module, n, True) for n, p in module._parameters.items() if p is not None]
    out += [(module, n, False) for n, b in module._buffers.items() if b is not None]
    return out


def _sync_from_rank0(module: nn.Module, *, env: DistEnv) -> None:
    """Move `module`'s unsharded tensors to the device (allocating meta ones) and broadcast rank 0's values.

    A tensor with several owners (tied embeddings) is sent once, on every rank, so the broadcasts pair up.
    """
    done: dict[int, torch.Tensor] = {}
    for owner, name, is_param in _unwrapped_tensors(module):
        tensor = owner._parameters[name] if is_param else owner._buffers[name]
        if id(tensor) in done:
            if is_param:
                owner._parameters[name] = done[id(tensor)]
            continue
        value = torch.empty_like(tensor, device=env.device) if tensor.is_meta else tensor.data.to(env.device)
        if env.world_size > 1:
            dist.broadcast(value, src=0)
        if not is_param:
            owner._buffers[name] = value
            result = value
        elif tensor.is_meta:
            # A meta Parameter cannot take real data in place; a new one keeps requires_grad.
            result = owner._parameters[name] = nn.Parameter(value, requires_grad=tensor.requires_grad)
        else:
            tensor.data = value
            result = tensor
        done[id(tensor)] = result


def _fingerprint(packed: torch.Tensor, chunk: int = 1 << 24) -> tuple[str, int]:
    """dtype and a position-weighted byte checksum: any cast or reordering of packed bytes changes it.

    Computed in chunks so the int64 temporaries stay small next to a layer's packed bytes.
    """
    data = packed.detach().contiguous().view(torch.uint8).flatten()
    total = 0
    for start in range(0, data.numel(), chunk):
        part = data[start : start + chunk].to(torch.int64)
        weights = torch.arange(start, start + part.numel(), device=data.device, dtype=torch.int64) % 65521 + 1
        total += int((part * weights).sum())
    return str(packed.dtype), total


def packed_fingerprints(quantized: list[nn.Module], backend: QuantBackend) -> list[tuple[str, int]]:
    """Fingerprints of every packed tensor before wrapping (on a rank that holds real tensors)."""
    return [_fingerprint(backend.packed(m)) for m in quantized]


def verify_packed(
    model: FSDP,
    quantized: list[nn.Module],
    backend: QuantBackend,
    before: list[tuple[str, int]] | None,
    *,
    env: DistEnv,
) -> None:
    """Check once, after wrapping, that every rank sees rank 0's packed bytes and dtypes unchanged.

    Each FSDP unit is unsharded alone, so this costs one all-gather pass and one layer of memory.
    """
    reference = broadcast_object(before, env)
    index = {id(m): i for i, m in enumerate(quantized)}
    bad = []
    for unit in FSDP.fsdp_modules(model):
        with FSDP.summon_full_params(unit, recurse=False, writeback=False):
            for module in _owned_modules(unit):
                i = index.get(id(module))
                if i is not None and _fingerprint(backend.packed(module)) != reference[i]:
                    bad.append((i, str(backend.packed(module).dtype)))
    flag = torch.tensor(len(bad), device=env.device)
    if env.world_size > 1:
        dist.all_reduce(flag)
    if int(flag):
        detail = f"module {bad[0][0]} is {bad[0][1]}, was {reference[bad[0][0]][0]}" if bad else "on another rank"
        raise UserError(
            f"packed quantized weights changed during FSDP wrapping ({detail}): the 4-bit bytes live in a float "
            "tensor (quant_storage) that must have the same dtype as the parameters flattened with it and must "
            "never be cast by mixed precision; keep --compute_dtype separate and report this with your flags"
        )


def _owned_modules(unit: FSDP) -> Iterator[nn.Module]:
    """Modules whose tensors belong to `unit` itself, not to a nested unit."""
    stack = [unit.module]
    while stack:
        module = stack.pop()
        yield module
        stack.extend(c for c in module.children() if not isinstance(c, FSDP))


def resident_parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank holds after sharding (its FSDP shards plus anything unsharded)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
