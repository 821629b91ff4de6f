"""The training loss, computed inside the FSDP root: the output head runs over chunks of label tokens.

Full logits are batch x sequence x vocabulary floats, and their gradient as many again: 8 GB each at 8 x 2048 tokens
on a 128k vocabulary, more than an 8B model's 4-bit weights. Here only positions that have a label go through the
head, a chunk of `chunk_tokens` at a time, and each chunk's logits are freed before the next is made, so peak memory
grows with the chunk, not with the batch.

A plain linear head (frozen in QLoRA, trained in full fine-tuning, tied to the embedding or not) takes
`_LinearHeadLoss`: each chunk's gradients are computed in forward, while its logits exist, so backward has nothing
to recompute and the FLOPs equal today's. Any other head (a LoRA on it) takes checkpointed chunks: autograd
recomputes each chunk's logits in backward. That works for a LoRA's own parameters under both FSDP versions, but
not for a parameter of FSDP1's root flat parameter, whose gradient a recompute inside the root loses (measured:
zero head gradient under full fine-tuning), which is why the plain head never takes that path.

The loss lives in the module FSDP wraps as its root, so the head's (and tied embedding's) parameters are gathered
while it runs, under both FSDP versions.
"""

from __future__ import annotations

import contextlib
import enum
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from qlora_fsdp.compat import kv_cache_argument
from qlora_fsdp.data import IGNORE_INDEX, target_mask
from qlora_fsdp.errors import UserError
from qlora_fsdp.model.lora import adapters_off
from qlora_fsdp.model.vision import hidden_states_model

LM_PREFIX = "lm."
"""What the root's state dict puts before the wrapped model's names."""
# Config attributes of architectures whose logits are not just head(hidden) (Gemma-2's soft-capping, Cohere's and
# Granite's scaling): their own forward computes the logits, whole.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


class Reduction(enum.Enum):
    """How the label positions' cross-entropies add up."""

    SUM = "sum"
    """One sum over the batch (fp32 scalar), which the caller divides by the step's label tokens."""
    ROWS = "rows"
    """Each row's sum [rows]: a sequence's negative log-likelihood (the preference objectives)."""
    TOKENS = "tokens"
    """Each label position's [rows, labels' width - 1], 0 where there is no label (GRPO's per-token ratios)."""


@dataclass(frozen=True)
class LossRequest:
    """What one forward of CausalLMLoss computes from its inputs; the default is the training loss."""

    reduction: Reduction = Reduction.SUM
    adapters: bool = True
    """False: the adapters are off for the forward (the reference model of DPO, KTO and GRPO's KL: the same weights
    in the same FSDP units)."""
    temperature: float = 1.0
    """Divides the logits (GRPO's sampling temperature)."""


SUMMED = LossRequest()
"""The training loss: one sum over the label tokens, through the adapters."""
PER_ROW = LossRequest(Reduction.ROWS)
"""Each row's sum, through the adapters (the preference objectives' log-probs)."""
PER_TOKEN = LossRequest(Reduction.TOKENS)
"""Each label position's, through the adapters (ORPO's log-probs and cross-entropy from one forward)."""


