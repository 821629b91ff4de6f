"""GRPO with its completions held fixed (`--objective tests/plugins/fixed_grpo.py:FIXED_GRPO`): GRPO's spec, settings,
rewards, advantages and loss, but each completion a function of its prompt's tokens and its number in the group
(`fixed_completions`), not drawn from the model. tests/distributed/test_grpo_run_parity.py gives TRL's GRPOTrainer
the same completions, so that whole runs of the two compare step by step."""

from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter

import torch
from torch import nn

from qlora_fsdp.objectives.grpo import GrpoObjective, GrpoRun
from qlora_fsdp.objectives.sampling import Sampled
from qlora_fsdp.objectives.specs import OBJECTIVES

PLAIN = range(3, 259)
"""Token ids every tiny tokenizer has and none of them special (0-2 are end, pad and bos; then the 256 bytes)."""


def fixed_completions(prompts: list[list[int]], *, max_length: int, end: int) -> list[list[int]]:
    """The completion of each prompt's k-th occurrence in `prompts` (its k-th completion: a group's prompts come in
    a row), drawn from a generator seeded by the prompt's tokens and k: about two in three end with `end` after 0 to
    `max_length` - 1 plain tokens, the others are `max_length` plain tokens (cut at the limit)."""
    seen: Counter[tuple[int, ...]] = Counter()
    out = []
    for prompt in prompts:
        key = tuple(prompt)
        k, seen[key] = seen[key], seen[key] + 1
        digest = hashlib.blake2b(f"{key}:{k}".encode(), digest_size=8).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
        ends = bool(torch.rand((), generator=g) < 2 / 3)
        length = int(torch.randint(1, max_length + 1, (), generator=g)) if ends else max_length
        body = torch.randint(PLAIN.start, PLAIN.stop, (length,), generator=g).tolist()
        out.append([*body[:-1], end] if ends else body)
    return out


class FixedGrpoObjective(GrpoObjective):
    """GRPO whose `draw` returns `fixed_completions` (sampling's log-probs and entropies 0: nothing is drawn)."""

    def draw(self, model: nn.Module, prompts: list[list[int]], *, seeds: list[int]) -> Sampled:
        r = self.rollout
        assert r is not None
        sampling = r.settings.sampling
        completions = fixed_completions(prompts, max_length=sampling.max_new_tokens, end=r.tokenizer.eos_token_id)
        zeros = [[0.0] * len(c) for c in completions]
        return Sampled(completions, logps=zeros, entropies=zeros,
                       truncated=[c[-1] not in sampling.end_ids for c in completions])  # fmt: skip


class FixedGrpoRun(GrpoRun):
    objective_class = FixedGrpoObjective


FIXED_GRPO = dataclasses.replace(OBJECTIVES["grpo"], name="fixed_grpo", run=FixedGrpoRun)
