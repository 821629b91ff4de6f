"""The cache's rows -> DataLoaders: training (sharded by rank, shuffled) and evaluation (in order).

The top of the data path: sources -> formats -> rows -> cache -> here. Every rank opens the same cache (each
node's local rank 0 builds it first) and serves rows from it; the sampler alone decides which rows a rank sees, so
W ranks x batch B see, at each step, the rows 1 rank x batch W*B sees with the same seed. Packing and
--group_by_length change what a row holds or where it falls in the order, never this.
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from qlora_fsdp.config.options import DataConfig, EvalConfig
from qlora_fsdp.data.cache import CacheSpec, TokenizedCache, open_cache, tokenize_in_memory
from qlora_fsdp.data.chat import load_chat_template
from qlora_fsdp.data.formats import IGNORE_INDEX, pad_token_id
from qlora_fsdp.data.images import ImageInputs
from qlora_fsdp.data.rows import PackedRows, PairRows, SampleRows, all_dropped_error, build_rows, collate
from qlora_fsdp.data.sources import synthetic
from qlora_fsdp.data.stream import StreamRows
from qlora_fsdp.errors import UserError
from qlora_fsdp.parallel.distributed import DistEnv, leaders_first

logger = logging.getLogger(__name__)

GROUP_WINDOW = 64
"""--group_by_length sorts windows of this many global batches by length: similar rows share a batch, while the
order stays shuffled across windows."""


def held_out(examples: int, fraction: float, *, seed: int) -> np.ndarray:
    """A mask of the round(fraction x examples) examples --eval_split holds out, at least one, chosen by `seed`."""
    held = np.zeros(examples, dtype=bool)
    if not fraction:
        return held
    n_held = max(1, round(fraction * examples))
    if n_held >= examples:
        raise UserError(
            f"--eval_split {fraction} of {examples} rows leaves none to train on; use a smaller --eval_split"
        )
    held[random.Random(seed).sample(range(examples), n_held)] = True
    return held


class GlobalOrderSampler(Sampler[int]):
    """A seeded shuffle whose global order is the same at every world size, and which resumes at a global sample.

    Epoch e's order is DistributedSampler's (torch.randperm seeded with seed + e; the rows' own order every epoch
    with `shuffle` false, --shuffle false), read in global micro-batches of
    world_size x batch_size rows, rank r taking every world_size-th row from r on, and cut to whole optimizer steps
    (`step_rows` = global micro-batch x accumulation), so an epoch's tail shorter than a step is left out.
    `set_epoch(e, start)` positions it after `start` rows of that order (a resume, maybe at another world size).
    """

    def __init__(self, rows: int, *, world_size: int, rank: int, batch_size: int, accumulation: int, seed: int,
                 shuffle: bool = True) -> None:  # fmt: skip
        self.rows, self.world_size, self.rank, self.batch_size = rows, world_size, rank, batch_size
        self.seed, self.shuffle, self.epoch, self.start = seed, shuffle, 0, 0
        self.global_batch = world_size * batch_size
        self.step_rows = self.global_batch * accumulation
        self.usable = rows // self.step_rows * self.step_rows

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        """A whole epoch's rows for this rank, wherever the sampler is positioned (total steps count epochs)."""
        return self.usable // self.world_size

    def steps_from(self, start: int) -> int:
        """Whole optimizer steps an epoch holds after its first `start` rows."""
        return max(0, self.rows - start) // self.step_rows

    def _end(self) -> int:
        """Where this epoch's reading stops: whole steps from `start` on."""
        return self.start + self.steps_from(self.start) * self.step_rows

    def _order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.rows)
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.rows, generator=generator).numpy()

    def __iter__(self) -> Iterator[int]:
        return iter(self._order()[self.start + self.rank : self._end() : self.world_size].tolist())


class RepeatedStepsSampler(GlobalOrderSampler):
    """GlobalOrderSampler's order with each optimizer step's rows read `repeats` times in a row (GRPO's
    --num_iterations: one generation's prompts serve that many steps, as TRL's RepeatSampler repeats them). Positions
    and lengths count the repeated reads, so epochs, total steps and resume positions follow from the base's rules."""

    def __init__(self, rows: int, *, repeats: int, **kwargs: Any) -> None:
        super().__init__(rows, **kwargs)
        self.repeats = repeats

    def __len__(self) -> int:
        return super().__len__() * self.repeats

    def steps_from(self, start: int) -> int:
        return max(0, self.usable * self.repeats - start) // self.step_rows

    def _order(self) -> np.ndarray:
        steps = super()._order()[: self.usable].reshape(-1, self.step_rows)
        return np.repeat(steps, self.repeats, axis=0).reshape(-1)


