"""What differs between the versions of torch, transformers and PEFT we run on, asked in one place.

Our code and the tests' skips call these instead of probing a library or reading its version string, and every
private API we use (a `_name`, or a module outside a library's documented API) is reached only through here, so an
upgrade that moves one breaks here and nowhere else. Each entry names the versions it was checked on, out of torch
2.13.0 and 2.11.0, transformers 5.24.0 and 5.17.0, peft 0.21.2, bitsandbytes 0.50.2 (whose public API is all we
use). Probes answer by trying the thing itself, not by version. Libraries are imported where used, so the command
line can ask before torch loads, and nothing of ours is imported at all: this module sits at the bottom of the
import graph.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import ShardingStrategy

# ---------------------------------------------------------------------------------------------------------- torch


def all_gather_single(output: torch.Tensor, tensor: torch.Tensor) -> None:
    """Every rank's equal-sized `tensor`, concatenated into `output`.

    torch 2.13 names it `all_gather_single` and deprecates `all_gather_into_tensor` (a FutureWarning on every call);
    torch 2.11 has only the old name.
    """
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor)


def fsdp2_uint8_problem(mesh: DeviceMesh | None = None) -> str | None:
    """Why this torch's FSDP2 cannot shard a uint8 parameter, or None if it can (then it shards and gathers packed
    bytes as bytes, and its mixed precision leaves them alone).

    torch 2.13.0 can; torch 2.11.0 cannot: before 2.12 fully_shard made every sharded parameter require gradients,
    which a non-floating one cannot ("only Tensors of floating point dtype can require gradients"). Probed on a meta
    parameter over `mesh` (no memory, no communication); without one, over a one-rank gloo world set up and torn down
    here, which needs no process group to exist yet (the tests' skips ask before any), and answered once.
    """
    if mesh is not None:
        return _uint8_probe(mesh)
    return _uint8_problem_alone()


@functools.cache
def _uint8_problem_alone() -> str | None:
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("fsdp2_uint8_problem: a process group exists; pass the run's device mesh")
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return _uint8_probe(init_device_mesh("cpu", (1,)))
    finally:
        dist.destroy_process_group()


def _uint8_probe(mesh: DeviceMesh) -> str | None:
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    probe = nn.Module()
    probe.packed = nn.Parameter(torch.empty(mesh.size(), dtype=torch.uint8, device="meta"), requires_grad=False)
    try:
        fully_shard(probe, mesh=mesh)
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    return None


def compile_past_checkpoint_side_effects() -> None:
    """Let dynamo compile a checkpointed decoder layer whose forward sets and resets a module-level variable.

    transformers 5.25 requires the `kernels` package, whose `use_kernelized_func` (on Llama's attention, and
    others) sets a context variable around each forward; dynamo refuses any such side effect inside activation
    checkpointing, breaks the graph and runs the layer eagerly, unless told the recompute need not replay it, which
    holds here: the recompute sets and resets the variable itself. `torch._dynamo.config.
    skip_fwd_side_effects_in_bwd_under_checkpoint` (torch 2.13.0); a torch without it has nothing to set.
    """
    import torch._dynamo

    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def reusable_stager(options: StagingOptions) -> DefaultStager | None:
    """A DCP stager that keeps its host buffers from one save to the next, so staging only copies; None where this
    torch's cannot stage twice, and DCP is to make one per save.

    torch 2.13.0's DefaultStager stages again and again; torch 2.11.0's closes its copier after each stage (the
    second raises KeyError). Probed by staging a one-element state twice.
    """
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager

    stager = DefaultStager(options)
    try:
        for _ in range(2):
            stager.stage({"probe": torch.zeros(1)})
    except KeyError:
        stager.close()
        return None
    return stager


def init_fsdp1_root(root: nn.Module) -> None:
    """Set up an FSDP1 (`FullyShardedDataParallel`) root and its unit tree now, as its first forward would (a no-op
    once done): summoning a child's parameters first would make the child a root, which the real root's first forward
    then refuses. FSDP1 has no public call for it: private `torch.distributed.fsdp._runtime_utils._lazy_init(state,
    root)`, where an FSDP module is its own state; same on torch 2.13.0 and 2.11.0.
    """
    from torch.distributed.fsdp._runtime_utils import _lazy_init

    _lazy_init(root, root)


def hybrid_shard_zero2() -> ShardingStrategy:
    """FSDP1's HYBRID_SHARD with SHARD_GRAD_OP inside each shard group, which FSDP1 names privately
    (`ShardingStrategy._HYBRID_SHARD_ZERO2` on torch 2.13.0 and 2.11.0)."""
    from torch.distributed.fsdp import ShardingStrategy

    return ShardingStrategy._HYBRID_SHARD_ZERO2


def checkpoint_wrapped(module: nn.Module, *, reentrant: bool) -> nn.Module:
    """`module` under activation checkpointing, as a wrapper FSDP1 and FSDP2 both shard through and whose state
    dict keeps the inner module's names. torch keeps it in the private `torch.distributed.algorithms._checkpoint`
    (torch 2.13.0 and 2.11.0)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
    return checkpoint_wrapper(module, checkpoint_impl=impl)


def checkpoint_unwrapped(module: nn.Module) -> nn.Module:
    """The module inside an activation-checkpoint wrapper (`checkpoint_wrapped`), or `module` itself when it is none:
    the wrapper's private attribute `_CHECKPOINT_WRAPPED_MODULE` names it (torch 2.13.0 and 2.11.0)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_WRAPPED_MODULE

    return getattr(module, _CHECKPOINT_WRAPPED_MODULE, module)


def start_cuda_memory_history(max_entries: int) -> None:
    """Record CUDA allocations (with stacks) for a memory snapshot. Private but documented in torch's "Understanding
    CUDA Memory Usage": `torch.cuda.memory._record_memory_history` (torch 2.13.0 and 2.11.0)."""
    import torch

    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def dump_cuda_memory_snapshot(path: Path) -> None:
    """Write the recorded history as a snapshot pickle (pytorch.org/memory_viz reads it), then stop recording."""
    import torch

    torch.cuda.memory._dump_snapshot(str(path))
    torch.cuda.memory._record_memory_history(enabled=None)


# --------------------------------------------------------------------------------------------------- transformers


def no_split_modules(model: nn.Module) -> list[str]:
    """The class names a transformers model declares as its repeated blocks (decoder layers): the private class
    attribute `_no_split_modules` (transformers 5.24.0 and 5.17.0), empty when it declares none."""
    return list(getattr(model, "_no_split_modules", None) or [])


def kv_cache_argument(lm: nn.Module) -> str:
    """The forward argument a transformers model (or a PeftModel around one) takes its KV cache by: `cache` on
    transformers 5.24.0, whose `past_key_values` warns that it goes in 5.40, and `past_key_values` on 5.17.0; read
    from the forward's signature."""
    import inspect

    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    return "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"


def weight_transforms(model: nn.Module) -> tuple[list[Any], list[Any]]:
    """transformers' load-time conversion of `model`'s checkpoint names and tensors: (renamings, converters), the
    converters being the WeightConverters that fuse or split tensors (a Mixtral's per-expert w1/w3 into one
    gate_up_proj). From `transformers.conversion_mapping` and `transformers.core_model_loading`, internal modules
    outside its documented API; the same on transformers 5.24.0 and 5.17.0."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return renamings, converters


def rename_source_key(
    name: str, renamings: list[Any], converters: list[Any], prefix: str | None, present: Mapping[str, Any]
) -> tuple[str, str | None]:
    """(model name, matched source pattern) of checkpoint name `name` under `renamings` and `converters` (the
    pattern is None when no converter takes it); `present`: the model's names, which decide a base-model `prefix`.
    transformers' `core_model_loading.rename_source_key`, same signature on 5.24.0 and 5.17.0."""
    from transformers.core_model_loading import rename_source_key as rename

    return rename(name, renamings, converters, prefix, dict(present))


def converter_patterns(converter: Any) -> tuple[list[str], list[str]]:
    """A WeightConverter's (source patterns, target patterns), as attributes of transformers 5.24.0 and 5.17.0."""
    return list(converter.source_patterns), list(converter.target_patterns)


def convert_fused(
    converter: Any, target: str, sources: Mapping[str, tuple[str, torch.Tensor]], model: nn.Module
) -> dict[str, torch.Tensor]:
    """{model name: tensor} that `converter` (a prototype, copied, not consumed) makes of `target`'s `sources`
    ({checkpoint name: (its source pattern, tensor)}), fed in transformers' own order (expert 2 before expert 10:
    `dot_natural_key`). WeightConverter.add_tensor/convert of transformers 5.24.0 and 5.17.0, which take a tensor
    where a loading future would go."""
    import copy

    from transformers.core_model_loading import dot_natural_key

    converter = copy.deepcopy(converter)
    for source in sorted(sources, key=dot_natural_key):
        pattern, tensor = sources[source]
        converter.add_tensor(target, source, pattern, tensor)
    return converter.convert(target, model=model, config=getattr(model, "config", None))


def revert_weight_conversion(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' own reversal of its load-time conversion (fused experts back to per-expert checkpoint tensors),
    `core_model_loading.revert_weight_conversion` of transformers 5.24.0 and 5.17.0; nothing in, nothing out."""
    from transformers.core_model_loading import revert_weight_conversion as revert

    return revert(model, tensors) if tensors else tensors


EXPERTS_FLAG_DEFAULTS = {
    "is_concatenated": True, "is_transposed": False, "has_bias": False, "has_gate": True,
    "has_post_expert_norm": False,
}  # fmt: skip
"""The layout flags transformers' `use_experts_implementation` sets on a fused-experts module, at its defaults."""


def experts_flags(module: nn.Module) -> dict[str, bool]:
    """A fused-experts module's layout flags; one this transformers does not set has its default meaning
    (`has_post_expert_norm`: set by 5.24.0, absent on 5.17.0)."""
    return {k: getattr(module, k, default) for k, default in EXPERTS_FLAG_DEFAULTS.items()}


def default_experts_gating(module: nn.Module) -> bool:
    """Whether a fused-experts module gates as transformers' default (act_fn(gate) * up over the concatenated
    gate_up projection): its class's `_apply_gate` is the private `integrations.moe._default_apply_gate`, which
    `use_experts_implementation` installs where the class defines none (transformers 5.24.0 and 5.17.0)."""
    from transformers.integrations.moe import _default_apply_gate

    return getattr(type(module), "_apply_gate", None) is _default_apply_gate


# ----------------------------------------------------------------------------------------------------------- PEFT


def peft_rewrites(model: nn.Module, *, modules: Sequence[str], parameters: Sequence[str] = ()) -> bool:
    """Whether PEFT, loading a LoRA adapter whose config targets `modules` and `parameters` onto `model` (transformers'
    own, with its fused experts), would rewrite (or refuse) those targets: on transformers 5 its config conversion
    reads the pre-5 names of routed experts' linears (`gate_proj`, `up_proj`, `down_proj` on the families converted
    like Qwen2-MoE) as the fused experts, whatever module they name, at twice the rank.

    Asked of PEFT's own conversion, `peft.utils.transformers_weight_conversion.convert_peft_config_for_transformers`
    (internal; peft 0.21.2 moves such names to `target_parameters`, 0.22.0 keeps a name that matches linears there
    but still adds the fused experts' parameter and doubles its rank), on a copy; a PEFT without it rewrites nothing.
    """
    try:
        from peft import LoraConfig
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:
        return False
    probe = LoraConfig(r=8, target_modules=list(modules), target_parameters=list(parameters) or None)
    before = set(probe.target_modules or ()), set(probe.target_parameters or ())
    try:
        convert_peft_config_for_transformers(probe, model=model, conversions=None)
    except ValueError:  # a fused pair named in part: PEFT would refuse it
        return True
    after = set(probe.target_modules or ()), set(probe.target_parameters or ())
    return after != before or bool(probe.rank_pattern) or bool(probe.alpha_pattern)


@contextlib.contextmanager
def peft_targets_as_given() -> Iterator[None]:
    """PEFT's transformers-5 rewrite of LoRA targets (see `peft_rewrites`) turned off while it adapts a model whose
    routed experts this project has already split into one layer per expert: there a `gate_proj` is a linear by
    that name and nothing else. peft 0.21.2 and 0.22.0 run the rewrite from `BaseTuner.inject_adapter`, importing
    `convert_peft_config_for_transformers` from its module at each call, so it is replaced there for the duration."""
    try:
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:
        yield
        return
    original = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = original


def quiet_peft_checkpointing_warning() -> None:
    """Silence the FutureWarning transformers 5.24.0 raises on every read of `is_gradient_checkpointing` (renamed
    `is_activation_checkpointing`; 5.17.0 has no warning), which PEFT 0.21.2 reads while wrapping a model: nothing a
    user of this tool can act on."""
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
