"""GRPO's prompts: TRL's prompt-only rows, tokenized as training frames a prompt, held in memory.

A row holds `prompt`, a string (framed by --prompt_style as a preference pair's prompt is; `chat`: a user turn) or
a message list (the chat template, with the assistant's header to generate after); every other field is passed to
the reward functions. A prompt is cut from the left (its BOS kept) to --max_prompt_length and to what
--max_completion_length leaves of --context_length. Prompt datasets are small next to the completions sampled from
them, so they are read whole on every rank rather than through the tokenized cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from qlora_fsdp.config.options import DataConfig
from qlora_fsdp.data.chat import Conversation, load_chat_template, parse_messages
from qlora_fsdp.data.formats import format_prompt, missing_prefix, special_prefix
from qlora_fsdp.data.loader import GlobalOrderSampler, RepeatedStepsSampler
from qlora_fsdp.data.sources import read_rows, source_names
from qlora_fsdp.errors import UserError
from qlora_fsdp.parallel.distributed import DistEnv

PROMPT_INDEX = "prompt_index"


@dataclass(frozen=True)
class Prompt:
    text: str | list[dict[str, Any]]
    """As the row holds it (what the reward functions receive as its prompt)."""
    ids: list[int]
    columns: dict[str, Any]
    """The row's other fields."""

    @property
    def conversational(self) -> bool:
        return isinstance(self.text, list)


class PromptRows(Dataset):
    """Prompt i as {"prompt_index": [i]}: a batch says which prompts to sample completions for."""

    def __init__(self, prompts: list[Prompt]) -> None:
        self.prompts = prompts

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return {PROMPT_INDEX: [index]}


def collate_prompts(items: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    return {PROMPT_INDEX: torch.tensor([item[PROMPT_INDEX][0] for item in items], dtype=torch.long)}


def load_prompts(dataset: str, tokenizer: Any, *, samples: int, prompt_style: str, max_length: int) -> list[Prompt]:
    """Every row of --dataset as a tokenized prompt of at most `max_length` tokens; a row without a prompt, or with
    a malformed one, is a UserError naming its file and row."""
    prefix = special_prefix(tokenizer)
    prompts = []
    for name in source_names(dataset):
        for where, row in read_rows(name, samples=samples):
            if not isinstance(row, dict) or row.get("prompt") is None:
                raise UserError(f"{where}: --objective grpo reads prompts: each row needs 'prompt' (a string or a "
                                "message list); its other fields go to the reward functions")  # fmt: skip
            text = row["prompt"]
            ids = tokenizer(_framed(text, tokenizer, prompt_style, where), add_special_tokens=False)["input_ids"]
            ids = [*missing_prefix(ids, prefix), *ids]
            head = len(prefix) if ids[: len(prefix)] == prefix else 0
            if len(ids) > max_length:
                ids = [*ids[:head], *ids[len(ids) - (max_length - head) :]]
            prompts.append(Prompt(text, ids, {k: v for k, v in row.items() if k != "prompt"}))
    if not prompts:
        raise UserError(f"--dataset {dataset}: no prompts")
    return prompts


def _framed(text: Any, tokenizer: Any, prompt_style: str, where: str) -> str:
    if isinstance(text, list):
        turns = parse_messages(text, f"{where} prompt")
        messages = Conversation(tuple(turns), where).as_dicts(parts=False)
    elif isinstance(text, str):
        if prompt_style != "chat":
            return format_prompt(text, prompt_style=prompt_style)
        messages = [{"role": "user", "content": text}]
    else:
        raise UserError(f"{where}: 'prompt' must be a string or a message list, got {type(text).__name__}")
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"{where}: a chat prompt needs a tokenizer with a chat template (or --chat_template FILE)")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def prompt_loader(data: DataConfig, tokenizer: Any, env: DistEnv, *, seed: int, accumulation: int,
                  num_generations: int, max_completion_length: int, num_iterations: int = 1) -> DataLoader:  # fmt: skip
    """This rank's loader of prompt batches: --batch_size / --num_generations prompts each (a rank samples whole
    groups), dealt from one shuffled order as the other objectives' rows are (GlobalOrderSampler), each step's prompts
    `num_iterations` times in a row (RepeatedStepsSampler)."""
    if data.batch_size % num_generations:
        raise UserError(f"--batch_size {data.batch_size} is not a multiple of --num_generations {num_generations}: "
                        "each rank samples whole groups of completions (TRL's rule, the batch a multiple of the "
                        "group, holds for every rank); change one of them")  # fmt: skip
    if data.chat_template:
        load_chat_template(tokenizer, data.chat_template)
    limit = data.context_length - max_completion_length
    prompts = load_prompts(data.dataset, tokenizer, samples=data.dataset_samples, prompt_style=data.prompt_style,
                           max_length=min(limit, data.max_prompt_length or limit))  # fmt: skip
    per_rank = data.batch_size // num_generations
    needed = env.data_world_size * per_rank * accumulation
    if len(prompts) < needed:
        raise UserError(f"--dataset {data.dataset} has {len(prompts)} prompts, fewer than the {needed} one step needs "
                        "(ranks x --batch_size / --num_generations x --gradient_accumulation_steps)")  # fmt: skip
    shape = dict(world_size=env.data_world_size, rank=env.data_rank, batch_size=per_rank, accumulation=accumulation,
                 seed=seed, shuffle=data.shuffle)  # fmt: skip
    sampler = (GlobalOrderSampler(len(prompts), **shape) if num_iterations == 1
               else RepeatedStepsSampler(len(prompts), repeats=num_iterations, **shape))  # fmt: skip
    return DataLoader(PromptRows(prompts), batch_size=per_rank, sampler=sampler, drop_last=True,
                      collate_fn=collate_prompts, generator=torch.Generator().manual_seed(seed))  # fmt: skip
