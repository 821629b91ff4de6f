"""qlora_fsdp.compat: each probe's answer against the thing it probes, tried for real, and each wrapper of a private
API on a tiny real object, so an upgrade that moves one fails here, by name. In-process, on a one-rank gloo world.

Where a probe's answer is also known by version, it is checked against the versions it was checked on (torch 2.13.0
and 2.11.0, transformers 5.24.0 and 5.17.0); other versions get the behaviour checks only.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecisionPolicy, ShardingStrategy, fully_shard
from torch.distributed.tensor import DTensor

from qlora_fsdp import compat
from tests.moe_models import moe_config

TORCH = ".".join(torch.__version__.split(".")[:2])
TRANSFORMERS = ".".join(transformers.__version__.split(".")[:2])
EXPERTS = 11
"""More than 10, so that transformers' natural order (expert 2 before expert 10) differs from the string order."""


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    """A one-rank gloo world in this process (set up after conftest's probe, which needs none to exist yet)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def mixtral() -> nn.Module:
    """A tiny Mixtral on the meta device: transformers' own classes and conversion mapping, no memory."""
    from transformers import AutoModelForCausalLM

    config = moe_config("mixtral", vocab_size=32, hidden=16, layers=1, experts=EXPERTS, intermediate=8)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


# ---------------------------------------------------------------------------------------------------------- torch


