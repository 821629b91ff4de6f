"""Routed experts of a mixture-of-experts layer, held as one 2-D weight per expert and projection.

transformers 5 keeps a layer's routed experts as two fused 3-D parameters, `gate_up_proj` and `down_proj`, in one
of a few layouts (ExpertsLayout): [experts, out, in] or transposed [experts, in, out], gate and up concatenated or
interleaved, with or without per-expert biases. Quantizing libraries work on 2-D weights, so each expert's matrices
become their own layer here: a backend's quantized linear (or a plain frozen linear without quantization), filled
from the fused tensors transformers' checkpoint conversion makes. The router stays the model's own module, in full
precision.

The forward computes what transformers' eager experts forward computes (the same routing, top-k weights, the
module's own gating and sum), expert by expert in ascending order, and dequantizes only the experts that received a
token. Every expert's layer is called on every step, with no rows where it received none, so units FSDP1 makes of
them gather in the same order on every rank whatever the routing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qlora_fsdp.compat import EXPERTS_FLAG_DEFAULTS, default_experts_gating, experts_flags
from qlora_fsdp.errors import UserError
from qlora_fsdp.quant.base import QuantizedLinear

FUSED = {"gate_up_proj": "gate_up", "down_proj": "down"}
"""transformers' fused parameter -> the ModuleList of per-expert layers that holds it here."""
BIAS = "_bias"
"""A fused projection's per-expert biases are `<projection>_bias` [experts, out]."""
SUPPORTED = (
    "transformers' fused experts gate_up_proj and down_proj, [experts, out, in] or transposed, with or without "
    "biases, gated by the module's own gating (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, gpt-oss), and Llama 4's"
)


@dataclass(frozen=True)
class ExpertsLayout:
    """How a fused-experts module of transformers holds and is called with its experts."""

    transposed: bool = False
    """Fused weights are [experts, in, out] (the input multiplies them: x @ W) rather than [experts, out, in]."""
    bias: bool = False
    """Each projection has per-expert biases."""
    routed: bool = True
    """Called with (hidden states, top-k expert indices, top-k weights). False: Llama 4's convention, each expert
    given every token, already scaled by its routing weight (zero where the token is not routed to it)."""
    peft_reversed: bool = False
    """PEFT reads the fused weights as [experts, out, in] although they are [experts, in, out] (a module without
    transformers' layout flags): its lora_B then acts on the input side and lora_A on the output side."""


UNFLAGGED = {"Llama4TextExperts": ExpertsLayout(transposed=True, routed=False, peft_reversed=True)}
"""Experts classes transformers does not flag with their layout, by class name: what their forward computes
(act_fn(gate) * up over the concatenated projection)."""


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


