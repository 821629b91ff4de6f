"""The training sampler's global order: the same at every world size, cut into whole steps, and resumable at a
global sample on another world size (what lets a checkpoint continue its data on other ranks)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from torch.utils.data import DistributedSampler

from qlora_fsdp.data.loader import GlobalOrderSampler, LengthGroupedSampler, RepeatedStepsSampler


def _steps(
    rows: int,
    world_size: int,
    batch_size: int,
    *,
    accumulation: int = 1,
    epoch: int = 0,
    start: int = 0,
    lengths: np.ndarray | None = None,
) -> list[list[int]]:
    """Each optimizer step's rows over all ranks, in order, as the ranks' DataLoaders would batch them."""
    per_rank = []
    for rank in range(world_size):
        shape = {"world_size": world_size, "rank": rank, "batch_size": batch_size, "seed": 5}
        if lengths is None:
            sampler = GlobalOrderSampler(rows, accumulation=accumulation, **shape)
        else:
            sampler = LengthGroupedSampler(lengths, accumulation=accumulation, **shape)
        sampler.set_epoch(epoch, start)
        order = list(sampler)
        per_rank.append([order[i : i + batch_size] for i in range(0, len(order), batch_size)])
    micro = [list(itertools.chain(*batches)) for batches in zip(*per_rank, strict=True)]
    return [list(itertools.chain(*micro[i : i + accumulation])) for i in range(0, len(micro), accumulation)]


def test_the_order_is_distributed_samplers_when_an_epoch_is_whole_steps() -> None:
    """A run that never resumes sees the rows DistributedSampler(drop_last=True) gave it before."""
    for rank in range(2):
        ours = GlobalOrderSampler(96, world_size=2, rank=rank, batch_size=4, accumulation=3, seed=5)
        theirs = DistributedSampler(range(96), num_replicas=2, rank=rank, shuffle=True, seed=5, drop_last=True)
        for epoch in (0, 1):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)


def test_every_world_size_sees_the_same_steps_and_an_epoch_is_whole_steps() -> None:
    one = _steps(1003, 1, 8, accumulation=2)
    assert [set(s) for s in _steps(1003, 2, 4, accumulation=2)] == [set(s) for s in one]
    assert [set(s) for s in _steps(1003, 4, 2, accumulation=2)] == [set(s) for s in one]
    seen = [i for s in one for i in s]
    assert len(seen) == len(set(seen)) == 1003 // 16 * 16  # the tail shorter than a step is left out
    assert len(GlobalOrderSampler(1003, world_size=2, rank=0, batch_size=4, accumulation=2, seed=5)) == 62 * 8
    assert _steps(1003, 1, 8, accumulation=2, epoch=1) != one


@pytest.mark.parametrize(("world_size", "batch_size"), [(4, 1), (1, 4), (2, 2)])
def test_a_resume_on_other_ranks_takes_up_the_order_where_it_stopped(world_size: int, batch_size: int) -> None:
    whole = _steps(100, 2, 2)
    resumed = _steps(100, world_size, batch_size, start=3 * 4)
    assert [set(s) for s in whole[:3] + resumed] == [set(s) for s in whole]


def test_a_changed_global_batch_goes_on_with_the_unseen_rows_of_the_same_order() -> None:
    whole = [i for s in _steps(100, 1, 4) for i in s]
    resumed = _steps(100, 2, 3, start=3 * 4)  # 12 seen; steps of 6 from there
    assert [set(s) for s in resumed] == [set(whole[12 + 6 * k : 18 + 6 * k]) for k in range((100 - 12) // 6)]


def test_the_grouped_order_resumes_at_the_same_global_micro_batch() -> None:
    lengths = np.random.default_rng(0).integers(10, 500, size=400)
    whole = _steps(400, 2, 4, lengths=lengths)
    resumed = _steps(400, 4, 2, lengths=lengths, start=5 * 8)
    assert [set(s) for s in whole[:5] + resumed] == [set(s) for s in whole]


def test_the_grouped_order_does_not_depend_on_accumulation() -> None:
    """Accumulation only cuts the epoch to whole steps: a checkpoint may change it and keep the order."""
    lengths = np.random.default_rng(0).integers(10, 500, size=103)
    plain = [i for s in _steps(103, 2, 2, lengths=lengths) for i in s]
    accumulated = [i for s in _steps(103, 2, 2, accumulation=4, lengths=lengths) for i in s]
    assert len(plain) == 100 and len(accumulated) == 96
    assert accumulated == plain[:96]


@pytest.mark.parametrize(("world_size", "left"), [(2, 250), (4, 125), (1, 500)])
def test_a_resumed_epoch_run_counts_the_steps_left_at_its_own_global_batch(world_size: int, left: int) -> None:
    """One epoch of 1000 rows at 2 ranks x 1 is 500 steps; resumed half-way on other ranks it still ends with the
    epoch, however many steps that now takes."""
    from types import SimpleNamespace

    from qlora_fsdp.checkpoint.dcp import TrainState
    from qlora_fsdp.config.options import OptimConfig
    from qlora_fsdp.train.trainer import planned_steps

    def loader(ranks: int) -> SimpleNamespace:
        return SimpleNamespace(sampler=GlobalOrderSampler(1000, world_size=ranks, rank=0, batch_size=1,
                                                          accumulation=1, seed=5))  # fmt: skip

    cfg = OptimConfig(num_epochs=1)
    assert planned_steps(cfg, loader(2), TrainState()) == 500
    halfway = TrainState(step=250, epoch=0, samples_in_epoch=500, world_size=2)
    assert planned_steps(cfg, loader(world_size), halfway) == 250 + left
    two_epochs = OptimConfig(num_epochs=2)
    assert planned_steps(two_epochs, loader(world_size), halfway) == 250 + left + 1000 // world_size


def test_repeated_steps_read_each_step_n_times_and_resume_between_repeats() -> None:
    """GRPO's --num_iterations 3: each step's rows (whichever world size reads them) come 3 times in a row, an epoch
    is 3x the steps, and a position between repeats resumes there, on another world size too."""

    def steps(world_size: int, start: int = 0) -> list[list[int]]:
        batch = 8 // world_size  # a step: 8 rows x 2 micro-batches on every world size
        per_rank = []
        for rank in range(world_size):
            sampler = RepeatedStepsSampler(101, repeats=3, world_size=world_size, rank=rank, batch_size=batch,
                                           accumulation=2, seed=5)  # fmt: skip
            sampler.set_epoch(0, start)
            order = list(sampler)
            per_rank.append([order[i : i + batch] for i in range(0, len(order), batch)])
        micro = [list(itertools.chain(*batches)) for batches in zip(*per_rank, strict=True)]
        return [list(itertools.chain(*micro[i : i + 2])) for i in range(0, len(micro), 2)]

    plain = _steps(101, 1, 8, accumulation=2)
    repeated = steps(1)
    assert repeated == [s for s in plain for _ in range(3)]
    sampler = RepeatedStepsSampler(101, repeats=3, world_size=2, rank=0, batch_size=4, accumulation=2, seed=5)
    assert len(sampler) == 3 * len(GlobalOrderSampler(101, world_size=2, rank=0, batch_size=4, accumulation=2, seed=5))
    assert sampler.steps_from(0) == 3 * len(plain) == 18 and sampler.steps_from(4 * 16) == 14
    assert [set(s) for s in steps(2)] == [set(s) for s in repeated]
    assert steps(2, start=4 * 16) == [list(s) for s in steps(2)[4:]]  # after the 2nd read of step 2
    assert [set(s) for s in steps(2, start=4 * 16)] == [set(s) for s in repeated[4:]]


def test_unshuffled_order_is_the_rows_own_every_epoch_at_every_world_size() -> None:
    """--shuffle false: step after step the file's rows in order (what a run fed another trainer's order needs),
    dealt to the ranks as the shuffled order is, and a resume continues it."""
    for world_size, batch_size in ((1, 8), (2, 4), (4, 2)):
        for epoch in (0, 1):
            steps = []
            for rank in range(world_size):
                sampler = GlobalOrderSampler(20, world_size=world_size, rank=rank, batch_size=batch_size,
                                             accumulation=1, seed=5, shuffle=False)  # fmt: skip
                sampler.set_epoch(epoch, 8)
                steps.append(list(sampler))
            assert sorted(itertools.chain(*steps)) == list(range(8, 16))
            assert steps[0][:2] == ([8, 8 + world_size] if batch_size > 1 else [8])
