"""Tiled MLP (--tiled_mlp): each decoder layer's MLP runs over tiles of its tokens, one tile at a time.

At long context a layer's peak is its MLP's intermediate activations: tokens x intermediate size, several times,
where attention's (flash or sdpa's fused kernels) stay near tokens x hidden. An MLP treats every token on its own,
so running it over tiles of the token axis and concatenating gives the same output. Each tile is a non-reentrant
checkpoint: forward keeps only the tile's input, and backward recomputes one tile's intermediates at a time. The
layer's peak then holds one tile's intermediates, at the cost of one more MLP forward per step (the same trade as
Snowflake's ALST and Unsloth's tiled MLP). Nested inside --gradient_checkpointing's layer checkpoint, the layer's
recompute tiles again.

A mixture-of-experts block is not tiled whole: its router's logits feed the load-balancing loss over the whole
sequence (transformers records them per call). Its routed experts are, over the tokens they receive together with
each token's chosen experts and weights, and so is a shared expert.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from qlora_fsdp.errors import UserError

MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe")
"""What transformers' decoder layers call their MLP (or mixture-of-experts block)."""
SHARED_EXPERT_NAMES = ("shared_expert", "shared_experts")


def tile_count(setting: str, tokens: int, hidden: int) -> int:
    """Tiles for `tokens` tokens of width `hidden`: the setting's number, or with `auto` one tile per `hidden`
    tokens (ALST's rule: a tile's intermediates then weigh about as much as the layer's hidden states)."""
    if setting == "auto":
        return max(1, math.ceil(tokens / hidden))
    return int(setting)


def tiled_modules(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of decoder layer `layer` that --tiled_mlp tiles, by name within it: its MLP, or a
    mixture-of-experts block's experts and shared expert."""
    name = next((n for n in MLP_NAMES if isinstance(getattr(layer, n, None), nn.Module)), None)
    if name is None:
        raise UserError(
            f"--tiled_mlp: {type(layer).__name__} has no MLP under any of the names {', '.join(MLP_NAMES)}; "
            "drop --tiled_mlp for this architecture"
        )
    mlp = getattr(layer, name)
    experts = getattr(mlp, "experts", None)
    if not isinstance(experts, nn.Module):
        return [(name, mlp)]
    shared = [s for s in SHARED_EXPERT_NAMES if isinstance(getattr(mlp, s, None), nn.Module)]
    return [(f"{name}.experts", experts), *((f"{name}.{s}", getattr(mlp, s)) for s in shared)]


def tile_mlps(units: dict[str, nn.Module], setting: str) -> list[str]:
    """Make the MLPs of the decoder layers `units` (by qualified name) run over tiles of tokens, as `setting`
    (a number of tiles, or `auto`) says; returns the qualified names of the tiled modules."""
    tiled = []
    for unit_name, layer in units.items():
        for name, module in tiled_modules(layer):
            # The instance's own forward: the module keeps its name, parameters and state-dict keys.
            module.forward = functools.partial(_tiled_forward, module.forward, setting)
            tiled.append(f"{unit_name}.{name}")
    return tiled


def _tiled_forward(forward: Callable[..., torch.Tensor], setting: str, *args: Any, **kwargs: Any) -> torch.Tensor:
    """`forward` over tiles of the token axis (the one before the last of its first argument), concatenated.

    Every tensor argument with that many entries on that axis is split with it (an experts module's chosen
    experts and weights); the others go to every tile whole."""
    first = args[0]
    axis = first.dim() - 2
    tokens = first.shape[axis]
    tiles = min(tile_count(setting, tokens, first.shape[-1]), tokens)
    if tiles <= 1:
        return forward(*args, **kwargs)

    def split(value: Any) -> list[Any]:
        if isinstance(value, torch.Tensor) and value.dim() == first.dim() and value.shape[axis] == tokens:
            return list(value.tensor_split(tiles, dim=axis))
        return [value] * tiles

    arg_tiles = [split(a) for a in args]
    kwarg_tiles = {k: split(v) for k, v in kwargs.items()}
    outputs = []
    for i in range(tiles):
        tile_args = [parts[i] for parts in arg_tiles]
        tile_kwargs = {k: parts[i] for k, parts in kwarg_tiles.items()}
        if torch.is_grad_enabled():
            out = checkpoint(forward, *tile_args, use_reentrant=False, **tile_kwargs)
        else:
            out = forward(*tile_args, **tile_kwargs)
        if not isinstance(out, torch.Tensor):
            raise UserError(
                f"--tiled_mlp: {getattr(forward, '__qualname__', forward)} returns {type(out).__name__}, not a "
                "tensor, so its tiles cannot be joined; drop --tiled_mlp for this architecture"
            )
        outputs.append(out)
    return torch.cat(outputs, dim=axis)