def experts_layout(module: nn.Module) -> ExpertsLayout | str:
    """`module`'s layout, or why its fused experts cannot be split into per-expert layers here."""
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False)}
    layout = UNFLAGGED.get(type(module).__name__)
    if layout is None:
        flags = experts_flags(module)  # a flag this transformers does not set has its default meaning
        kept = ("has_gate", "has_post_expert_norm")
        wrong = [f"{k}={flags[k]}" for k in kept if flags[k] is not EXPERTS_FLAG_DEFAULTS[k]]
        if wrong:
            return ", ".join(wrong)
        # The gating is the module's own `_apply_gate`, which knows whether gate and up are interleaved.
        if getattr(type(module), "_apply_gate", None) is None or (
            default_experts_gating(module) and not (flags["is_concatenated"] and hasattr(module, "act_fn"))
        ):
            return "its own gating function"
        layout = ExpertsLayout(transposed=flags["is_transposed"], bias=flags["has_bias"])
    names = set(FUSED) | ({f + BIAS for f in FUSED} if layout.bias else set())
    if set(shapes) != names:
        return f"parameters {sorted(shapes)}"
    (experts, *gate_up), (_, *down) = shapes["gate_up_proj"], shapes["down_proj"]
    if layout.transposed:
        gate_up, down = gate_up[::-1], down[::-1]
    if down != [gate_up[1], gate_up[0] // 2] or gate_up[0] % 2 or shapes["down_proj"][0] != experts:
        return f"gate_up_proj {shapes['gate_up_proj']} with down_proj {shapes['down_proj']}"
    return layout


class ExpertAdapter(nn.Module):
    """LoRA on one fused projection of every expert, in PEFT's `target_parameters` layout, so the saved adapter is
    what PEFT builds on the transformers model: `A` [rank x experts, a] holds expert e's rows e*rank..(e+1)*rank,
    `B` [b, rank x experts] its columns e, e + experts, ... . Expert e's delta is B_e @ A_e as [out, in] (a = in,
    b = out), or, `reversed`, as [in, out] (a = out, b = in: PEFT's reading of a transposed module without layout
    flags). Dropout is not applied: PEFT's parameter adapters have none, so the adapter trains as PEFT runs it."""

    def __init__(
        self, *, experts: int, in_features: int, out_features: int, rank: int, scaling: float, reversed: bool = False
    ) -> None:
        super().__init__()
        self.experts, self.rank, self.scaling, self.reversed = experts, rank, scaling, reversed
        a, b = (out_features, in_features) if reversed else (in_features, out_features)
        self.A = nn.Parameter(torch.empty(rank * experts, a, device="meta"))
        self.B = nn.Parameter(torch.empty(b, rank * experts, device="meta"))
        self.peft_prefix = ""
        """What PEFT puts between the experts module's name and `lora_A`: `base_layer.` per wrapper inside."""
        self.enabled = True
        """Off while the model stands for its own reference (lora.adapters_off), as PEFT's disabled adapters."""

    def reset(self, generator: torch.Generator) -> None:
        """PEFT's initialisation: A Kaiming-uniform over the whole [rank x experts, a] matrix, B zero."""
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
            part = part.to(a.dtype)
            outs.append(((part @ b) @ a if self.reversed else (part @ a.t()) @ b.t()) * self.scaling)
        return torch.cat(outs)


class QuantizedExperts(nn.Module):
    """A layer's routed experts as `gate_up[e]` and `down[e]` layers (see the module docstring)."""

    def __init__(
        self, experts: nn.Module, make_linear: Callable[[nn.Linear], nn.Linear], layout: ExpertsLayout
    ) -> None:
        super().__init__()
        count = experts.gate_up_proj.shape[0]
        dtype = experts.gate_up_proj.dtype
        self.num_experts = count
        self.layout = layout
        self.act_fn = getattr(experts, "act_fn", None)
        # The module's own gating, bound to the module (kept out of this one's children: it holds only meta
        # tensors and the gating's constants, gpt-oss's clamp limit and alpha).
        self._gate = getattr(experts, "_apply_gate", None)
        self.fused_order = fused_order(experts)
        """transformers' parameter order, which decides how PEFT nests its wrappers (the first innermost)."""

        def layers(fused: str) -> nn.ModuleList:
            _, out_features, in_features = getattr(experts, fused).shape
            if layout.transposed:
                in_features, out_features = out_features, in_features
            frozen = [
                make_linear(nn.Linear(in_features, out_features, bias=layout.bias, device="meta", dtype=dtype))
                for _ in range(count)
            ]
            for layer in frozen:
                layer.requires_grad_(False)
            return nn.ModuleList(frozen)

        self.gate_up = layers("gate_up_proj")
        self.down = layers("down_proj")
        self.gate_up_adapter: ExpertAdapter | None = None
        self.down_adapter: ExpertAdapter | None = None

    def peft_shape(self, fused: str) -> tuple[int, int, int]:
        """(experts, out, in) of a fused projection as PEFT reads it (its adapter's A is [rank x experts, in]):
        the per-expert linears' (out, in), reversed where PEFT misreads a transposed layout."""
        first = getattr(self, FUSED[fused])[0]
        if self.layout.peft_reversed:
            return self.num_experts, first.in_features, first.out_features
        return self.num_experts, first.out_features, first.in_features

    def fused_names(self) -> list[str]:
        """The checkpoint's (after conversion) fused tensors this module is filled from."""
        return [*FUSED, *(f + BIAS for f in FUSED if self.layout.bias)]

    def part_names(self, fused: str) -> list[str]:
        """The per-expert parameters (relative to this module) that the fused tensor `fused` fills."""
        attr, kind = (FUSED[fused.removesuffix(BIAS)], "bias") if fused.endswith(BIAS) else (FUSED[fused], "weight")
        return [f"{attr}.{e}.{kind}" for e in range(self.num_experts)]

    def split(self, fused: str, tensor: torch.Tensor | list) -> dict[str, Any]:
        """The fused tensor `fused` as its per-expert parameters: weights as [out, in], biases as they are; a list
        is already one part per expert in that layout (a checkpoint format's own, kept packed)."""
        parts = tensor if isinstance(tensor, list) else tensor.unbind(0)
        if isinstance(tensor, torch.Tensor) and self.layout.transposed and not fused.endswith(BIAS):
            parts = tuple(p.t().contiguous() for p in parts)
        return dict(zip(self.part_names(fused), parts, strict=True))

    def fused(self, fused: str) -> torch.Tensor:
        """A fused tensor in transformers' layout, from the per-expert layers (dequantized where quantized)."""
        if fused.endswith(BIAS):
            return torch.stack([m.bias.detach() for m in getattr(self, FUSED[fused.removesuffix(BIAS)])])
        layers = getattr(self, FUSED[fused])
        weight = torch.stack([m.dequantize() if isinstance(m, QuantizedLinear) else m.weight.detach() for m in layers])
        return weight.transpose(1, 2) if self.layout.transposed else weight

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
                reversed=self.layout.peft_reversed,
            )
            adapter.peft_prefix = "base_layer." * peft_wrapper_depth(self.fused_order, list(FUSED), fused)
            setattr(self, f"{attr}_adapter", adapter)
            made.append(adapter)
        return made

    def gate(self, h: torch.Tensor) -> torch.Tensor:
        """The module's own gating of the gate_up projection's output (act_fn(gate) * up where it has none)."""
        if self._gate is not None:
            return self._gate(h)
        gate, up = h.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def experts(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Rows grouped by expert (`sizes[e]` rows of expert e, in order) through their experts."""
        h = torch.cat([layer(part) for layer, part in zip(self.gate_up, x.split(sizes), strict=True)])
        if self.gate_up_adapter is not None and self.gate_up_adapter.enabled:
            h = h + self.gate_up_adapter(x, sizes).to(h.dtype)
        h = self.gate(h)
        out = torch.cat([layer(part) for layer, part in zip(self.down, h.split(sizes), strict=True)])
        if self.down_adapter is not None and self.down_adapter.enabled:
            out = out + self.down_adapter(h, sizes).to(out.dtype)
        return out

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor | None = None,
        top_k_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not self.layout.routed:
            return self._forward_scaled(hidden_states)
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        # Index num_experts marks a slot routed nowhere (transformers' sentinel): sorted last and cut off.
        sizes = torch.bincount(flat, minlength=self.num_experts + 1)[: self.num_experts]
        sizes_list = sizes.tolist()
        order = torch.argsort(flat, stable=True)[: sum(sizes_list)]
        token = order // k
        out = self.experts(hidden_states[token], sizes_list) * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add_(0, token, out.to(hidden_states.dtype))

    def _forward_scaled(self, routed_in: torch.Tensor) -> torch.Tensor:
        """Llama 4's call: every expert's copy of every token, already scaled by its routing weight. A row scaled
        to zero gives exactly zero (no bias, act_fn(0) * 0), so only the routed rows are computed."""
        flat = routed_in.view(-1, routed_in.shape[-1])
        rows = flat.ne(0).any(dim=-1).nonzero().squeeze(1)
        tokens = flat.shape[0] // self.num_experts
        sizes = torch.bincount(rows // tokens, minlength=self.num_experts).tolist()
        out = torch.zeros_like(flat)
        return out.index_copy_(0, rows, self.experts(flat[rows], sizes).to(flat.dtype))


def replace_experts(model: nn.Module, make_linear: Callable[[nn.Linear], nn.Linear]) -> list[str]:
    """Swap every fused-experts module for a QuantizedExperts; returns their names. Raises UserError, before any
    weight is read, for a module with 3-D parameters in a layout this cannot split."""
    swapped = []
    for name, module in list(model.named_modules()):
        if not has_fused_experts(module):
            continue
        layout = experts_layout(module)
        if isinstance(layout, str):
            raise UserError(
                f"--model: {type(module).__name__} ({name}) holds its experts as {layout}, which cannot be "
                f"quantized per expert; supported: {SUPPORTED}"
            )
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, QuantizedExperts(module, make_linear, layout))
        swapped.append(name)
    return swapped


def expert_adapters(module: nn.Module) -> list[ExpertAdapter]:
    return [m for m in module.modules() if isinstance(m, ExpertAdapter)]


def router_gates(model: nn.Module) -> set[str]:
    """The linears that route or gate tokens beside routed experts: never quantized or adapted, so the model routes
    as it was trained to. A dense model has none.

    Found by what they are and where they sit, not by their class: a linear child of the module that holds the
    routed experts which either computes more than its projection (a subclass with its own forward, as PhiMoE's
    router, which returns logits, weights and expert indices: PEFT's LoRA cannot wrap it) or is named as a gate
    (Qwen2-MoE's plain `shared_expert_gate`); and every linear inside a router module beside the experts, one named
    or classed as a gate or router (AFMoE's `router.gate`, Hunyuan-MoE's `gate.wg`). A plain linear beside the
    experts that projects (NemotronH's latent projections, say) stays an ordinary layer. Routers that hold their
    weight as a parameter of their own (Mixtral's, DeepSeek-V2's) have no linear to find."""
    gates = set()
    for name, module in model.named_modules():
        if any(has_fused_experts(m) or isinstance(m, QuantizedExperts) for m in module.children()):
            prefix = f"{name}." if name else ""
            for child_name, child in module.named_children():
                if routes(child_name, child):
                    gates.add(prefix + child_name)
                elif not isinstance(child, nn.Linear) and is_router_module(child_name, child):
                    inner = (n for n, m in child.named_modules() if n and isinstance(m, nn.Linear))
                    gates |= {f"{prefix}{child_name}.{n}" for n in inner}
    return gates


def is_router_module(name: str, module: nn.Module) -> bool:
    """Whether a module beside the routed experts, named `name`, is their router (by its name or its class)."""
    return name.endswith(("gate", "router")) or type(module).__name__.endswith(("Gate", "Router"))


def routes(name: str, module: nn.Module) -> bool:
    """Whether `module`, a child named `name` of the module holding the routed experts, is a router or gate."""
    return isinstance(module, nn.Linear) and (not is_projection(module) or name.endswith("gate"))


def is_projection(module: nn.Module) -> bool:
    """A linear whose forward is the projection alone (nn.Linear's own, or a quantized one's), which is what PEFT's
    LoRA wraps; a subclass with a forward of its own may return anything (PhiMoE's router: a tuple)."""
    return isinstance(module, QuantizedLinear) or (
        isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward
    )