class CausalLMLoss(nn.Module):
    """Wraps a causal LM (a PeftModel or a transformers model) as what FSDP shards as its root.

    Returns the fp32 sum of the next-token cross-entropy over label tokens (labels align with input_ids and are
    shifted here; IGNORE_INDEX marks positions without one; labels one longer than input_ids give the last
    position a target too, as a sequence-parallel slice's do); the caller divides by the label-token count of the
    whole step, over every rank. A LossRequest asks for other sums (each row's, each position's), for the forward
    with the adapters off, or for a temperature.
    """

    def __init__(self, lm: nn.Module, *, chunk_tokens: int, router: RouterLoss | None = None) -> None:
        super().__init__()
        self.lm = lm
        self.chunk_tokens = chunk_tokens
        # A VLM's logit transforms are its text config's (Aya Vision's logit_scale, Gemma 3n's soft-capping).
        text_config = lm.config.get_text_config()
        transformed = any(getattr(text_config, a, None) not in (None, 1.0) for a in LOGIT_TRANSFORMS)
        self.chunked = chunk_tokens > 0 and not transformed
        self.router = router
        self.cache_argument = kv_cache_argument(lm)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
        request: LossRequest = SUMMED,
        cache: Any = None,
        **images: torch.Tensor,
    ) -> torch.Tensor:
        """`request`: which sums of the cross-entropy, with or without the adapters, at which temperature. `cache`: a
        transformers KV cache to decode with (qlora_fsdp.objectives.sampling): the next token's fp32 logits [rows,
        vocabulary] instead of a loss, through this root so FSDP gathers what it holds. `token_mask`: which positions
        are tokens rather than padding, where `attention_mask` is not given (packed rows); only the router's loss reads
        it. `images`: an image-text model's image inputs (pixel_values, ...)."""
        if cache is not None:
            out = self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=True, logits_to_keep=1, **{self.cache_argument: cache})  # fmt: skip
            return out.logits[:, -1].float().clone()  # a view would lose FSDP2's output hooks
        if labels is None:
            raise ValueError("labels are required unless decoding with a cache")
        with contextlib.nullcontext() if request.adapters else adapters_off(self.lm):
            return self._loss(input_ids, labels, attention_mask, position_ids, token_mask, request=request, **images)

    def _loss(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        token_mask: torch.Tensor | None,
        *,
        request: LossRequest,
        **images: torch.Tensor,
    ) -> torch.Tensor:
        inputs: dict[str, Any] = dict(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **images
        )
        router = self.router if self.training and torch.is_grad_enabled() else None
        if router is not None:
            inputs["output_router_logits"] = True
        head = self.lm.get_output_embeddings()
        # Per-token losses from the chunked head need its gradients in backward: a plain head that trains (full
        # fine-tuning) takes whole logits instead.
        # FSDP1's flat parameters leave the head without parameters of its own: its attributes are what it trains.
        trained_head = type(head) is nn.Linear and any(
            p is not None and p.requires_grad for p in (head.weight, head.bias)
        )
        reduction, temperature = request.reduction, request.temperature
        # A bias-free linear head's logits / t are its logits of the states / t; any other head divides whole logits.
        scalable = temperature == 1.0 or (type(head) is nn.Linear and getattr(head, "bias", None) is None)
        if not self.chunked or (reduction is not Reduction.SUM and trained_head) or not scalable:
            out = self.lm(**inputs)
            logits = out.logits if temperature == 1.0 else out.logits / temperature
            loss = full_loss_sum(logits, labels, reduction=reduction)
        else:
            out = hidden_states_model(self.lm)(**inputs)
            states = out.last_hidden_state if temperature == 1.0 else out.last_hidden_state / temperature
            loss = chunked_loss_sum(states, head, labels, chunk_tokens=self.chunk_tokens, reduction=reduction)
        if router is not None:
            mask = attention_mask if attention_mask is not None else token_mask
            loss = loss + router(out.router_logits, mask, labels)
        return loss


def full_loss_sum(logits: torch.Tensor, labels: torch.Tensor, *, reduction: Reduction = Reduction.SUM) -> torch.Tensor:
    """Summed next-token cross-entropy from whole logits (fp32), the reference the chunked loss must equal."""
    predicting = logits[:, : labels.shape[1] - 1]  # all positions where labels run one past (a sequence slice)
    losses = F.cross_entropy(
        predicting.flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )
    if reduction is Reduction.TOKENS:
        return losses.view(labels.shape[0], -1).clone()  # FSDP2 warns of a view output (its hooks could miss it)
    return losses.view(labels.shape[0], -1).sum(1) if reduction is Reduction.ROWS else losses.sum()


