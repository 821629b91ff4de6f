"""Sequence parallelism on real CPU ranks (sequence_worker.py, one torchrun job per world size): each row split over
S ranks trains exactly as the whole row on one rank.

Every run at S = 2 on 2 ranks (bnb and HQQ under FSDP2, bnb under FSDP1, packed rows with HQQ, DPO, ORPO, SimPO
with evaluation, DoRA with activation offload, tiny Mixtral)
and at S = 4 on 4 ranks (2 key-value heads repeated to 4), and dp 2 x sp 2 with hybrid sharding, must give the
1-rank run's loss within 1e-6 and gradient norm within 1e-5 at every step (the first with fresh adapters, the next
with trained ones). A 2-rank run's checkpoint resumes as dp 2 x sp 2 on the uninterrupted trajectory.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_worker
from tests.moe_models import build_moe_model

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("sequence_worker.py")
PARITY = ("bnb", "hqq", "bnb-fsdp1", "hqq-packing", "dpo", "orpo", "simpo-eval", "dora-offload", "mixtral")


@pytest.fixture(scope="module")
def root(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("sequence")
    return root, build_moe_model("mixtral", root / "mixtral", tokenizer_from=tiny_model)


def _suite(suite: str, ranks: int, tiny_model: Path, root: tuple[Path, Path], *extra: str) -> dict[str, dict]:
    out = root[0] / suite
    out.mkdir()
    return run_worker(WORKER, [str(tiny_model), str(root[1]), str(out), suite, *extra], nproc=ranks, out=out)


@pytest.fixture(scope="module")
def one(tiny_model: Path, root: tuple[Path, Path]) -> dict[str, dict]:
    return _suite("one", 1, tiny_model, root)


@pytest.fixture(scope="module")
def two(tiny_model: Path, root: tuple[Path, Path]) -> dict[str, dict]:
    return _suite("two", 2, tiny_model, root)


@pytest.fixture(scope="module")
def four(tiny_model: Path, root: tuple[Path, Path], two: dict[str, dict]) -> dict[str, dict]:
    return _suite("four", 4, tiny_model, root, two["saved"]["output_dir"])


def assert_same_steps(run: dict, reference: dict, name: str) -> None:
    assert len(run["losses"]) == len(reference["losses"]) == 3, name
    assert run["label_tokens"] == reference["label_tokens"], f"{name}: other rows"
    for step, (got, want) in enumerate(zip(run["losses"], reference["losses"], strict=True), start=1):
        assert got == pytest.approx(want, rel=1e-6), f"{name} step {step} loss"
    for step, (got, want) in enumerate(zip(run["grad_norms"], reference["grad_norms"], strict=True), start=1):
        assert got == pytest.approx(want, rel=1e-5), f"{name} step {step} grad_norm"


@pytest.mark.parametrize("name", PARITY)
def test_two_ranks_splitting_each_row_train_as_one_rank(one: dict, two: dict, name: str) -> None:
    assert_same_steps(two[name], one[name], name)


def test_evaluation_of_split_rows_is_the_whole_rows(one: dict, two: dict) -> None:
    assert len(one["simpo-eval"]["eval_losses"]) == 1
    assert two["simpo-eval"]["eval_losses"] == pytest.approx(one["simpo-eval"]["eval_losses"], rel=1e-6)


def test_four_way_split_of_two_key_value_heads(one: dict, four: dict) -> None:
    assert_same_steps(four["gqa-s4"], one["bnb"], "gqa-s4")


def test_data_parallel_groups_of_sequence_parallel_ranks(one: dict, four: dict) -> None:
    """dp 2 x sp 2 (batch 1 per group, hybrid sharding) against 1 rank with the whole global batch of 2."""
    assert_same_steps(four["dp2xsp2"], one["bnb"], "dp2xsp2")


def test_two_rank_checkpoint_resumes_as_dp2_x_sp2(one: dict, two: dict, four: dict) -> None:
    """The 2-rank run saved at every step; its checkpoint of step 2 goes on as dp 2 x sp 2 (the same global batch
    of 2): step 3 is the uninterrupted run's."""
    saved, resumed = two["saved"], four["resumed"]
    assert resumed["steps"] == [1, 2, 3]
    assert_same_steps(saved, one["bnb"], "saved")
    assert_same_steps(resumed, saved, "resumed")
