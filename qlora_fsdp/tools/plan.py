"""Will a run fit? Each rank's memory for a training run, planned from config.json without the weights.

The model is built as training builds it (`trainer.make_skeleton` and `add_trainables`: the same backend, packed
layout, skeleton and adapters), each quantized layer is given the tensors its backend's quantizer would make
(`QuantBackend.planned`: shapes and dtypes, on meta), and every parameter is counted as the FSDP version shards it
(`sharding.planned_parameter_bytes`): the parameter bytes per rank are what training measures and logs as
`param_bytes_per_rank`. Gradients and optimizer state follow from the adapters; the gathered units and the
activations are estimates, labelled so. Not counted: the CUDA context, the allocator's fragmentation, NCCL's
buffers, the data loader.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from qlora_fsdp.config.options import OptimConfig, TrainConfig
from qlora_fsdp.errors import UserError
from qlora_fsdp.model.formats import checkpoint_format
from qlora_fsdp.model.hub import resolve_model_path
from qlora_fsdp.model.lora import peft_lora_layers
from qlora_fsdp.parallel.distributed import mesh_shape
from qlora_fsdp.parallel.precision import PRECISIONS
from qlora_fsdp.parallel.sharding import ShardPlan, planned_layout, planned_parameter_bytes
from qlora_fsdp.quant.base import QuantizedLinear
from qlora_fsdp.quant.experts import QuantizedExperts
from qlora_fsdp.quant.mxfp4 import Mxfp4Linear, planned_mxfp4
from qlora_fsdp.tools.config import PlanConfig
from qlora_fsdp.train.optim import build_optimizer
from qlora_fsdp.train.trainer import add_trainables, make_skeleton, quantizes, unit_options

GIB = 1 << 30
RESIDENT_ROWS = (
    ("packed", "quantized weights (packed)"),
    ("state", "quantization state"),
    ("frozen", "other frozen parameters"),
    ("adapters", "adapters (trainable)"),
)
"""The parameter categories, whose sum is `param_bytes_per_rank`."""


@dataclass
class RankPlan:
    """One rank's bytes, by what holds them."""

    packed: int = 0
    state: int = 0
    frozen: int = 0
    adapters: int = 0
    replicated_state: int = 0
    """FSDP1: quantization state held as plain tensors on every rank, outside the parameters."""
    buffers: int = 0
    gradients: int = 0
    optimizer: int = 0
    gathered: int = 0
    """Estimate: full decoder layers and root gathered beyond this rank's shards while they compute."""
    activations: int = 0
    """Estimate: see `activation_bytes`."""

    @property
    def parameter_bytes(self) -> int:
        """What training logs as this rank's resident parameter bytes after sharding."""
        return self.packed + self.state + self.frozen + self.adapters


@dataclass
class Plan:
    """Every rank's planned bytes and what they were planned for."""

    model: str
    world_size: int
    ranks: list[RankPlan]
    settings: list[str]
    """One line each: the flags and choices the figures depend on."""
    offloaded: bool
    """--cpu_offload: parameters, gradients and optimizer state sit in host memory."""
    gpu_memory_gib: float
    notes: list[str] = field(default_factory=list)

    def on_gpu(self, rank: RankPlan) -> int:
        held = rank.parameter_bytes + rank.gradients + rank.optimizer
        return (0 if self.offloaded else held) + rank.replicated_state + rank.buffers + rank.gathered + rank.activations


