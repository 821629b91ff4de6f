"""Sampling completions from the model being trained, through its FSDP root, with a KV cache (GRPO's rollouts).

Every forward of a sharded model is a collective: each rank gathers each unit's weights, so every rank must run as many
forwards as the others. Ranks therefore decode in lockstep: a rank whose completions have all ended keeps decoding
padding until every rank's have (or --max_completion_length is reached), which one all-reduce per token decides. With
the weights gathered beforehand (--generation_mode gathered), a forward runs no collective, so `lockstep=False` lets
each rank stop when its own rows have ended. Prompts are padded on the left and their positions count from each prompt's
first token, so a row decodes as it would alone. Each row draws its tokens with a generator of its own, seeded by the
caller (GRPO: from the run's seed, the step, the prompt and the completion's number), so a completion is the same
whichever rank and batch it is sampled in, and a resumed run samples what the uninterrupted one did without storing any
generator state. Tokens are drawn at `temperature` from the smallest set of tokens whose probability reaches `top_p`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Sampled:
    """The completions of a batch of prompts."""

    completions: list[list[int]]
    """Each row's tokens, up to and including its first end token."""
    logps: list[list[float]]
    """Each token's log-probability under the distribution it was drawn from (after temperature, before top-p)."""
    entropies: list[list[float]]
    """The entropy of that distribution at each token."""
    truncated: list[bool]
    """Rows that reached the length limit without an end token."""


@dataclass(frozen=True)
class SamplingParams:
    """What decides the completions drawn for given prompts and seeds, as transformers' GenerationConfig names it;
    how the model runs (device, autocast, lockstep) is the caller's."""

    max_new_tokens: int
    """Tokens drawn at most per completion (GRPO's --max_completion_length)."""
    end_ids: frozenset[int]
    """Tokens that end a completion (kept as its last)."""
    pad_id: int
    """Fills the prompts' left and the ended rows' further tokens."""
    temperature: float = 1.0
    """Divides the logits before drawing."""
    top_p: float = 1.0
    """Draws from the smallest set of most likely tokens whose probability reaches it (1: from all)."""


@torch.no_grad()
def sample(
    model: nn.Module,
    prompts: list[list[int]],
    *,
    params: SamplingParams,
    seeds: list[int],
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    lockstep: bool = True,
) -> Sampled:
    """Completions of `prompts` from `model` (a CausalLMLoss root, wrapped by FSDP or not), in eval mode (no
    dropout; transformers turns the cache off under gradient checkpointing in training mode), row i drawn with
    `seeds[i]`."""
    from transformers import DynamicCache

    pad_id, end_ids = params.pad_id, params.end_ids
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    ends = torch.tensor(sorted(end_ids), device=device)
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    tokens, logps, entropies = [], [], []
    cache = DynamicCache()
    was_training = model.training
    model.eval()
    try:
        with autocast():
            logits = model(ids, attention_mask=mask, position_ids=positions, cache=cache)
        for _ in range(params.max_new_tokens):
            log_probs = torch.log_softmax(logits / params.temperature, dim=-1)
            uniform = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])
            token = _draw(log_probs, params.top_p, uniform.to(device))
            token = torch.where(done, pad_id, token)
            tokens.append(token)
            logps.append(log_probs.gather(1, token[:, None]).squeeze(1))
            entropies.append(torch.special.entr(log_probs.exp()).sum(-1))
            done |= torch.isin(token, ends)
            if _all_done(done, lockstep):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
            with autocast():
                logits = model(token[:, None], attention_mask=mask, position_ids=positions, cache=cache)
    finally:
        model.train(was_training)
    per_token = [torch.stack(values, 1).tolist() for values in (logps, entropies)]
    return _rows(torch.stack(tokens, 1).tolist(), *per_token, end_ids=end_ids)


def _draw(log_probs: torch.Tensor, top_p: float, uniform: torch.Tensor) -> torch.Tensor:
    """Each row's token by inverting its distribution's CDF at the row's uniform draw."""
    probs = log_probs.double().exp()
    if top_p < 1.0:
        ordered, order = probs.sort(dim=-1, descending=True)
        before = ordered.cumsum(-1) - ordered  # the mass of the tokens more likely than each
        ordered = ordered.masked_fill(before >= top_p, 0.0)  # the most likely token always stays
        probs = torch.zeros_like(probs).scatter_(1, order, ordered)
    cdf = probs.cumsum(-1)
    token = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None]).squeeze(1)
    return token.clamp(max=probs.shape[1] - 1)


def _all_done(done: torch.Tensor, lockstep: bool) -> bool:
    """Whether every row has ended: on every rank in lockstep (a collective: every rank calls it once per token),
    else on this one."""
    left = (~done).sum().reshape(1)
    if lockstep and dist.is_initialized():
        dist.all_reduce(left)
    return bool(left.item() == 0)


def _rows(tokens: list[list[int]], logps: list[list[float]], entropies: list[list[float]], *,
          end_ids: frozenset[int]) -> Sampled:  # fmt: skip
    completions, truncated = [], []
    for row in tokens:
        stop = next((i + 1 for i, token in enumerate(row) if token in end_ids), None)
        completions.append(row[:stop])
        truncated.append(stop is None)
    cut = [[values[: len(c)] for values, c in zip(table, completions, strict=True)] for table in (logps, entropies)]
    return Sampled(completions, logps=cut[0], entropies=cut[1], truncated=truncated)
