"""Reward functions to start GRPO with (`--reward_funcs qlora_fsdp.reward_functions:NAME`), written as TRL's are:
fn(prompts, completions, **columns) -> one float per completion. A completion is its text, or for a conversational
prompt a list holding the assistant's message."""

from __future__ import annotations

from typing import Any


def completion_text(completion: Any) -> str:
    """A completion's text, whether the prompt was a string or a conversation."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def exclaims(completions: list[Any], **_: Any) -> list[float]:
    """1 for a completion that ends with "!", 0.5 for one with a "!" elsewhere, else 0: a format a model learns
    in a few dozen steps, with part credit for getting close."""
    texts = [completion_text(c).rstrip() for c in completions]
    return [1.0 if t.endswith("!") else 0.5 if "!" in t else 0.0 for t in texts]


def brief(completions: list[Any], **_: Any) -> list[float]:
    """1 for a completion of at most 10 words, falling to 0 at 30 or more: rewards a short reply."""
    return [min(1.0, max(0.0, (30 - len(completion_text(c).split())) / 20)) for c in completions]
