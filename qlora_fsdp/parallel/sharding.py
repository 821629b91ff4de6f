"""Sharding, shared by both FSDP versions: precision modes, the per-layer sharder, and the packed-bytes guard.

Loading hands each decoder layer to `Sharder.shard_unit` as soon as it is whole; `Sharder.finish` shards the root
and returns a `ShardedModel`, the one handle the trainer and checkpointing use whatever the version.
`verify_packed` then checks, in the first forward, that no quantized layer sees other bytes than loading made.
`fsdp1.py` and `fsdp2.py` hold what differs.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from qlora_fsdp.compat import checkpoint_unwrapped, checkpoint_wrapped, compile_past_checkpoint_side_effects
from qlora_fsdp.config.options import FSDPConfig
from qlora_fsdp.errors import InternalError
from qlora_fsdp.parallel.distributed import DistEnv
from qlora_fsdp.parallel.precision import Precision
from qlora_fsdp.quant.base import QuantizedLinear


@dataclass(frozen=True)
class PackedLayout:
    """How quantized layers hold their packed bytes and quantization state, as the FSDP version can shard them.

    The one place the layout is decided is the sharder's `layout` (FSDP2: by probing this torch's `fully_shard`,
    or `--packed_layout`); the trainer hands it to the backend and reports it once at start-up.
    """

    storage_dtype: torch.dtype
    """uint8, or the float dtype the bytes are viewed as (never cast: `.view`, not `.to`)."""
    state_sharded: bool
    """The quantization state is parameters of the layer's unit, sharded with it; else replicated on every rank."""
    why: str
    """The reason, for the start-up line."""

    def describe(self) -> str:
        as_what = "uint8" if self.storage_dtype == torch.uint8 else f"viewed as {str(self.storage_dtype)[6:]}"
        state = "sharded with them" if self.state_sharded else "replicated on every rank"
        return f"packed weights: {as_what} parameters, quantization state {state} ({self.why})"


@dataclass(frozen=True)
class ShardPlan:
    """What a sharder would be given, so that a rank's share of each parameter can be counted without sharding
    (scripts/plan.py): each version's `planned_bytes` follows its own sharding rule."""

    units: tuple[nn.Module, ...]
    """The decoder layers, each a unit of its own."""
    ignore: tuple[type[nn.Module], ...]
    """FSDP1: classes kept out of mixed precision, in units of their own (see make_sharder)."""
    adapters_own_units: bool
    """FSDP1: adapter leaves in units of their own."""
    mixed_precision: bool
    """Whether the precision mode has an FSDP mixed-precision policy (FSDP1 then wraps `ignore` apart)."""
    shards: int
    """Ranks that share each parameter (a shard group)."""
    index: int
    """This rank's place in its shard group."""


def planned_layout(cfg: FSDPConfig, precision: Precision) -> PackedLayout:
    """The layout `--fsdp_version`'s sharder would choose in a job on this torch, without a job."""
    return importlib.import_module(f"qlora_fsdp.parallel.fsdp{cfg.fsdp_version}").packed_layout(cfg, precision)


def planned_parameter_bytes(model: nn.Module, plan: ShardPlan, *, version: int) -> dict[nn.Parameter, int]:
    """Each parameter's bytes that the rank `plan` describes would hold once `model` is sharded by FSDP `version`:
    what `ShardedModel.local_parameter_bytes` measures, summed."""
    return importlib.import_module(f"qlora_fsdp.parallel.fsdp{version}").planned_bytes(model, plan)