class LengthGroupedSampler(GlobalOrderSampler):
    """A seeded shuffle whose global batches hold rows of similar length (--group_by_length).

    The global order depends on the seed, the epoch and the global micro-batch (ranks x batch) only: the rows are
    shuffled, cut into windows of GROUP_WINDOW global batches, each window sorted by length (longest first) and cut
    into global batches, and the batches shuffled. Rank r takes the r-th slice of each global batch. A resume
    continues the order only at the same global micro-batch (check_resume_compatible refuses another).
    """

    def __init__(
        self, lengths: np.ndarray, *, world_size: int, rank: int, batch_size: int, seed: int, accumulation: int = 1
    ) -> None:
        super().__init__(
            len(lengths), world_size=world_size, rank=rank, batch_size=batch_size, accumulation=accumulation, seed=seed
        )
        self.lengths = lengths

    def __iter__(self) -> Iterator[int]:
        rng = np.random.default_rng([self.seed % 2**63, self.epoch])  # numpy refuses negative seeds
        grouped_rows = self.rows // self.global_batch * self.global_batch  # the order ignores accumulation
        order = rng.permutation(self.rows)[:grouped_rows]
        span = GROUP_WINDOW * self.global_batch
        windows = [order[s : s + span] for s in range(0, grouped_rows, span)]
        grouped = np.concatenate([w[np.argsort(-self.lengths[w], kind="stable")] for w in windows])
        batches = grouped.reshape(-1, self.global_batch)[rng.permutation(grouped_rows // self.global_batch)]
        lo = self.rank * self.batch_size
        mine = batches[self.start // self.global_batch : self._end() // self.global_batch, lo : lo + self.batch_size]
        return iter(mine.reshape(-1).tolist())


class EvalShard(Dataset):
    """This rank's evaluation rows: every world_size-th row from its rank on, each row exactly once across ranks.

    Every rank must run as many forwards as the others (each is a collective under FSDP), so the shards are filled
    up to the same number of whole batches with a copy of the first row whose labels are all -100: it adds nothing
    to the loss sum or the token count.
    """

    def __init__(self, rows: Dataset, env: DistEnv, batch_size: int) -> None:
        per_rank = -(-len(rows) // env.data_world_size)
        self.rows = rows
        self.mine = list(range(env.data_rank, len(rows), env.data_world_size))
        self.size = -(-per_rank // batch_size) * batch_size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        if index >= self.size:
            raise IndexError(index)
        if index < len(self.mine):
            return self.rows[self.mine[index]]
        first = self.rows[0]  # a pair's rejected side too: both are unlabelled, so the pair counts for nothing
        return {**first, **{k: [IGNORE_INDEX] * len(v) for k, v in first.items() if k.endswith("labels")}}


def dataset_cache(
    dataset: str,
    samples: int,
    data: DataConfig,
    tokenizer: Any,
    env: DistEnv,
    *,
    kind: str = "sft",
    images: ImageInputs | None = None,
) -> tuple[TokenizedCache, bool]:
    """The tokenized cache of one dataset (--dataset or --eval_dataset) under the data flags (its rows of the `kind`
    CacheSpec.objective names; `images`: a VLM's processor), built by each node's local rank 0 if no one has built
    it, and logged on rank 0. A synthetic dataset, or any with --dataset_in_memory, is tokenized on every rank into
    memory instead."""
    spec = CacheSpec(
        dataset=dataset,
        dataset_samples=samples,
        prompt_style=data.prompt_style,
        context_length=data.context_length,
        packing_split=data.packing_split,
        train_on_inputs=data.train_on_inputs,
        objective=kind,
        max_prompt_length=data.max_prompt_length if kind != "sft" else 0,
    )

    def work() -> tuple[TokenizedCache, bool]:
        return open_cache(spec, tokenizer, images, cache_dir=data.dataset_cache_dir, num_proc=data.dataset_num_proc)

    if data.dataset_in_memory or synthetic(dataset):
        cache, built = tokenize_in_memory(spec, tokenizer, images), True
    else:
        cache, built = leaders_first(work, env)
    if env.is_main:
        logger.info("dataset %s: %s", dataset, cache.describe(built))
    return cache, built


def prepare_caches(
    data: DataConfig,
    ev: EvalConfig,
    tokenizer: Any,
    env: DistEnv,
    *,
    kind: str = "sft",
    images: ImageInputs | None = None,
) -> list[tuple[TokenizedCache, bool]]:
    """The caches a training run with these flags reads (--dataset, and --eval_dataset if given), built now:
    scripts/preprocess.py runs this ahead of a GPU job."""
    if data.chat_template:
        load_chat_template(tokenizer, data.chat_template)
    caches = [dataset_cache(data.dataset, data.dataset_samples, data, tokenizer, env, kind=kind, images=images)]
    if ev.eval_dataset:
        caches.append(dataset_cache(ev.eval_dataset, ev.eval_samples, data, tokenizer, env, kind=kind, images=images))
    return caches


def _rows(
    cache: TokenizedCache, keep: np.ndarray, data: DataConfig, name: str, env: DistEnv
) -> SampleRows | PackedRows | PairRows:
    """The rows of the examples in `keep`, logged with what fitting and packing did to them."""
    indices = np.flatnonzero(keep[cache.origin] & (cache.lengths > 0))
    if not len(indices):
        stats = cache.stats(keep)
        if stats.identical + stats.empty == stats.rows:
            raise UserError(
                f"{name}: all {stats.rows} pairs were dropped ({stats.identical} with identical replies, "
                f"{stats.empty} with an empty one): a pair needs two different replies"
            )
        chosen = np.flatnonzero(keep[cache.origin])
        raise all_dropped_error(int(keep.sum()), data.context_length, without_reply=cache.all_without_reply(chosen))
    rows, packed = build_rows(
        cache.samples,
        indices,
        cache.lengths,
        context_length=data.context_length,
        packing=data.packing,
        kind=cache.kind,
    )
    if env.is_main:
        logger.info("%s: %s%s", name, cache.stats(keep).describe(data.context_length), packed)
    return rows


Split = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
"""What becomes of a collated batch before the loop sees it: this rank's slice of its rows, with sequence
parallelism (qlora_fsdp.parallel.sequence_parallel.split_rows)."""


@dataclass(frozen=True)
class Batching:
    """How rows become this rank's batches beyond the data flags: what the run decides (the seed, accumulation,
    --compile's fixed shapes), the objective (the kind of rows) and the model (sequence parallelism's split, a
    vision-language model's images)."""

    seed: int
    kind: str = "sft"
    """"sft", or rows of two sequences each (preference pairs, KTO's labelled completions), a batch of B being 2B
    sequences (rows.collate)."""
    accumulation: int = 1
    """--gradient_accumulation_steps: each epoch is whole optimizer steps (GlobalOrderSampler)."""
    fixed_shapes: bool = False
    """--compile: every batch padded to the context, as --pad_to_context does."""
    split: Split | None = None
    """What this rank trains on of each collated batch (Split)."""
    images: ImageInputs | None = None
    """A vision-language model's processor, which makes rows with images into tokens and pixels."""


def _loader_kwargs(data: DataConfig, tokenizer: Any, batching: Batching) -> dict[str, Any]:
    pad = functools.partial(
        collate,
        pad_id=pad_token_id(tokenizer),
        context_length=data.context_length,
        pad_to_context=data.pad_to_context or batching.fixed_shapes,
        images=batching.images,
    )
    split = batching.split
    collate_fn = pad if split is None else functools.partial(_split_after, pad=pad, split=split)
    # Its own generator: every new iterator draws a seed, and drawing from the global RNG would shift dropout
    # masks between a resumed run and an uninterrupted one (and evaluating would change training).
    generator = torch.Generator().manual_seed(batching.seed)
    return {"batch_size": data.batch_size, "collate_fn": collate_fn, "generator": generator}


def _split_after(items: list[dict[str, Any]], *, pad: Callable, split: Split) -> dict[str, torch.Tensor]:
    return split(pad(items))


def build_loaders(
    data: DataConfig, ev: EvalConfig, tokenizer: Any, env: DistEnv, batching: Batching
) -> tuple[DataLoader, DataLoader | None]:
    """This rank's training loader (without the rows --eval_split holds out) and evaluation loader (None without
    --eval_dataset or --eval_split). The caller calls loader.sampler.set_epoch(epoch) so each epoch reshuffles."""
    if data.chat_template:
        load_chat_template(tokenizer, data.chat_template)
    kind, images, seed = batching.kind, batching.images, batching.seed
    if images is not None:
        _refuse_for_images(data, batching.split)
    kwargs = _loader_kwargs(data, tokenizer, batching)
    cache, held = None, None
    if data.dataset_streaming:
        train = DataLoader(_stream(data, tokenizer, env), **kwargs)
    else:
        cache, _ = dataset_cache(data.dataset, data.dataset_samples, data, tokenizer, env, kind=kind, images=images)
        held = held_out(cache.examples, ev.eval_split, seed=seed)
        rows = _rows(cache, ~held, data, "training rows", env)
        sampler = _sampler(rows, data, env, seed, batching.accumulation)
        train = DataLoader(rows, sampler=sampler, drop_last=True, **kwargs)
    evaluation = _eval_rows(data, ev, tokenizer, env, cache, held, kind=kind, images=images)
    if evaluation is None:
        return train, None
    # No sampler and no shuffling: every rank evaluates its share in order.
    shard = EvalShard(evaluation, env, data.batch_size)
    return train, DataLoader(shard, shuffle=False, **_loader_kwargs(data, tokenizer, batching))


def _refuse_for_images(data: DataConfig, split: Split | None) -> None:
    """What a vision-language model's rows cannot do yet, refused before anything is tokenized or loaded."""
    for bad, flag in ((data.packing, "--packing true"), (data.dataset_streaming, "--dataset_streaming true"),
                      (split is not None, "--sequence_parallel_size above 1")):  # fmt: skip
        if bad:
            raise UserError(f"{flag}: not supported with a vision-language model yet (its image rows); drop it")


def _stream(data: DataConfig, tokenizer: Any, env: DistEnv) -> StreamRows:
    if env.is_main:
        logger.info("dataset %s: streamed, row i to rank i %% %d, tokenized as it is read", data.dataset,
                    env.data_world_size)  # fmt: skip
    return StreamRows(
        data.dataset,
        tokenizer,
        samples=data.dataset_samples,
        prompt_style=data.prompt_style,
        context_length=data.context_length,
        train_on_inputs=data.train_on_inputs,
        packing=data.packing,
        packing_split=data.packing_split,
        rank=env.data_rank,
        world_size=env.data_world_size,
    )


def _sampler(
    rows: SampleRows | PackedRows | PairRows, data: DataConfig, env: DistEnv, seed: int, accumulation: int
) -> GlobalOrderSampler:
    needed = env.data_world_size * data.batch_size * accumulation
    if len(rows) < needed:
        accumulated = f" x --gradient_accumulation_steps {accumulation}" if accumulation > 1 else ""
        ranks = f"{env.data_world_size} ranks" if env.sequence_parallel == 1 else f"{env.data_world_size} groups"
        raise UserError(
            f"--dataset {data.dataset} has {len(rows)} usable rows, fewer than the {needed} one step needs "
            f"({ranks} x --batch_size {data.batch_size}{accumulated}); use more data, a smaller "
            f"--batch_size{' or --gradient_accumulation_steps' if accumulated else ''}"
        )
    shape = {"world_size": env.data_world_size, "rank": env.data_rank, "batch_size": data.batch_size, "seed": seed}
    if data.group_by_length:
        return LengthGroupedSampler(rows.lengths, accumulation=accumulation, **shape)
    return GlobalOrderSampler(len(rows), accumulation=accumulation, shuffle=data.shuffle, **shape)


def _eval_rows(
    data: DataConfig,
    ev: EvalConfig,
    tokenizer: Any,
    env: DistEnv,
    cache: TokenizedCache | None,
    held: np.ndarray | None,
    *,
    kind: str,
    images: ImageInputs | None = None,
) -> SampleRows | PackedRows | PairRows | None:
    """The evaluation rows, built like the training rows (same context, prompt style, masking and packing), from
    --eval_dataset or from the examples --eval_split holds out of --dataset (`cache`, `held`; None when
    streamed, which the config allows only with --eval_dataset)."""
    if ev.eval_dataset:
        try:
            cache, _ = dataset_cache(ev.eval_dataset, ev.eval_samples, data, tokenizer, env, kind=kind, images=images)
        except UserError as exc:  # the sources name --dataset, the flag they usually serve
            text = str(exc)
            raise UserError(
                text.replace("--dataset ", "--eval_dataset ", 1)
                if text.startswith("--dataset ")
                else f"--eval_dataset: {text}"
            ) from None
        keep = np.ones(cache.examples, dtype=bool)
        name = f"eval rows ({ev.eval_dataset})"
    elif ev.eval_split and cache is not None and held is not None:
        keep = held.copy()
        if ev.eval_samples:
            keep[np.flatnonzero(held)[ev.eval_samples :]] = False
        name = f"eval rows (held out of {data.dataset} by --eval_split {ev.eval_split})"
    else:
        return None
    return _rows(cache, keep, data, name, env)
