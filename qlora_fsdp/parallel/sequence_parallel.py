"""Ulysses sequence parallelism (--sequence_parallel_size S): S consecutive ranks split every row along the sequence.

- **Rows.** The ranks of a group read the same rows. `split_rows` pads a batch to a multiple of S and gives each
  rank one contiguous slice of every row. Its labels run one position past its inputs, so the slice's last position
  predicts the next slice's first token: the loss sees a slice as a row whose every position has its target.
- **Attention.** Everything but attention works per token. `SequenceParallel.attention`, registered in
  transformers' attention interface, turns the slices of queries, keys and values into the whole sequence on H/S
  heads with one all-to-all, attends with the implementation the model would have used (sdpa, eager, flash), and
  turns the output back into the rank's slice on all heads with a second all-to-all. Both all-to-alls are
  autograd functions, so backward sends the gradients the same way back. Every architecture that attends through
  that interface gets it.
- **Positions** stay global: each slice carries its positions in the whole row (a packed row's per-sample ones), so
  rotary embeddings are those of one rank, and the attention mask (causal; per sample for packed rows) is built
  from the whole row's positions, which every rank of the group has.
- **Keys and values** with fewer heads than S are repeated so that each rank gets the one its query heads use.
- **Sums over a row** (the preference objectives' log-probabilities) are added up over the group, autograd
  included, so every rank of a group sees whole rows' sums: the objective's parts and weights (pairs) then count
  S times over the job, which their ratio cancels.

FSDP shards over all ranks, as Snowflake's ALST does: the sequence-parallel groups only add all-to-alls, and every
rank's gradient is the gradient of its slices' share of the loss, which FSDP's reduction adds up like data
parallelism's. `--sharding_strategy hybrid_shard` composes unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from qlora_fsdp.data import IGNORE_INDEX, target_mask
from qlora_fsdp.errors import UserError
from qlora_fsdp.parallel.distributed import DistEnv

ATTENTION = "qlora_ulysses"
"""The name the attention function is registered under in transformers' attention and mask interfaces."""
POSITIONS = "sequence_positions"
"""The batch key of the whole rows' positions, which each rank's slice keeps for the attention mask."""
ROW_LABEL_TOKENS = "row_label_tokens"
"""The batch key of each whole row's label tokens (the preference objectives' reply lengths)."""


def check_heads(config: Any, size: int) -> None:
    """Refuse, before any weight is read, a model whose heads cannot be split over `size` ranks."""
    if size == 1:
        return
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    name = type(config).__name__.removesuffix("Config")
    if heads is None or heads % size:
        raise UserError(
            f"--sequence_parallel_size {size}: {name} has {heads} attention heads, which do not split over {size} "
            "ranks; use a size that divides them"
        )
    if kv_heads % size and size % kv_heads:
        raise UserError(
            f"--sequence_parallel_size {size}: {name} has {kv_heads} key-value heads, which neither split over "
            f"{size} ranks nor repeat to {size}; use a size that divides them or that they divide"
        )