class ShardedModel(ABC):
    """The sharded model and the few operations whose FSDP API differs between versions."""

    state_dict_skips_frozen = True
    """Whether torch's get_state_dict can leave the frozen parameters out (checkpoints hold the trainable ones)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.uncompiled: list[nn.Module] = []
        """Decoder-layer units that --compile will compile once the first step has run (see compile_units)."""

    def compile_units(self) -> None:
        """Compile the units --compile asked for, in place (names, state dict and FSDP's hooks stay the module's).

        Not before the first forward has run: verify_packed's one-time hooks, which remove themselves there, are
        what dynamo cannot trace (it would run the layers eagerly for good).
        """
        if self.uncompiled:
            compile_past_checkpoint_side_effects()
        for unit in self.uncompiled:
            unit.compile()
        self.uncompiled = []

    @abstractmethod
    def no_sync(self) -> contextlib.AbstractContextManager:
        """Accumulate gradients locally: no reduction in the backward passes inside."""

    @abstractmethod
    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the global gradient norm; returns the norm before clipping, the same on every rank."""

    @abstractmethod
    def gather(self, modules: list[nn.Module]) -> Iterator[tuple[nn.Module, dict[str, torch.Tensor]]]:
        """Each module's own parameters as full CPU tensors on rank 0 (empty dicts elsewhere), in `modules` order.

        A collective: every rank calls it with the same modules.
        """

    @abstractmethod
    def load(self, module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        """Copy full tensors (every rank has them) into `module`'s own parameters, bit for bit. A collective."""

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict as full CPU tensors on rank 0 (empty elsewhere), under the root's names."""

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """This rank's optimizer state, as a checkpoint of format 1 saved it (`optimizer.state_dict()`)."""
        optimizer.load_state_dict(state)

    @abstractmethod
    def local_parameter_bytes(self) -> int:
        """Bytes of parameters this rank holds: its shards plus anything unsharded."""


class Sharder(ABC):
    """Shards decoder layers as loading completes them, then the root; remembers the packed bytes it was given."""

    def __init__(self, cfg: FSDPConfig, *, env: DistEnv, precision: Precision) -> None:
        self.cfg = cfg
        self.env = env
        self.precision = precision
        self.reference: dict[int, tuple[str, tuple]] = {}
        self.units: list[nn.Module] = []
        """The sharded decoder-layer units, in loading order."""
        """id(quantized layer) -> (its name, digest of what loading produced), for verify_packed."""

    @property
    @abstractmethod
    def layout(self) -> PackedLayout:
        """How quantized layers keep their packed bytes and state under this FSDP version (asked for only when
        the model has quantized layers)."""

    @abstractmethod
    def _shard(self, unit: nn.Module) -> nn.Module:
        """Shard one unit; returns what takes its place in the parent."""

    @abstractmethod
    def _shard_root(self, model: nn.Module) -> ShardedModel: ...

    def shard_unit(self, name: str, layer: nn.Module, *, root: nn.Module) -> None:
        """Shard the decoder layer `name` of `root` (checkpointed if configured) and free its full copy."""
        self._remember(layer, prefix=f"{name}.")
        unit = layer
        if self.cfg.gradient_checkpointing:
            unit = checkpoint_wrapped(layer, reentrant=self.cfg.reentrant_checkpointing)
        parent_name, _, child = name.rpartition(".")
        sharded = self._shard(unit)
        self.units.append(sharded)
        setattr(root.get_submodule(parent_name), child, sharded)

    def finish(self, model: nn.Module) -> ShardedModel:
        """Shard what is left (embeddings, norm, head) as the root, once every rank has checked that all ranks
        quantized the same bytes."""
        self._remember(model, prefix="")
        _check_same_on_every_rank(self.reference, self.env)
        return self._shard_root(model)

    def _remember(self, module: nn.Module, *, prefix: str) -> None:
        for name, sub in module.named_modules():
            if isinstance(sub, QuantizedLinear) and id(sub) not in self.reference and not sub.is_meta:
                self.reference[id(sub)] = (prefix + name, packed_digest(sub))


def make_sharder(
    cfg: FSDPConfig,
    *,
    env: DistEnv,
    precision: Precision,
    ignore: tuple[type[nn.Module], ...],
    adapters_own_units: bool,
) -> Sharder:
    """The sharder for `--fsdp_version`. `ignore` and `adapters_own_units` only matter to FSDP1, which flattens
    each unit into one tensor: quantized layers must stay out of a casting unit, and frozen and trainable
    parameters cannot share one."""
    module = importlib.import_module(f"qlora_fsdp.parallel.fsdp{cfg.fsdp_version}")
    return module.SHARDER(cfg, env=env, precision=precision, ignore=ignore, adapters_own_units=adapters_own_units)


# ---------------------------------------------------------------------------------------------------------------
# Packed-bytes guard
# ---------------------------------------------------------------------------------------------------------------


def _checksum(data: torch.Tensor, chunk: int = 1 << 22) -> int:
    """A checksum of uint8 bytes: crc32 on CPU; on GPU a sum of bytes times a hash of their position, so nothing
    is copied to the host and moved or rewritten bytes change it.

    crc32 reads copies of chunks: a numpy view of a parameter would make its storage unresizable, which FSDP2
    needs it to be (it frees unsharded parameters by resizing their storage to zero).
    """
    if data.device.type == "cpu":
        crc = 0
        for start in range(0, data.numel(), chunk):
            crc = zlib.crc32(data[start : start + chunk].clone().numpy(), crc)
        return crc
    total = 0
    for start in range(0, data.numel(), chunk):
        part = data[start : start + chunk].to(torch.int64)
        position = torch.arange(start, start + part.numel(), device=data.device, dtype=torch.int64) % (1 << 31)
        total += int((part * (position * 2654435761 % 2147483647 + 1)).sum())  # Knuth's multiplicative hash
    return total


def _digest_tensor(t: torch.Tensor) -> tuple:
    t = t.detach()
    return str(t.dtype), t.numel(), _checksum(t.contiguous().view(torch.uint8).flatten())


def packed_digest(module: QuantizedLinear) -> tuple:
    """dtype, size and checksum of the packed weight and of every state tensor as the module holds them now.

    Any cast (dtype or byte count), reordering or rewritten byte changes it.
    """
    return (_digest_tensor(module.weight), *(_digest_tensor(t) for t in module.state_bytes().values()))


def _check_same_on_every_rank(reference: dict[int, tuple[str, tuple]], env: DistEnv) -> None:
    """Every rank holds the whole of each layer before sharding it (quantized by itself, or, for bnb, gathered from
    the parts every rank quantized): their packed bytes and state must agree bit for bit."""
    if env.world_size == 1:
        return
    mine = zlib.crc32(repr(sorted(reference.values())).encode())
    everyone: list[int] = [0] * env.world_size
    dist.all_gather_object(everyone, mine)
    differ = [rank for rank, value in enumerate(everyone) if value != everyone[0]]
    if differ:
        raise InternalError(
            f"rank {differ[0]} quantized the model into other bytes than rank 0: the quantization kernel is not "
            "deterministic on this device; report it with your flags and versions"
        )


def verify_packed(model: nn.Module, reference: dict[int, tuple[str, tuple]]) -> None:
    """Check, in the first forward of each quantized layer, that it sees exactly the bytes loading produced.

    This is where sharding, gathering and mixed precision have all had their say: a cast, a rewritten NaN pattern
    or a misplaced shard is reported by name instead of training on corrupted weights.
    """
    for module in model.modules():
        if isinstance(module, QuantizedLinear) and id(module) in reference:
            name, expected = reference[id(module)]
            holder: list = []
            hook = functools.partial(_check_packed, name=name, expected=expected, holder=holder)
            holder.append(module.register_forward_pre_hook(hook))


def _check_packed(module: QuantizedLinear, args: tuple, *, name: str, expected: tuple, holder: list) -> None:
    holder[0].remove()
    seen = packed_digest(module)
    if seen != expected:
        dtype, was = seen[0][0], expected[0][0]
        detail = f"packed dtype {dtype}, was {was}" if dtype != was else "bytes differ"
        raise PackedWeightsChanged(
            f"packed quantized weights of {name} changed between loading and their first forward ({detail}): "
            "mixed precision or sharding rewrote them; check --precision and --fsdp_version and report this "
            "with your flags"
        )


class PackedWeightsChanged(InternalError):
    """A quantized layer's bytes differ from what loading produced (see verify_packed)."""


def unwrapped(modules: Iterable[nn.Module]) -> Iterator[nn.Module]:
    """The modules with activation-checkpoint wrappers taken off."""
    for module in modules:
        yield checkpoint_unwrapped(module)