def plan_run(cfg: TrainConfig, options: PlanConfig) -> Plan:
    """The memory of each rank of `cfg` run on options.nnodes x options.nproc_per_node ranks."""
    world = options.nproc_per_node * options.nnodes
    if cfg.dist.world_size and cfg.dist.world_size != world:
        raise UserError(
            f"--world_size {cfg.dist.world_size} but --nnodes {options.nnodes} x --nproc_per_node "
            f"{options.nproc_per_node} is {world}; make them match or drop --world_size"
        )
    replicas, shards, sequence = mesh_shape(
        cfg.fsdp, sequence_parallel=cfg.dist.sequence_parallel_size, world_size=world,
        local_world_size=options.nproc_per_node,
    )  # fmt: skip
    path = resolve_model_path(cfg.model.model, weights=False)
    cfg = dataclasses.replace(cfg, quant=checkpoint_format(path).quant_settings(cfg.quant, cfg.given))
    precision = PRECISIONS[cfg.fsdp.precision]
    layout = planned_layout(cfg.fsdp, precision) if quantizes(cfg, path) else None
    backend, skeleton, new_blocks = make_skeleton(cfg, path, precision, layout, weights=False)
    for name in skeleton.quantized:
        module = skeleton.model.get_submodule(name)
        shape = torch.Size((module.out_features, module.in_features))
        # Experts kept in the checkpoint's MXFP4 (gpt-oss; DeepSeek-V4's FP4), else what --quant's backend makes.
        module.set_quantized(planned_mxfp4(shape) if isinstance(module, Mxfp4Linear) else backend.planned(shape))
    widths = [_token_width(layer, skeleton.model.config) for layer in skeleton.units.values()]
    model = add_trainables(cfg, skeleton, precision, new_blocks)
    category = _categories(model)
    group = shards * sequence
    by_index = {}
    for index in sorted({rank % group for rank in range(world)}):
        shard_plan = ShardPlan(
            units=tuple(skeleton.units.values()), mixed_precision=precision.mixed_precision is not None,
            shards=group, index=index, **unit_options(cfg, path),
        )  # fmt: skip
        by_index[index] = planned_parameter_bytes(model, shard_plan, version=cfg.fsdp.fsdp_version)
    ratio = optimizer_state_ratio(cfg.optim, precision.param_dtype)
    activations = activation_bytes(cfg, model, widths, compute_dtype=precision.compute_dtype)
    ranks = []
    for rank in range(world):
        held = by_index[rank % group]
        out = RankPlan(activations=activations)
        for param, nbytes in held.items():
            setattr(out, category[param], getattr(out, category[param]) + nbytes)
        out.replicated_state = sum(
            t.numel() for m in model.modules() if isinstance(m, QuantizedLinear) and not m.state_as_parameters
            for t in m.state_bytes().values()
        )  # fmt: skip
        out.buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        out.gradients = out.adapters
        out.optimizer = int(out.adapters * ratio)
        out.gathered = _gathered(cfg, model, skeleton.units.values(), held)
        ranks.append(out)
    settings = [
        f"{world} ranks ({options.nnodes} node(s) x {options.nproc_per_node}); FSDP{cfg.fsdp.fsdp_version} "
        f"{cfg.fsdp.sharding_strategy}: {group} rank(s) share each parameter, {replicas} replica(s)",
        _quant_line(cfg) + (f"; {layout.describe()}" if layout is not None else "") + _kept_line(skeleton.model),
        f"--train_type {cfg.lora.train_type} --lora_rank {cfg.lora.lora_rank} --lora_target_modules "
        f"{cfg.lora.lora_target_modules}; --precision {cfg.fsdp.precision}; --optimizer {cfg.optim.optimizer} "
        f"(state {ratio:g} x the adapters' bytes, measured on torch's optimizer)",
        f"--batch_size {cfg.data.batch_size} --context_length {cfg.data.context_length} --gradient_checkpointing "
        f"{str(cfg.fsdp.gradient_checkpointing).lower()} --loss_chunk_tokens {cfg.compute.loss_chunk_tokens}"
        + (" --cpu_offload true" if cfg.fsdp.cpu_offload else ""),
    ]
    return Plan(cfg.model.model, world, ranks, settings, cfg.fsdp.cpu_offload, options.gpu_memory_gib)


