"""Token rows -> DataLoaders: the training loader, sharded by rank and shuffled, and the evaluation loader.

Every rank builds the same rows in the same order; the `DistributedSampler` alone decides which rows a rank sees,
so W ranks x batch B see, at each step, the same rows as 1 rank x batch W*B with the same seed. Packing (when on)
is a fixed function of the data, so it changes what a row holds, never this.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from qlora_fsdp.chat import load_chat_template
from qlora_fsdp.config import DataConfig, EvalConfig
from qlora_fsdp.data import IGNORE_INDEX, AnyExample, load_examples, load_sources, tokenize_examples
from qlora_fsdp.distributed import DistEnv
from qlora_fsdp.errors import UserError
from qlora_fsdp.packing import pack_examples

logger = logging.getLogger(__name__)


class TokenizedDataset(Dataset):
    """The tokenized rows as a map-style dataset (DistributedSampler needs len and indexing)."""

    def __init__(self, items: list[dict[str, torch.Tensor]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.items[index]


def split_examples(
    examples: list[AnyExample], fraction: float, *, seed: int
) -> tuple[list[AnyExample], list[AnyExample]]:
    """(kept for training, held out) with round(fraction x rows) rows held out, at least one, chosen by `seed`.

    Both keep the dataset's order, so the split never changes how the training rows are shuffled or packed.
    """
    if not fraction:
        return examples, []
    n_held = max(1, round(fraction * len(examples)))
    if n_held >= len(examples):
        raise UserError(
            f"--eval_split {fraction} of {len(examples)} rows leaves none to train on; use a smaller --eval_split"
        )
    held = set(random.Random(seed).sample(range(len(examples)), n_held))
    return [e for i, e in enumerate(examples) if i not in held], [e for i, e in enumerate(examples) if i in held]


def token_rows(
    examples: list[AnyExample], tokenizer: Any, cfg: DataConfig, *, origin: str = ""
) -> tuple[list[dict[str, torch.Tensor]], str]:
    """The rows a loader serves (packed with --packing, else one padded sample each) and a line saying how
    (`origin`, such as per-source counts, follows the row count)."""
    if cfg.packing:
        items, packed = pack_examples(
            examples,
            tokenizer,
            context_length=cfg.context_length,
            train_on_inputs=cfg.train_on_inputs,
            split=cfg.packing_split,
        )
        cut = f"{packed.split} split" if cfg.packing_split else f"{packed.truncated} truncated"
        return items, (
            f"{packed.rows} rows{origin}, {cut} at {cfg.context_length} tokens, {packed.dropped} dropped "
            f"(nothing left to learn), {packed.total_label_tokens} label tokens; {packed.samples} samples packed into "
            f"{packed.packed_rows} rows, efficiency {packed.efficiency:.1%} (real tokens / row tokens)"
        )
    items, stats = tokenize_examples(
        examples, tokenizer, context_length=cfg.context_length, train_on_inputs=cfg.train_on_inputs
    )
    return items, (
        f"{stats.rows} rows{origin}, {stats.truncated} truncated to {cfg.context_length} tokens, "
        f"{stats.dropped} dropped (nothing left to learn), {stats.total_label_tokens} label tokens"
    )


def build_dataloader(
    cfg: DataConfig, tokenizer: Any, env: DistEnv, *, seed: int, eval_split: float = 0.0
) -> DataLoader:
    """This rank's training DataLoader (without the rows --eval_split holds out); the caller calls
    loader.sampler.set_epoch(epoch) so each epoch reshuffles."""
    if cfg.chat_template:
        load_chat_template(tokenizer, cfg.chat_template)  # the evaluation rows, made later, use it too
    sources = load_sources(cfg.dataset, samples=cfg.dataset_samples, prompt_style=cfg.prompt_style)
    examples, _ = split_examples([e for _, part in sources for e in part], eval_split, seed=seed)
    origin = f" ({', '.join(f'{name}: {len(part)}' for name, part in sources)})" if len(sources) > 1 else ""
    items, summary = token_rows(examples, tokenizer, cfg, origin=origin)
    needed = env.world_size * cfg.batch_size
    if len(items) < needed:
        raise UserError(
            f"--dataset {cfg.dataset} has {len(items)} usable rows, fewer than the {needed} one step needs "
            f"({env.world_size} ranks x --batch_size {cfg.batch_size}); use more data or a smaller --batch_size"
        )
    if env.rank == 0:
        logger.info("dataset %s: %s", cfg.dataset, summary)
    ds = TokenizedDataset(items)
    sampler = DistributedSampler(
        ds, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=seed, drop_last=True
    )
    # Its own generator: every new iterator draws a seed, and drawing from the global RNG would shift dropout
    # masks between a resumed run and an uninterrupted one.
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(ds, batch_size=cfg.batch_size, sampler=sampler, drop_last=True, generator=generator)


def eval_shard(items: list[dict[str, torch.Tensor]], env: DistEnv, batch_size: int) -> list[dict[str, torch.Tensor]]:
    """This rank's evaluation rows: every world_size-th row from its rank on, each row exactly once across ranks.

    Every rank must run as many forwards as the others (each is a collective under FSDP), so the shards are filled
    up to the same number of whole batches with a copy of the first row whose labels are all -100: it adds nothing
    to the loss sum or the token count.
    """
    per_rank = -(-len(items) // env.world_size)
    rows = -(-per_rank // batch_size) * batch_size
    blank = {**items[0], "labels": torch.full_like(items[0]["labels"], IGNORE_INDEX)}
    mine = items[env.rank :: env.world_size]
    return mine + [blank] * (rows - len(mine))


def build_eval_loader(
    data: DataConfig, cfg: EvalConfig, tokenizer: Any, env: DistEnv, *, seed: int
) -> DataLoader | None:
    """This rank's share of the evaluation set, in order (None without --eval_dataset or --eval_split).

    The rows are built like the training rows (same context, prompt style, masking and packing), from
    --eval_dataset or from the rows --eval_split holds out of --dataset (the split build_dataloader leaves out).
    """
    if cfg.eval_dataset:
        name = cfg.eval_dataset
        try:
            examples = load_examples(name, samples=cfg.eval_samples, prompt_style=data.prompt_style)
        except UserError as exc:  # the loader names --dataset, the flag it usually serves
            text = str(exc)
            raise UserError(
                text.replace("--dataset", "--eval_dataset", 1)
                if text.startswith("--dataset")
                else f"--eval_dataset: {text}"
            ) from None
    elif cfg.eval_split:
        name = f"{data.dataset} (held out: --eval_split {cfg.eval_split})"
        examples = load_examples(data.dataset, samples=data.dataset_samples, prompt_style=data.prompt_style)
        _, examples = split_examples(examples, cfg.eval_split, seed=seed)
        examples = examples[: cfg.eval_samples or None]
    else:
        return None
    items, summary = token_rows(examples, tokenizer, data)
    if env.rank == 0:
        logger.info("eval dataset %s: %s", name, summary)
    # No sampler, no shuffling, and a generator of its own: iterating draws a seed, never from the global RNG
    # that dropout uses, so evaluating leaves the training trajectory as it was.
    generator = torch.Generator().manual_seed(seed)
    shard = TokenizedDataset(eval_shard(items, env, data.batch_size))
    return DataLoader(shard, batch_size=data.batch_size, shuffle=False, generator=generator)