def chunked_loss_sum(
    hidden: torch.Tensor,
    head: nn.Module,
    labels: torch.Tensor,
    *,
    chunk_tokens: int,
    reduction: Reduction = Reduction.SUM,
) -> torch.Tensor:
    """Summed next-token cross-entropy of `head(hidden)` without materialising more than one chunk of logits (for
    rows' or positions' sums, the head must be frozen, or not a plain linear)."""
    apart = reduction is not Reduction.SUM  # each token's loss, which rows' and positions' sums are made of
    targets = labels[:, 1:].flatten()
    keep = targets != IGNORE_INDEX
    states = hidden[:, : labels.shape[1] - 1].flatten(0, 1)[keep]  # only labelled positions reach the head
    targets = targets[keep]
    if type(head) is nn.Linear:
        losses = _LinearHeadLoss.apply(states, head.weight, head.bias, targets, chunk_tokens, apart)
    else:
        parts = [
            checkpoint(_chunk_loss, head, states[start : start + chunk_tokens], targets[start : start + chunk_tokens],
                       "none" if apart else "sum", use_reentrant=False)
            for start in range(0, states.shape[0], chunk_tokens)
        ]  # fmt: skip
        empty = states.new_zeros((0,) if apart else (), dtype=torch.float32)
        losses = torch.cat([empty, *parts]) if apart else sum(parts, empty)
        losses = losses + 0.0 * states.sum()  # no label token here: backward must still reach every layer (FSDP)
    if not apart:
        return losses
    # Each row's sum by a dense scatter (deterministic on CUDA, unlike index_add's atomics).
    rows = labels.shape[0]
    dense = losses.new_zeros(rows, keep.shape[0] // rows).masked_scatter(keep.view(rows, -1), losses)
    return dense if reduction is Reduction.TOKENS else dense.sum(1)


def _chunk_loss(head: nn.Module, states: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    return F.cross_entropy(head(states).float(), targets, reduction=reduction)


class _LinearHeadLoss(torch.autograd.Function):
    """sum(logsumexp(z) - z[target]) over chunks of z = states @ W.T + b, with its gradients made in forward.

    With g = softmax(z) - onehot(target) for a chunk, d/d(states) = g @ W, d/dW = g.T @ states and d/db = sum(g):
    computed while z exists, kept at the size of the states (and of W and b, when the head trains), so backward only
    scales them. The gradients of W and b reach FSDP through their own autograd edges, as from an nn.Linear.
    `per_token`: each token's term instead of the sum, whose gradients backward scales token by token; W and b
    must then be frozen (their gradient would need each token's scale while z exists).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        states: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk_tokens: int,
        per_token: bool = False,
    ) -> torch.Tensor:
        if per_token and any(ctx.needs_input_grad[1:3]):
            raise RuntimeError("per-token head losses need a frozen head; train it with whole logits")

        def buffer(like: torch.Tensor | None, needed: bool) -> torch.Tensor | None:
            return (
                torch.zeros(like.shape, dtype=torch.float32, device=like.device)
                if needed and like is not None
                else None
            )

        grad_states, grad_weight, grad_bias = (
            buffer(t, needed) for t, needed in zip((states, weight, bias), ctx.needs_input_grad[:3], strict=True)
        )
        losses = torch.zeros(states.shape[0] if per_token else (), dtype=torch.float32, device=states.device)
        for start in range(0, states.shape[0], chunk_tokens):
            chunk = slice(start, start + chunk_tokens)
            low = F.linear(states[chunk], weight, bias)  # the head's own dtype (or autocast's), as the model computes
            compute_dtype = low.dtype
            logits = low.float()
            del low  # the chunk's one buffer from here on is the fp32 `logits`, rewritten in place below
            target = targets[chunk]
            target_logit = logits.gather(1, target[:, None]).squeeze(1)
            peak = logits.amax(dim=-1, keepdim=True)
            probs = logits.sub_(peak).exp_()
            sums = probs.sum(dim=-1, keepdim=True)
            token_losses = (peak + sums.log()).squeeze(1) - target_logit  # logsumexp(z) - z[target]
            if per_token:
                losses[chunk] = token_losses
            else:
                losses += token_losses.sum()
            if grad_states is None and grad_weight is None and grad_bias is None:
                continue
            probs.div_(sums)  # softmax
            probs[torch.arange(probs.shape[0], device=probs.device), target] -= 1.0
            grad = probs.to(compute_dtype)
            if grad_states is not None:
                grad_states[chunk] = grad @ weight.to(compute_dtype)
            if grad_weight is not None:
                grad_weight += (grad.T @ states[chunk].to(compute_dtype)).float()
            if grad_bias is not None:
                grad_bias += probs.sum(0)
            del logits, probs, grad
        ctx.save_for_backward(grad_states, grad_weight, grad_bias)
        ctx.dtypes = (states.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.per_token = per_token
        return losses

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        scale = grad_output[:, None] if ctx.per_token else grad_output
        grads = (
            None if g is None else (g * scale).to(dtype) for g, dtype in zip(ctx.saved_tensors, ctx.dtypes, strict=True)
        )
        return (*grads, None, None, None)


class RouterLoss:
    """A mixture-of-experts model's load-balancing loss, by transformers' own function for the architecture.

    Each micro-batch adds `coef x aux x its label tokens` to the loss sum, which the caller divides by the step's
    label tokens over every rank, as the cross-entropy: the step's auxiliary loss is the label-token-weighted mean of
    the micro-batches' own. Training only: evaluation reports the cross-entropy alone. `take()` hands the trainer
    what the step's log needs: the weighted sum of aux and the tokens each layer routed to each expert.
    """

    def __init__(self, function: Callable[..., torch.Tensor], *, num_experts: int, top_k: int, coef: float) -> None:
        self.function, self.num_experts, self.top_k, self.coef = function, num_experts, top_k, coef
        self._aux: torch.Tensor | None = None
        self._load: torch.Tensor | None = None
        self.gather: Callable[[torch.Tensor], torch.Tensor] | None = None
        """With sequence parallelism: the group's tokens (slices of the same rows) gathered along the first axis,
        so the loss is the whole rows', as one rank computes it (autograd: each slice gets its gradient)."""

    def __call__(
        self, router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor | None, labels: torch.Tensor
    ) -> torch.Tensor:
        mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
        if self.gather is None:
            aux = self.function(router_logits, self.num_experts, self.top_k, mask)
        else:  # each slice a row of the gathered batch: the function's token mean is over the whole rows
            whole = None if mask is None else self.gather(mask)
            aux = self.function(tuple(self.gather(t) for t in router_logits), self.num_experts, self.top_k, whole)
        weight = target_mask(labels).sum()
        with torch.no_grad():
            counts = []
            for logits in router_logits:
                chosen = logits.topk(self.top_k, dim=-1).indices
                if mask is not None:
                    chosen = chosen[mask.reshape(-1).bool()]  # padding routes nothing
                counts.append(torch.bincount(chosen.flatten(), minlength=self.num_experts))
            load = torch.stack(counts).double()
            self._load = load if self._load is None else self._load + load
            weighted = aux.detach().double() * weight
            self._aux = weighted if self._aux is None else self._aux + weighted
        return self.coef * aux * weight

    def take(self, device: torch.device) -> torch.Tensor:
        """[weighted aux sum, tokens per (layer, expert)...] since the last take, for one all-reduce."""
        aux = self._aux if self._aux is not None else torch.zeros((), dtype=torch.float64, device=device)
        load = self._load if self._load is not None else torch.zeros(1, dtype=torch.float64, device=device)
        self._aux = self._load = None
        return torch.cat([aux.reshape(1), load.flatten()]).to(device)


def router_loss(lm: nn.Module, coef: float | None) -> RouterLoss | None:
    """The load-balancing loss `lm` asks for (its config's `output_router_logits`, at `router_aux_loss_coef`) or
    `coef` sets (0: none); None for a model without routed experts."""
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    function = getattr(sys.modules[type(base).__module__], "load_balancing_loss_func", None)
    if function is None or not hasattr(base, "num_experts_per_tok"):
        if coef:
            raise UserError(
                f"--router_aux_loss_coef {coef}: {type(base).__name__} has no load-balancing loss in transformers; "
                "drop the flag"
            )
        return None
    config = base.config
    if coef is None:
        coef = config.router_aux_loss_coef if getattr(config, "output_router_logits", False) else 0.0
    if not coef:
        return None
    return RouterLoss(function, num_experts=base.num_experts, top_k=base.num_experts_per_tok, coef=coef)
