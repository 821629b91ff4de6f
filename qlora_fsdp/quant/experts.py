"""Routed experts of a mixture-of-experts layer, held as one 2-D weight per expert and projection.

transformers 5 keeps a layer's routed experts as two fused 3-D parameters (`gate_up_proj` [experts, 2 x
intermediate, hidden] and `down_proj` [experts, hidden, intermediate]). Quantizing libraries work on 2-D weights, so
each expert's matrices become their own layer here: a backend's quantized linear (or a plain frozen linear without
quantization), filled from the fused tensors transformers' checkpoint conversion makes. The router stays the model's
own module, in full precision.

The forward computes what transformers' eager experts forward computes (the same routing, top-k weights and sum),
expert by expert in ascending order, and dequantizes only the experts that received a token. Every expert's layer is
called on every step, with no rows where it received none, so units FSDP1 makes of them gather in the same order
on every rank whatever the routing.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from qlora_fsdp.compat import EXPERTS_FLAG_DEFAULTS, default_experts_gating, experts_flags
from qlora_fsdp.errors import UserError
from qlora_fsdp.quant.base import QuantizedLinear

FUSED = {"gate_up_proj": "gate_up", "down_proj": "down"}
"""transformers' fused parameter -> the ModuleList of per-expert layers that holds it here."""
SUPPORTED = (
    "transformers' fused experts with concatenated gate_up_proj [experts, 2*intermediate, hidden] and down_proj "
    "[experts, hidden, intermediate], no bias, the default gating (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2)"
)


def has_fused_experts(module: nn.Module) -> bool:
    """Routed experts held as 3-D parameters of one module (transformers' experts classes, in whatever layout):
    a module with 3-D parameters of its own and an expert count (a Conv1d's 3-D weight is not one)."""
    return hasattr(module, "num_experts") and any(p.dim() == 3 for p in module.parameters(recurse=False))


def fused_order(module: nn.Module) -> list[str]:
    """A routed-experts module's fused parameter names in transformers' order, which decides how PEFT nests its
    wrappers (QuantizedExperts keeps its source's); empty for any other module."""
    if isinstance(module, QuantizedExperts):
        return module.fused_order
    return [n for n, _ in module.named_parameters(recurse=False)] if has_fused_experts(module) else []


def peft_wrapper_depth(order: list[str], targeted: list[str], name: str) -> int:
    """How many of PEFT's `target_parameters` wrappers lie inside the one adapting `name`: PEFT wraps the module's
    targeted parameters in `order`, each wrapper around the previous, so the first is innermost."""
    chosen = [n for n in order if n in targeted]
    return len(chosen) - 1 - chosen.index(name)


