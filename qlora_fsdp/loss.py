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

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from qlora_fsdp.data import IGNORE_INDEX

LM_PREFIX = "lm."
"""What the root's state dict puts before the wrapped model's names."""
# Config attributes of architectures whose logits are not just head(hidden) (Gemma-2's soft-capping, Cohere's and
# Granite's scaling): their own forward computes the logits, whole.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


class CausalLMLoss(nn.Module):
    """Wraps a causal LM (a PeftModel or a transformers model) as what FSDP shards as its root.

    Called with labels it returns the fp32 sum of the next-token cross-entropy over label tokens (labels align with
    input_ids and are shifted here; IGNORE_INDEX marks positions without one); the caller divides by the label-token
    count of the whole step. Without labels it returns the logits (evaluation and tests).
    """

    def __init__(self, lm: nn.Module, *, chunk_tokens: int) -> None:
        super().__init__()
        self.lm = lm
        self.chunk_tokens = chunk_tokens
        transformed = any(getattr(lm.config, a, None) not in (None, 1.0) for a in LOGIT_TRANSFORMS)
        self.chunked = chunk_tokens > 0 and not transformed

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        inputs: dict[str, Any] = dict(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        if labels is None or not self.chunked:
            logits = self.lm(**inputs).logits
            return logits if labels is None else full_loss_sum(logits, labels)
        hidden = self.lm.get_decoder()(**inputs).last_hidden_state
        return chunked_loss_sum(hidden, self.lm.get_output_embeddings(), labels, chunk_tokens=self.chunk_tokens)


def full_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy from whole logits (fp32), the reference the chunked loss must equal."""
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def chunked_loss_sum(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, *, chunk_tokens: int) -> torch.Tensor:
    """Summed next-token cross-entropy of `head(hidden)` without materialising more than one chunk of logits."""
    targets = labels[:, 1:].flatten()
    keep = targets != IGNORE_INDEX
    states = hidden[:, :-1].flatten(0, 1)[keep]  # only labelled positions reach the head
    targets = targets[keep]
    if type(head) is nn.Linear:
        return _LinearHeadLoss.apply(states, head.weight, head.bias, targets, chunk_tokens)
    total = states.new_zeros((), dtype=torch.float32)
    for start in range(0, states.shape[0], chunk_tokens):
        chunk = slice(start, start + chunk_tokens)
        total = total + checkpoint(_chunk_loss, head, states[chunk], targets[chunk], use_reentrant=False)
    return total + 0.0 * states.sum()  # no label token here: backward must still reach every layer (FSDP)


def _chunk_loss(head: nn.Module, states: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(states).float(), targets, reduction="sum")


class _LinearHeadLoss(torch.autograd.Function):
    """sum(logsumexp(z) - z[target]) over chunks of z = states @ W.T + b, with its gradients made in forward.

    With g = softmax(z) - onehot(target) for a chunk, d/d(states) = g @ W, d/dW = g.T @ states and d/db = sum(g):
    computed while z exists, kept at the size of the states (and of W and b, when the head trains), so backward only
    scales them. The gradients of W and b reach FSDP through their own autograd edges, as from an nn.Linear.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        states: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk_tokens: int,
    ) -> torch.Tensor:
        def buffer(like: torch.Tensor | None, needed: bool) -> torch.Tensor | None:
            return (
                torch.zeros(like.shape, dtype=torch.float32, device=like.device)
                if needed and like is not None
                else None
            )

        grad_states, grad_weight, grad_bias = (
            buffer(t, needed) for t, needed in zip((states, weight, bias), ctx.needs_input_grad[:3], strict=True)
        )
        total = torch.zeros((), dtype=torch.float32, device=states.device)
        for start in range(0, states.shape[0], chunk_tokens):
            chunk = slice(start, start + chunk_tokens)
            low = F.linear(states[chunk], weight, bias)  # the head's own dtype (or autocast's), as the model computes
            logits = low.float()
            target = targets[chunk]
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, target[:, None]).squeeze(1)).sum()
            if grad_states is None and grad_weight is None and grad_bias is None:
                continue
            probs = logits.sub_(lse[:, None]).exp_()  # softmax, in place over the chunk's one fp32 buffer
            probs[torch.arange(probs.shape[0], device=probs.device), target] -= 1.0
            if grad_states is not None:
                grad_states[chunk] = probs.to(low.dtype) @ weight.to(low.dtype)
            if grad_weight is not None:
                grad_weight += (probs.to(low.dtype).T @ states[chunk].to(low.dtype)).float()
            if grad_bias is not None:
                grad_bias += probs.sum(0)
            del low, logits, probs
        ctx.save_for_backward(grad_states, grad_weight, grad_bias)
        ctx.dtypes = (states.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads = (
            None if g is None else (g * grad_output).to(dtype)
            for g, dtype in zip(ctx.saved_tensors, ctx.dtypes, strict=True)
        )
        return (*grads, None, None)