def _quant_line(cfg: TrainConfig) -> str:
    quant = cfg.quant
    if quant.quant == "bnb":
        return f"--quant bnb ({quant.bnb_quant_type}, double quantization {str(quant.bnb_double_quant).lower()})"
    if quant.quant == "hqq":
        return f"--quant hqq ({quant.hqq_bits} bits, groups of {quant.hqq_group_size})"
    return "--quant none"


def _kept_line(model: nn.Module) -> str:
    """Where the checkpoint's own MXFP4 experts are kept (gpt-oss's, DeepSeek-V4's FP4 ones), how many layers."""
    kept = sum(isinstance(m, Mxfp4Linear) for m in model.modules())
    return f"; routed experts kept as the checkpoint's MXFP4 ({kept} layers, --mxfp4 keep)" if kept else ""


def _categories(model: nn.Module) -> dict[nn.Parameter, str]:
    """Each parameter's row of RESIDENT_ROWS: packed bytes, quantization state, adapters or other frozen."""
    out = {p: "adapters" if p.requires_grad else "frozen" for p in model.parameters()}
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            out[module.weight] = "packed"
            for name in module.layouts:
                tensor = getattr(module, name)
                if isinstance(tensor, nn.Parameter):
                    out[tensor] = "state"
    return out


def optimizer_state_ratio(cfg: OptimConfig, dtype: torch.dtype) -> float:
    """Bytes of optimizer state per byte of trainable parameter (AdamW: 2, in the parameter's dtype), as torch's own
    optimizer keeps it after a step on a small parameter; its scalar step counts are left out."""
    param = nn.Parameter(torch.zeros(64, dtype=dtype))
    param.grad = torch.ones_like(param)
    optimizer = build_optimizer([param], cfg)
    optimizer.step()
    state = optimizer.state[param].values()
    kept = sum(t.numel() * t.element_size() for t in state if isinstance(t, torch.Tensor) and t.dim())
    return kept / (param.numel() * param.element_size())


def _token_width(layer: nn.Module, config: object) -> int:
    """Values a token keeps for backward in one decoder layer (estimate): four of the hidden size (two norms, the
    attention output, the residual) and the output of every linear it passes through; of the routed experts, the
    `num_experts_per_tok` it is sent to."""
    width = 4 * config.hidden_size  # type: ignore[attr-defined]
    experts = [m for m in layer.modules() if isinstance(m, QuantizedExperts)]
    inside = {id(m) for e in experts for m in e.modules()}
    width += sum(m.out_features for m in layer.modules() if isinstance(m, nn.Linear) and id(m) not in inside)
    top_k = getattr(config, "num_experts_per_tok", 0) or 0
    for block in experts:
        width += top_k * (block.gate_up[0].out_features + block.down[0].out_features)
    return width