def layout_problem(module: nn.Module) -> str | None:
    """Why `module`'s fused experts cannot be split into per-expert layers here, or None when they can."""
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False)}
    if set(shapes) != set(FUSED):
        return f"parameters {sorted(shapes)}"
    # transformers' default layout (concatenated gate and up, not transposed, no bias, no norm) is the one split here.
    flags = experts_flags(module)  # a flag this transformers does not set has its default meaning
    wrong = [f"{k}={v}" for k, v in flags.items() if v is not EXPERTS_FLAG_DEFAULTS[k]]
    if wrong:
        return ", ".join(wrong)
    if not default_experts_gating(module) or not hasattr(module, "act_fn"):
        return "its own gating function"
    experts, two_inter, hidden = shapes["gate_up_proj"]
    if shapes["down_proj"] != (experts, hidden, two_inter // 2) or two_inter % 2:
        return f"gate_up_proj {shapes['gate_up_proj']} with down_proj {shapes['down_proj']}"
    return None


class ExpertAdapter(nn.Module):
    """LoRA on one fused projection of every expert, in PEFT's `target_parameters` layout, so the saved adapter is
    what PEFT builds on the transformers model: `A` [rank x experts, in] holds expert e's rows e*rank..(e+1)*rank,
    `B` [out, rank x experts] its columns e, e + experts, ... . Dropout is not applied: PEFT's parameter adapters
    have none, so the adapter trains as PEFT runs it."""

    def __init__(self, *, experts: int, in_features: int, out_features: int, rank: int, scaling: float) -> None:
        super().__init__()
        self.experts, self.rank, self.scaling = experts, rank, scaling
        self.A = nn.Parameter(torch.empty(rank * experts, in_features, device="meta"))
        self.B = nn.Parameter(torch.empty(out_features, rank * experts, device="meta"))
        self.peft_prefix = ""
        """What PEFT puts between the experts module's name and `lora_A`: `base_layer.` per wrapper inside."""
        self.enabled = True
        """Off while the model stands for its own reference (lora.adapters_off), as PEFT's disabled adapters."""

    def reset(self, generator: torch.Generator) -> None:
        """PEFT's initialisation: A Kaiming-uniform over the whole [rank x experts, in] matrix, B zero."""
        values = torch.empty(self.A.shape, dtype=torch.float32)
        nn.init.kaiming_uniform_(values, a=math.sqrt(5), generator=generator)
        self.A.data.copy_(values)
        self.B.data.zero_()

    def forward(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """The adapters' output for rows grouped by expert (`sizes[e]` rows of expert e, in order)."""
        outs = []
        for e, part in enumerate(x.split(sizes)):
            a = self.A[e * self.rank : (e + 1) * self.rank]
            b = self.B[:, e :: self.experts]
            outs.append((part.to(a.dtype) @ a.t()) @ b.t() * self.scaling)
        return torch.cat(outs)


class QuantizedExperts(nn.Module):
    """A layer's routed experts as `gate_up[e]` and `down[e]` layers (see the module docstring)."""

    def __init__(self, experts: nn.Module, make_linear: Callable[[nn.Linear], nn.Linear]) -> None:
        super().__init__()
        count, two_inter, hidden = experts.gate_up_proj.shape
        dtype = experts.gate_up_proj.dtype
        self.num_experts = count
        self.act_fn = experts.act_fn
        self.fused_order = fused_order(experts)
        """transformers' parameter order, which decides how PEFT nests its wrappers (the first innermost)."""

        def layers(in_features: int, out_features: int) -> nn.ModuleList:
            frozen = [
                make_linear(nn.Linear(in_features, out_features, bias=False, device="meta", dtype=dtype))
                for _ in range(count)
            ]
            for layer in frozen:
                layer.requires_grad_(False)
            return nn.ModuleList(frozen)

        self.gate_up = layers(hidden, two_inter)
        self.down = layers(two_inter // 2, hidden)
        self.gate_up_adapter: ExpertAdapter | None = None
        self.down_adapter: ExpertAdapter | None = None

    def add_adapters(self, *, rank: int, alpha: float) -> list[ExpertAdapter]:
        """Per-expert LoRA on both projections (meta until their layer is loaded); returns them."""
        scaling = alpha / rank
        made = []
        for fused, attr in FUSED.items():
            first = getattr(self, attr)[0]
            adapter = ExpertAdapter(
                experts=self.num_experts,
                in_features=first.in_features,
                out_features=first.out_features,
                rank=rank,
                scaling=scaling,
            )
            adapter.peft_prefix = "base_layer." * peft_wrapper_depth(self.fused_order, list(FUSED), fused)
            setattr(self, f"{attr}_adapter", adapter)
            made.append(adapter)
        return made

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        # Index num_experts marks a slot routed nowhere (transformers' sentinel): sorted last and cut off.
        sizes = torch.bincount(flat, minlength=self.num_experts + 1)[: self.num_experts]
        sizes_list = sizes.tolist()
        order = torch.argsort(flat, stable=True)[: sum(sizes_list)]
        token = order // k
        x = hidden_states[token]
        h = torch.cat([layer(part) for layer, part in zip(self.gate_up, x.split(sizes_list), strict=True)])
        if self.gate_up_adapter is not None and self.gate_up_adapter.enabled:
            h = h + self.gate_up_adapter(x, sizes_list).to(h.dtype)
        gate, up = h.chunk(2, dim=-1)
        h = self.act_fn(gate) * up
        out = torch.cat([layer(part) for layer, part in zip(self.down, h.split(sizes_list), strict=True)])
        if self.down_adapter is not None and self.down_adapter.enabled:
            out = out + self.down_adapter(h, sizes_list).to(out.dtype)
        out = out * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add_(0, token, out.to(hidden_states.dtype))


def replace_experts(model: nn.Module, make_linear: Callable[[nn.Linear], nn.Linear]) -> list[str]:
    """Swap every fused-experts module for a QuantizedExperts; returns their names. Raises UserError, before any
    weight is read, for a module with 3-D parameters in a layout this cannot split."""
    swapped = []
    for name, module in list(model.named_modules()):
        if not has_fused_experts(module):
            continue
        problem = layout_problem(module)
        if problem is not None:
            raise UserError(
                f"--model: {type(module).__name__} ({name}) holds its experts as {problem}, which cannot be "
                f"quantized per expert; supported: {SUPPORTED}"
            )
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, QuantizedExperts(module, make_linear))
        swapped.append(name)
    return swapped


def expert_adapters(module: nn.Module) -> list[ExpertAdapter]:
    return [m for m in module.modules() if isinstance(m, ExpertAdapter)]


def router_gates(model: nn.Module) -> set[str]:
    """The linears that route or gate tokens beside routed experts: never quantized or adapted, so the model routes
    as it was trained to. A dense model has none.

    Found by what they are, not by their class: a linear child of the module that holds the routed experts which
    either computes more than its projection (a subclass with its own forward, as PhiMoE's router, which returns
    logits, weights and expert indices: PEFT's LoRA cannot wrap it) or is named as a gate (Qwen2-MoE's plain
    `shared_expert_gate`). A plain linear beside the experts that projects (NemotronH's latent projections, say)
    stays an ordinary layer. Routers that are not linears (Mixtral's, DeepSeek-V2's) are never touched anyway."""
    gates = set()
    for name, module in model.named_modules():
        if any(has_fused_experts(m) or isinstance(m, QuantizedExperts) for m in module.children()):
            prefix = f"{name}." if name else ""
            gates |= {prefix + n for n, m in module.named_children() if routes(n, m)}
    return gates


def routes(name: str, module: nn.Module) -> bool:
    """Whether `module`, a child named `name` of the module holding the routed experts, is a router or gate."""
    return isinstance(module, nn.Linear) and (not is_projection(module) or name.endswith("gate"))


def is_projection(module: nn.Module) -> bool:
    """A linear whose forward is the projection alone (nn.Linear's own, or a quantized one's), which is what PEFT's
    LoRA wraps; a subclass with a forward of its own may return anything (PhiMoE's router: a tuple)."""
    return isinstance(module, QuantizedLinear) or (
        isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward
    )