def test_all_gather_single_gathers_without_a_deprecation_warning(mesh: DeviceMesh) -> None:
    out = torch.empty(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        compat.all_gather_single(out, torch.arange(3.0))
    assert out.tolist() == [0.0, 1.0, 2.0]


class _Bytes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.packed = nn.Parameter(torch.arange(8, dtype=torch.uint8), requires_grad=False)
        self.weight = nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * self.weight.sum(), self.packed.clone()


def test_uint8_probe_answers_what_fully_shard_does(mesh: DeviceMesh) -> None:
    problem = compat.fsdp2_uint8_problem(mesh)
    assert compat.fsdp2_uint8_problem() == problem  # the answer without a mesh (the tests' skips) is the same
    module = _Bytes()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if problem is None:
        # Sharded as bytes and gathered as bytes, which mixed precision leaves alone while it casts the weight.
        fully_shard(module, mesh=mesh, mp_policy=mp)
        assert isinstance(module.packed, DTensor) and module.packed.dtype == torch.uint8
        out, packed = module(torch.ones(2))
        assert out.dtype == torch.bfloat16
        assert packed.dtype == torch.uint8 and packed.tolist() == list(range(8))
    else:
        with pytest.raises(RuntimeError, match=problem):
            fully_shard(module, mesh=mesh, mp_policy=mp)
    # Checked on: torch 2.13.0 shards uint8 parameters, 2.11.0 cannot (fully_shard makes them require grad).
    if TORCH in ("2.13", "2.11"):
        assert (problem is None) == (TORCH == "2.13"), (torch.__version__, problem)


def test_reusable_stager_answers_whether_a_stager_stages_twice() -> None:
    options = StagingOptions(False, False, False, False)
    stager = compat.reusable_stager(options)
    if stager is not None:
        try:
            state = torch.arange(3.0)
            first = stager.stage({"x": state})["x"]
            state.add_(10)
            second = stager.stage({"x": state})["x"]
            assert second.tolist() == [10.0, 11.0, 12.0]
            assert second.data_ptr() == first.data_ptr() != state.data_ptr()  # its host buffer, kept
        finally:
            stager.close()
    else:
        fresh = DefaultStager(options)
        fresh.stage({"x": torch.zeros(1)})
        with pytest.raises(KeyError):
            fresh.stage({"x": torch.zeros(1)})
    # Checked on: torch 2.13.0's DefaultStager stages again and again; 2.11.0's closes its copier after a stage.
    if TORCH in ("2.13", "2.11"):
        assert (stager is not None) == (TORCH == "2.13"), torch.__version__


def _fsdp1_pair() -> FSDP:
    """An FSDP1 root holding one child unit, on the CPU."""
    cpu, strategy = torch.device("cpu"), ShardingStrategy.NO_SHARD  # what FSDP1 makes of one rank anyway
    inner = FSDP(nn.Linear(4, 4), device_id=cpu, sharding_strategy=strategy)
    return FSDP(nn.Sequential(inner, nn.Linear(4, 4)), device_id=cpu, sharding_strategy=strategy)


def test_init_fsdp1_root_lets_a_child_be_summoned_before_the_first_forward(mesh: DeviceMesh) -> None:
    root = _fsdp1_pair()
    compat.init_fsdp1_root(root)
    compat.init_fsdp1_root(root)  # a no-op once set up
    with FSDP.summon_full_params(root.module[0], recurse=False):
        assert root.module[0].module.weight.shape == (4, 4)
    assert root(torch.ones(1, 4)).shape == (1, 4)
    # Control: without it, the summoned child took the root's place and the real root's forward refuses.
    root = _fsdp1_pair()
    with FSDP.summon_full_params(root.module[0], recurse=False):
        pass
    with pytest.raises(AssertionError, match="_is_root"):
        root(torch.ones(1, 4))


def test_hybrid_shard_zero2_is_fsdp1s_own_strategy() -> None:
    strategy = compat.hybrid_shard_zero2()
    assert isinstance(strategy, ShardingStrategy)
    assert strategy not in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.SHARD_GRAD_OP)
    assert "HYBRID_SHARD_ZERO2" in strategy.name


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_wrapper_computes_as_its_module_and_unwraps(reentrant: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(4, 4)
    wrapped = compat.checkpoint_wrapped(linear, reentrant=reentrant)
    assert wrapped is not linear
    assert compat.checkpoint_unwrapped(wrapped) is linear and compat.checkpoint_unwrapped(linear) is linear
    assert set(wrapped.state_dict()) == set(linear.state_dict())
    x = torch.randn(2, 4, requires_grad=True)
    wrapped(x).sum().backward()
    through_wrapper = linear.weight.grad.clone()
    linear.weight.grad = None
    linear(x).sum().backward()
    assert torch.equal(through_wrapper, linear.weight.grad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA memory history needs a GPU")
def test_cuda_memory_snapshot_is_written(tmp_path) -> None:
    compat.start_cuda_memory_history(max_entries=1000)
    torch.ones(1024, device="cuda")
    compat.dump_cuda_memory_snapshot(tmp_path / "memory.pickle")
    assert (tmp_path / "memory.pickle").stat().st_size > 0


# --------------------------------------------------------------------------------------------------- transformers


def test_no_split_modules_names_the_decoder_layer(mixtral: nn.Module) -> None:
    assert "MixtralDecoderLayer" in compat.no_split_modules(mixtral)
    assert compat.no_split_modules(nn.Linear(2, 2)) == []


def _checkpoint_experts(w: str) -> list[str]:
    return [f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight" for e in range(EXPERTS)]


def test_rename_source_key_maps_a_mixtral_checkpoint(mixtral: nn.Module) -> None:
    renamings, converters = compat.weight_transforms(mixtral)
    present = dict.fromkeys((n for n, _ in mixtral.named_parameters()), True)
    patterns = {compat.converter_patterns(c)[1][0]: compat.converter_patterns(c)[0] for c in converters}
    assert patterns == {
        ".experts.gate_up_proj": [".experts.*.w1.weight", ".experts.*.w3.weight"],
        ".experts.down_proj": [".experts.*.w2.weight"],
    }
    fused = [
        compat.rename_source_key(_checkpoint_experts("w3")[5], renamings, [c], mixtral.base_model_prefix, present)
        for c in converters
    ]
    assert ("model.layers.0.mlp.experts.gate_up_proj", ".experts.*.w3.weight") in fused
    router = compat.rename_source_key(
        "model.layers.0.block_sparse_moe.gate.weight", renamings, [], mixtral.base_model_prefix, present
    )
    assert router == ("model.layers.0.mlp.gate.weight", None)


def test_convert_fused_and_revert_round_trip_in_expert_order(mixtral: nn.Module) -> None:
    _, converters = compat.weight_transforms(mixtral)
    (gate_up,) = [c for c in converters if compat.converter_patterns(c)[1] == [".experts.gate_up_proj"]]
    w1, w3 = torch.randn(EXPERTS, 8, 16), torch.randn(EXPERTS, 8, 16)
    sources = {n: (".experts.*.w1.weight", w1[e]) for e, n in enumerate(_checkpoint_experts("w1"))}
    sources |= {n: (".experts.*.w3.weight", w3[e]) for e, n in enumerate(_checkpoint_experts("w3"))}
    shuffled = dict(random.Random(0).sample(sorted(sources.items()), len(sources)))  # arrival order is any
    target = "model.layers.0.mlp.experts.gate_up_proj"
    for _ in range(2):  # the converter is a prototype, copied on each use
        out = compat.convert_fused(gate_up, target, shuffled, mixtral)
        assert torch.equal(out[target], torch.cat([w1, w3], dim=1))
    back = compat.revert_weight_conversion(mixtral, {target: out[target]})
    assert set(back) == set(sources)
    assert all(torch.equal(back[n], t) for n, (_, t) in sources.items())
    assert compat.revert_weight_conversion(mixtral, {}) == {}


def test_experts_flags_and_gating_of_transformers_experts(mixtral: nn.Module) -> None:
    experts = mixtral.model.layers[0].mlp.experts
    assert compat.experts_flags(experts) == compat.EXPERTS_FLAG_DEFAULTS
    # Checked on: transformers 5.24.0 sets has_post_expert_norm, 5.17.0 does not (read as its default, False).
    if TRANSFORMERS in ("5.24", "5.17"):
        assert hasattr(experts, "has_post_expert_norm") == (TRANSFORMERS == "5.24"), transformers.__version__
    assert compat.experts_flags(nn.Linear(2, 2)) == compat.EXPERTS_FLAG_DEFAULTS
    assert compat.default_experts_gating(experts)
    own = type("OwnGating", (type(experts),), {"_apply_gate": lambda self, gate_up: gate_up})
    assert not compat.default_experts_gating(own.__new__(own))
    assert not compat.default_experts_gating(nn.Linear(2, 2))


def test_quiet_peft_checkpointing_warning_silences_transformers(mixtral: nn.Module) -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        mixtral.is_gradient_checkpointing  # noqa: B018 (what PEFT reads)
        warned = any(issubclass(w.category, FutureWarning) for w in seen)
        # Checked on: transformers 5.24.0 deprecates the name, 5.17.0 does not.
        if TRANSFORMERS in ("5.24", "5.17"):
            assert warned == (TRANSFORMERS == "5.24"), transformers.__version__
        seen.clear()
        compat.quiet_peft_checkpointing_warning()
        mixtral.is_gradient_checkpointing  # noqa: B018
        assert not [w for w in seen if issubclass(w.category, FutureWarning)]
