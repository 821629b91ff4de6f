"""Data at scale through the real CLI (fp32, CPU ranks): per-batch padding, --group_by_length and streaming train
exactly what padding to the context, 1 rank and the cached path train; a streamed run resumes exactly."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest

from qlora_fsdp.train.metrics import read_metrics
from tests.conftest import DATASET, stopped_at, train

pytestmark = pytest.mark.distributed

COMMON = [
    "--dataset", str(DATASET), "--precision", "fp32", "--lr", "0.01", "--lora_rank", "8", "--lora_alpha", "16",
    "--lora_dropout", "0", "--lr_scheduler", "constant", "--device", "cpu", "--log_to", "stdout", "--seed", "11",
    "--quant", "bnb", "--save_model", "false",
]  # fmt: skip


def _run(tiny_model: Path, out: Path, *flags: str, nproc: int) -> list[dict]:
    train(["--model", str(tiny_model), *COMMON, "--output_dir", str(out), *flags], nproc=nproc, timeout=600)
    return read_metrics(out)


def _close(a: list[dict], b: list[dict], *, rel: float, keys: tuple[str, ...] = ("loss", "grad_norm")) -> None:
    assert len(a) == len(b) > 0
    for ra, rb in zip(a, b, strict=True):
        for key in keys:
            assert math.isclose(ra[key], rb[key], rel_tol=rel, abs_tol=0.0), (ra["step"], key, ra[key], rb[key])


def test_per_batch_padding_trains_as_padding_to_the_context(tiny_model: Path, tmp_path: Path) -> None:
    """Padding only to each batch's longest row changes what is computed on padding, never the loss: the same
    losses and gradient norms (fp32), with the row tokens (and so packing_efficiency) far lower."""
    flags = ("--context_length", "256", "--batch_size", "4", "--max_steps", "4")
    ours = _run(tiny_model, tmp_path / "batch", *flags, nproc=0)
    fixed = _run(tiny_model, tmp_path / "context", *flags, "--pad_to_context", "true", nproc=0)
    _close(ours, fixed, rel=1e-6)
    assert [r["tokens"] for r in ours] == [r["tokens"] for r in fixed]
    assert all(r["packing_efficiency"] > 2 * f["packing_efficiency"] for r, f in zip(ours, fixed, strict=True))


@pytest.fixture(scope="module")
def one_rank(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[dict]]:
    """1 rank x batch 4 at context 128 for 6 steps, with --group_by_length false or true: records, run on first use
    (the comparison with 2 ranks takes their first 4 steps; the padding one all 6)."""
    made: dict[str, list[dict]] = {}

    def run(group: str) -> list[dict]:
        if group not in made:
            out = tmp_path_factory.mktemp(f"one-rank-{group}")
            flags = ("--context_length", "128", "--max_steps", "6", "--batch_size", "4", "--group_by_length", group)
            made[group] = _run(tiny_model, out, *flags, nproc=1)
        return made[group]

    return run


@pytest.mark.parametrize("group", ["false", "true"], ids=["shuffled", "group_by_length"])
def test_two_ranks_train_as_one_rank_with_the_global_batch(
    tiny_model: Path, tmp_path: Path, one_rank: Callable[[str], list[dict]], group: str
) -> None:
    """2 ranks x batch 2 and 1 rank x batch 4 see the same rows each step, with and without --group_by_length,
    though each rank pads its batch to its own longest row."""
    flags = ("--context_length", "128", "--max_steps", "4", "--group_by_length", group)
    two = _run(tiny_model, tmp_path / "two", *flags, "--batch_size", "2", nproc=2)
    one = one_rank(group)[:4]
    _close(two, one, rel=1e-5)
    assert [r["tokens"] for r in two] == [r["tokens"] for r in one]


def test_group_by_length_pads_less(one_rank: Callable[[str], list[dict]]) -> None:
    mean = lambda rs: sum(r["packing_efficiency"] for r in rs) / len(rs)  # noqa: E731
    assert mean(one_rank("true")) > mean(one_rank("false"))


def test_a_stream_trains_as_the_cache_when_a_step_covers_the_data(tiny_model: Path, tmp_path: Path) -> None:
    """8 rows, 2 ranks x batch 4: one step holds every row whichever way they are dealt, so the streamed step
    (rows in file order, row i on rank i % 2) and the cached one (shuffled) compute the same loss and gradient."""
    flags = ("--dataset_samples", "8", "--context_length", "128", "--batch_size", "4", "--max_steps", "1")
    streamed = _run(tiny_model, tmp_path / "stream", *flags, "--dataset_streaming", "true", nproc=2)
    cached = _run(tiny_model, tmp_path / "cache", *flags, nproc=2)
    _close(streamed, cached, rel=1e-6)


def test_a_streamed_run_resumes_exactly(tiny_model: Path, tmp_path: Path) -> None:
    """10 rows over 2 ranks x batch 2: a pass is 2.5 steps, so the resumed steps 4-6 start mid-pass and cross into
    the next one; they equal the uninterrupted run's."""
    flags = ("--dataset_samples", "10", "--context_length", "128", "--batch_size", "2", "--dataset_streaming",
             "true", "--save_steps", "3")  # fmt: skip
    whole = _run(tiny_model, tmp_path / "whole", *flags, "--max_steps", "6", nproc=2)
    out = tmp_path / "parts"
    stopped_at(tmp_path / "whole", out, step=3)
    resumed = _run(tiny_model, out, *flags, "--max_steps", "6", "--resume_from", "auto", nproc=2)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    _close(resumed, whole[3:], rel=1e-6)