def activation_bytes(cfg: TrainConfig, model: nn.Module, widths: list[int], *, compute_dtype: torch.dtype) -> int:
    """An estimate of one rank's activation memory at --batch_size x --context_length tokens (its share with
    sequence parallelism), in the compute dtype: with gradient checkpointing each decoder layer's input plus one
    layer recomputed in backward, else every layer's saved values (`_token_width`); each adapter's dropped-out input
    while --lora_dropout > 0; the fp32 logits of one loss chunk and their gradient; the largest weight dequantized."""
    tokens = cfg.data.batch_size * -(-cfg.data.context_length // cfg.dist.sequence_parallel_size)
    size = torch.empty((), dtype=compute_dtype).element_size()
    config = model.config  # type: ignore[attr-defined]
    dropout = sum(m.in_features for m in peft_lora_layers(model)) if cfg.lora.lora_dropout > 0 else 0
    per_layer_dropout = dropout // max(len(widths), 1)
    if cfg.fsdp.gradient_checkpointing:
        layers = len(widths) * config.hidden_size + max(widths, default=0) + per_layer_dropout
    else:
        layers = sum(widths) + dropout
    chunk = min(cfg.compute.loss_chunk_tokens or tokens, tokens)
    logits = chunk * config.vocab_size * 4 * 2
    dequantized = max(
        (m.out_features * m.in_features for m in model.modules() if isinstance(m, QuantizedLinear)), default=0
    )
    return tokens * layers * size + logits + dequantized * size


def _gathered(cfg: TrainConfig, model: nn.Module, layers: object, held: dict[nn.Parameter, int]) -> int:
    """Estimate: what a rank holds beyond its shards while units compute: two decoder layers (one computing, one
    prefetched; every layer when forward does not reshard, shard_grad_op) and the root, which stays gathered from
    forward to backward. With --cpu_offload the shards are in host memory, so the whole gathered units count."""
    if cfg.fsdp.sharding_strategy == "no_shard":
        return 0
    offload = cfg.fsdp.cpu_offload
    inside: set[int] = set()
    extra = []
    for layer in layers:  # type: ignore[attr-defined]
        params = list(layer.parameters())
        inside |= {id(p) for p in params}
        extra.append(sum(p.numel() * p.element_size() - (0 if offload else held[p]) for p in params))
    root = sum(p.numel() * p.element_size() - (0 if offload else held[p]) for p in model.parameters()
               if id(p) not in inside)  # fmt: skip
    keep = len(extra) if cfg.fsdp.sharding_strategy in ("shard_grad_op", "hybrid_shard_zero2") else 2
    return root + sum(sorted(extra, reverse=True)[:keep])


def render(plan: Plan, *, command: str = "") -> str:
    """The plan as a table, one column per rank (the first eight), in GiB (MiB for a model under 1 GiB a rank),
    then the exact parameter bytes per rank and the verdict."""
    shown = plan.ranks[:8]
    unit, scale = ("GiB", GIB) if max(plan.on_gpu(r) for r in plan.ranks) >= GIB else ("MiB", 1 << 20)
    head = f"{unit:44}" + "".join(f"{'rank ' + str(i):>11}" for i in range(len(shown)))
    lines = [f"PLANNED, not measured: {plan.model} on {plan.world_size} rank(s)", *(f"  {s}" for s in plan.settings)]
    if command:
        lines.insert(1, f"  command: {command}")
    lines += ["", head]

    def row(label: str, values: list[int]) -> None:
        lines.append(f"{label:44}" + "".join(f"{v / scale:>11.2f}" for v in values))

    for attr, label in RESIDENT_ROWS:
        row(label, [getattr(r, attr) for r in shown])
    row("= parameter bytes per rank (as training logs)", [r.parameter_bytes for r in shown])
    if any(r.replicated_state for r in shown):
        row("quantization state replicated (FSDP1)", [r.replicated_state for r in shown])
    row("buffers", [r.buffers for r in shown])
    row("adapter gradients", [r.gradients for r in shown])
    row("optimizer state", [r.optimizer for r in shown])
    row("gathered units (estimate)", [r.gathered for r in shown])
    row("activations (estimate)", [r.activations for r in shown])
    offload = " (params in host memory)" if plan.offloaded else ""
    row(f"= on each GPU{offload}", [plan.on_gpu(r) for r in shown])
    if len(plan.ranks) > len(shown):
        hidden = f"ranks {len(shown)}-{len(plan.ranks) - 1}"
        lines.append(f"({hidden} not shown: their parameter bytes are below, and the verdict counts them)")
    lines.append(f"parameter bytes per rank: {[r.parameter_bytes for r in plan.ranks]}")
    if plan.gpu_memory_gib:
        worst = max(plan.on_gpu(r) for r in plan.ranks) / GIB
        left = plan.gpu_memory_gib - worst
        verdict = "fits" if left >= 0 else "does not fit"
        lines.append(
            f"{verdict}: the fullest rank needs {worst:.2f} GiB of {plan.gpu_memory_gib:g} GiB "
            f"({'headroom' if left >= 0 else 'short by'} {abs(left):.2f} GiB), before the CUDA context, allocator "
            "fragmentation and NCCL buffers"
        )
    return "\n".join(lines)