def split_rows(batch: dict[str, torch.Tensor], *, size: int, index: int) -> dict[str, torch.Tensor]:
    """Slice `index` of `size` of every row of a collated batch (rows.collate), padded to a multiple of `size`.

    input_ids, attention_mask and position_ids keep the slice's positions; labels keep one more, the next slice's
    first label (IGNORE_INDEX after the last slice). POSITIONS holds the whole rows' positions and ROW_LABEL_TOKENS
    their label tokens; other keys (pair_index) are per row and stay whole."""
    rows, width = batch["input_ids"].shape
    extra = -(-width // size) * size - width
    pad = torch.nn.functional.pad
    if "position_ids" in batch:  # packed: the padding continues the rows' padding segment, or starts one at 0
        last = batch["position_ids"][:, -1:]
        tail = torch.where(batch["attention_mask"][:, -1:] == 0, last + 1, torch.zeros_like(last))
        positions = torch.cat([batch["position_ids"], tail + torch.arange(extra)], dim=1)
    else:
        positions = torch.arange(width + extra).expand(rows, width + extra)
    labels = pad(batch["labels"], (0, extra + 1), value=IGNORE_INDEX)
    n = (width + extra) // size
    start, end = index * n, (index + 1) * n
    out = {key: value for key, value in batch.items() if key not in ("input_ids", "attention_mask", "labels")}
    return out | {
        "input_ids": pad(batch["input_ids"], (0, extra))[:, start:end],
        "attention_mask": pad(batch["attention_mask"], (0, extra))[:, start:end],
        "labels": labels[:, start : end + 1],
        "position_ids": positions[:, start:end].contiguous(),
        POSITIONS: positions,
        ROW_LABEL_TOKENS: target_mask(batch["labels"]).sum(1),
    }


@dataclass
class SequenceParallel:
    """This rank's sequence-parallel group and the batch its attention is computing."""

    size: int
    index: int
    group: dist.ProcessGroup
    inner: str = "sdpa"
    """The attention implementation the model would use without sequence parallelism."""
    _positions: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.long))
    _masks: dict[tuple[torch.dtype, bool], torch.Tensor | None] = field(default_factory=dict)

    def begin(self, batch: dict[str, torch.Tensor], device: torch.device) -> None:
        """Record the batch whose slices the next forward (and its recompute in backward) attends over. It stays
        until the next batch begins; the mask is built once, for every layer."""
        self._positions = batch[POSITIONS].to(device)
        self._masks = {}

    def mask(self, dtype: torch.dtype, additive: bool) -> torch.Tensor | None:
        """The whole rows' attention mask: None where every row is one sample (causal: padding follows every real
        token, so no real query sees it), else causal within each sample, as booleans or (`additive`) as 0 and the
        dtype's minimum."""
        if (dtype, additive) not in self._masks:
            positions = self._positions
            segment = (positions == 0).cumsum(1)
            if bool((segment[:, -1] == 1).all()):
                self._masks[dtype, additive] = None
            else:
                length = positions.shape[1]
                causal = torch.ones(length, length, dtype=torch.bool, device=positions.device).tril()
                allowed = ((segment[:, :, None] == segment[:, None, :]) & causal)[:, None]
                if additive:
                    allowed = torch.zeros(allowed.shape, dtype=dtype, device=positions.device).masked_fill(
                        ~allowed, torch.finfo(dtype).min
                    )
                self._masks[dtype, additive] = allowed
        return self._masks[dtype, additive]

    def row_sums(self, sums: torch.Tensor) -> torch.Tensor:
        """Per-row sums of this rank's slices added up over the group (autograd: each slice gets the whole row's
        gradient)."""
        return _AllReduce.apply(sums, self.group)

    def gather_tokens(self, t: torch.Tensor) -> torch.Tensor:
        """The group's `t` concatenated along the first axis in group order (autograd: backward adds up each
        rank's gradient of the result and hands every rank its part)."""
        return _AllGather.apply(t, self.group)

    def attention(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """The attention function transformers calls (query, key, value: batch x heads x slice x head size):
        whole-sequence attention on H/S heads between two all-to-alls; returns batch x slice x heads x size."""
        kv_heads = key.shape[1]
        if kv_heads < self.size:
            repeat = self.size // kv_heads
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        q, k, v = (self._to_heads(t) for t in (query, key, value))
        local = _LocalHeads(module, q.shape[1] // k.shape[1])
        kwargs.pop("position_ids", None)
        if "flash" in self.inner:  # packed rows: flash attention finds the samples from the positions
            out, _ = self._inner(module)(local, q, k, v, None, position_ids=self._positions, **kwargs)
        else:
            mask = self.mask(q.dtype, additive=self.inner == "eager")
            out, _ = self._inner(module)(local, q, k, v, mask, **kwargs)
        return self._to_slices(out), None

    def _inner(self, module: nn.Module) -> Callable[..., tuple[torch.Tensor, Any]]:
        """The attention function the model would call: registered by name, or its own module's eager one."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if self.inner == "eager":
            return sys.modules[type(module).__module__].eager_attention_forward
        return ALL_ATTENTION_FUNCTIONS[self.inner]

    def _to_heads(self, t: torch.Tensor) -> torch.Tensor:
        """batch x H x n x d slices -> batch x H/S x S*n x d: the whole sequence on this rank's heads."""
        b, h, n, d = t.shape
        chunks = t.reshape(b, self.size, h // self.size, n, d).transpose(0, 1).contiguous()
        out = _AllToAll.apply(chunks, self.group)
        return out.permute(1, 2, 0, 3, 4).reshape(b, h // self.size, self.size * n, d)

    def _to_slices(self, t: torch.Tensor) -> torch.Tensor:
        """batch x S*n x H/S x d (attention's output) -> batch x n x H x d: this rank's slice on every head."""
        b, length, h, d = t.shape
        n = length // self.size
        chunks = t.reshape(b, self.size, n, h, d).transpose(0, 1).contiguous()
        out = _AllToAll.apply(chunks, self.group)
        return out.permute(1, 2, 0, 3, 4).reshape(b, n, self.size * h, d)


# The group's collectives as autograd functions. torch's own (torch.distributed.nn.functional) are deprecated since
# 2.13 in favour of the private _functional_collectives, so these few lines are ours: each backward is the forward's
# transpose (all-to-all: the same exchange back; sum: the sum of the gradients; gather: each rank's part of the sum).


class _AllToAll(torch.autograd.Function):
    """Chunk i of the first axis goes to rank i of the group; chunk i of the result came from rank i."""

    @staticmethod
    def forward(ctx: Any, chunks: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        out = torch.empty_like(chunks)
        dist.all_to_all_single(out, chunks, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return _AllToAll.apply(grad.contiguous(), ctx.group), None


class _AllReduce(torch.autograd.Function):
    """The group's sum."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return _AllReduce.apply(grad, ctx.group), None


class _AllGather(torch.autograd.Function):
    """The group's tensors concatenated along the first axis, in group order."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.rows = group, t.shape[0]
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        index = dist.get_rank(ctx.group)
        return total[index * ctx.rows : (index + 1) * ctx.rows], None


class _LocalHeads:
    """The attention module as the inner implementation must see it after the all-to-all: this rank's query heads
    per key-value head, where the module's own count is the model's."""

    def __init__(self, module: nn.Module, groups: int) -> None:
        self._module = module
        self.num_key_value_groups = groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def sequence_groups(env: DistEnv) -> SequenceParallel | None:
    """This rank's group of `env.sequence_parallel` consecutive ranks: the job mesh's sequence dim; None without
    sequence parallelism."""
    if env.sequence_parallel == 1:
        return None
    sequence = env.mesh.dims["sequence"]
    return SequenceParallel(size=sequence.size(), index=sequence.get_local_rank(), group=sequence.get_group())


def enable(model: nn.Module, sequence: SequenceParallel) -> None:
    """Route `model`'s attention through `sequence`, wrapping the implementation it was built with."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sequence.inner = model.config._attn_implementation
    ALL_ATTENTION_FUNCTIONS.register(ATTENTION, sequence.attention)
    # transformers builds masks for the slice's length; the attention builds the whole rows' own.
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, lambda *args, **kwargs: None)
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "_attn_implementation", None) == sequence.inner:
            config._attn_implementation = ATTENTION
