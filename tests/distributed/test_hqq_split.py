"""HQQ loading split across real gloo ranks: each rank quantizes whole weights of a decoder layer, the results are
exchanged, and every rank ends with the bytes of one process quantizing everything.

The tiny model has 7 HQQ weights per layer and 14 in all: a multiple of neither 2 ranks per layer nor 3 ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import launch

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("hqq_split_worker.py")
CASES = ("4bit-bf16", "3bit-fp32")
WEIGHTS = 14  # 7 linears x 2 layers


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def reports(request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp(f"hqq-split-{request.param}")
    result = launch(WORKER, [str(tiny_model), str(out)], nproc=request.param)
    assert result.returncode == 0, result.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(request.param)]


@pytest.mark.parametrize("case", CASES)
def test_every_rank_holds_the_bytes_one_process_computes(reports: list[dict], case: str) -> None:
    """Packed bytes, scale, zero and metadata of every layer, on every rank, equal quantizing it alone."""
    for rank, report in enumerate(reports):
        assert report[case]["checked"] == WEIGHTS
        assert report[case]["mismatches"] == [], f"rank {rank}"


@pytest.mark.parametrize("case", CASES)
def test_each_weight_is_quantized_by_exactly_one_rank(reports: list[dict], case: str) -> None:
    """Fails if every rank quantized every weight (the unsplit loading) or if a weight was left to nobody."""
    shares = [report[case]["quantized_here"] for report in reports]
    assert sorted(name for share in shares for name in share) == sorted({n for share in shares for n in share})
    assert len({n for share in shares for n in share}) == WEIGHTS
    assert all(share for share in shares), f"a rank quantized nothing: {shares}"


LOADING_WORKER = Path(__file__).with_name("loading_worker.py")


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_moe"])
def test_biases_of_split_hqq_layers_are_loaded(arch: str, tiny_model: Path, tmp_path: Path) -> None:
    """q/k/v biases of HQQ layers on 2 ranks: each bias is the checkpoint's, not a weight share's. (The split
    loading once handed a bias to the weight's owner as if it were the weight: unset biases and wrong logits.)"""
    from scripts.make_tiny_model import build_tiny_model
    from tests.moe_models import build_moe_model

    model = tmp_path / arch
    if arch == "qwen2":
        build_tiny_model(model, arch="qwen2", seed=3)
    else:
        build_moe_model("qwen2_moe", model, tokenizer_from=tiny_model, seed=1)
    result = launch(LOADING_WORKER, [str(model), str(tmp_path)], nproc=2)
    assert result.returncode == 0, result.stderr[-6000:]
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["biases"] > 0
        assert report["mismatches"] == [], f"rank {rank}"
        assert report["logit_gap"] == 0.0
