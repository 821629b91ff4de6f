"""Packed 4-bit storage survives low-memory loading, FSDP sharding and MixedPrecision bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import launch

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("storage_worker.py")
COMBOS = [f"{q}-{d}" for q in ("bnb", "hqq") for d in ("bf16", "fp16", "fp32")]


@pytest.fixture(scope="module")
def reports(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("storage")
    result = launch(WORKER, [str(tiny_model), str(out)], nproc=2)
    assert result.returncode == 0, result.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("combo", COMBOS)
def test_packed_weights_bit_identical_after_wrap(reports: list[dict], combo: str) -> None:
    storage = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}[combo.split("-")[1]]
    for rank, report in enumerate(reports):
        r = report[combo]
        assert r["error"] is None, f"rank {rank}: {r['error']}"
        assert r["modules"] == 14  # 7 linears x 2 layers
        assert r["quant_state_identical"], f"rank {rank}: quantization state differs from rank 0's"
        assert r["forward_identical"], f"rank {rank}: dequantized weight seen in forward differs from pre-wrap"
        assert r["unsharded_identical"], f"rank {rank}: dequantized weight after unsharding differs from pre-wrap"
        assert r["dtypes"] == [storage], f"rank {rank}: packed dtype changed to {r['dtypes']}"


def test_control_without_exclusion_is_detected(reports: list[dict]) -> None:
    """If MixedPrecision were allowed to cast the packed tensor, the checks above would fail."""
    for report in reports:
        r = report["control-bnb-fp32-not-ignored"]
        assert r["error"] is not None or not r["forward_identical"]
