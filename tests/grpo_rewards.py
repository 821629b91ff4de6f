"""Reward functions the GRPO tests name by file (`--reward_funcs tests/grpo_rewards.py:NAME`)."""

from __future__ import annotations

from typing import Any


def token_sum(completions: list[Any], completion_ids: list[list[int]], **_: Any) -> list[float]:
    """Varies from completion to completion of a random model, so advantages are not 0."""
    return [float(sum(ids) % 97) / 97 for ids in completion_ids]


def topic_length(completions: list[str], topic: list[str], **_: Any) -> list[float | None]:
    """Reads the rows' own `topic` column (passed as TRL passes it); None (not scored) where the topic's length is
    a multiple of 3."""
    pairs = zip(topic, completions, strict=True)
    return [None if len(a) % 3 == 0 else float(len(a) % 5) + len(c) / 100 for a, c in pairs]


def raises(completions: list[Any], **_: Any) -> list[float]:
    raise RuntimeError("the grader is down")


def too_few(completions: list[Any], **_: Any) -> list[float]:
    return [1.0] * (len(completions) - 1)
