"""Packing and evaluation through the real trainer, at 1 rank (one process) and 2 gloo ranks: one job each.

- Packing parity: step 1's loss over packed rows equals the token-weighted mean of the same samples run one by
  one without packing (unsharded, in the worker), within 1e-5 in fp32, for bnb and HQQ.
- Evaluation: the same eval_loss at 1 and 2 ranks; a falling eval_loss over 60 steps; evaluating every 5 steps
  leaves the training losses exactly as evaluating only at the end (dropout on, FSDP2 and FSDP1).
- Resume with packing is exact, and a resume that changes --packing is refused naming it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.conftest import run_worker

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("packing_worker.py")


def _job(nproc: int, model: Path, out: Path) -> dict[str, dict]:
    return run_worker(WORKER, [str(model), str(out)], nproc=nproc, out=out)


@pytest.fixture(scope="module")
def jobs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, dict]]:
    """{world size: results}; the 1-rank job is a plain process (nproc 0), the 2-rank one torchrun."""
    return {
        world: _job(0 if world == 1 else 2, tiny_model, tmp_path_factory.mktemp(f"packing-{world}")) for world in (1, 2)
    }


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("scenario", ["packed-bnb", "packed-hqq", "packed-split-hqq"])
def test_packed_loss_equals_the_samples_run_unpacked(jobs: dict, world: int, scenario: str) -> None:
    result = jobs[world][scenario]
    reference = result["reference"]
    assert reference["rows"] == 2  # the global batch
    # Rows that really hold several samples (split: step 1 draws rows of one 48-token piece each).
    assert reference["samples"] > 2 or scenario == "packed-split-hqq"
    (logged,) = result["losses"]
    assert abs(reference["packed"] - reference["unpacked"]) <= 1e-5, reference
    assert abs(logged - reference["unpacked"]) <= 1e-5, (logged, reference)


@pytest.mark.parametrize(("scenario", "context"), [("packed-bnb", 256), ("eval-ranks", 128), ("eval-every-5", 64)])
def test_packing_efficiency_is_real_tokens_over_row_tokens(jobs: dict, scenario: str, context: int) -> None:
    """Row tokens are the batch's padded width (its longest row rounded up to 8, at most the context) x its 2 rows;
    at 2 ranks each rank pads to its own width, and the sum over ranks is still at least the real tokens."""
    result = jobs[1][scenario]
    for tokens, efficiency in zip(result["tokens"], result["efficiency"], strict=True):
        width = round(tokens / efficiency / 2)
        assert tokens / (2 * width) == pytest.approx(efficiency, rel=1e-12)
        assert (width % 8 == 0 or width == context) and width <= context and 2 * width >= tokens
    assert all(0 < e <= 1 for e in jobs[2][scenario]["efficiency"])
    if scenario != "eval-every-5":  # packed: the bundled rows (38-93 tokens) fill the rows nearly
        assert min(result["efficiency"]) > 0.8


def test_eval_loss_is_the_same_at_one_and_two_ranks(jobs: dict) -> None:
    (one,), (two,) = jobs[1]["eval-ranks"]["evals"], jobs[2]["eval-ranks"]["evals"]
    assert one["step"] == two["step"] == 3
    assert one["eval_tokens"] == two["eval_tokens"] > 0
    assert abs(one["eval_loss"] - two["eval_loss"]) <= 1e-6, (one, two)
    assert one["eval_ppl"] == pytest.approx(math.exp(one["eval_loss"]), rel=1e-12)


def test_eval_loss_falls_over_60_steps(jobs: dict) -> None:
    evals = jobs[1]["eval-falls"]["evals"]
    assert [e["step"] for e in evals] == list(range(5, 61, 5))
    losses = [e["eval_loss"] for e in evals]
    first, last = losses[:4], losses[-4:]
    assert losses[-1] < losses[0] and sum(last) / 4 < sum(first) / 4 - 0.02, losses


@pytest.mark.parametrize(("world", "suffix"), [(1, ""), (2, ""), (2, "-fsdp1")])
def test_evaluating_every_5_steps_leaves_training_unchanged(jobs: dict, world: int, suffix: str) -> None:
    every, at_end = jobs[world][f"eval-every-5{suffix}"], jobs[world][f"eval-at-end{suffix}"]
    assert [e["step"] for e in every["evals"]] == [5, 6] and [e["step"] for e in at_end["evals"]] == [6]
    assert len(every["losses"]) == 6
    assert every["losses"] == at_end["losses"]  # exactly: same weights, same dropout masks, same rows
    assert every["evals"][-1]["eval_loss"] == at_end["evals"][-1]["eval_loss"]


@pytest.mark.parametrize("world", [1, 2])
def test_packed_resume_is_exact_and_refuses_another_packing(jobs: dict, world: int) -> None:
    result = jobs[world]["packed-resume"]
    assert len(result["losses"]) == 6
    assert result["resumed"] == result["losses"]
    assert "--packing True -> False" in result["refused"]
