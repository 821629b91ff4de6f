"""Packed 4-bit storage survives streaming load, sharding (FSDP1 and FSDP2) and casting mixed precision bit for bit;
the controls show that a cast of the packed bytes is caught, by the test's own digests and by verify_packed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import launch

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("storage_worker.py")
CASES = [
    *(f"v2-{q}-mp_bf16" for q in ("bnb", "hqq")),
    *(f"v1-{q}-{p}" for q in ("bnb", "hqq") for p in ("mp_bf16", "torch.bfloat16", "torch.float16", "torch.float32")),
]


@pytest.fixture(scope="module")
def reports(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("storage")
    result = launch(WORKER, [str(tiny_model), str(out)], nproc=2)
    assert result.returncode == 0, result.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", CASES)
def test_packed_bytes_bit_identical_in_forward_and_after_gathering(reports: list[dict], case: str) -> None:
    for rank, report in enumerate(reports):
        r = report[case]
        assert r["error"] is None, f"rank {rank}: {r['error']}"
        assert r["layers"] == 14  # 7 linears x 2 layers
        assert r["identical_across_ranks"], f"rank {rank}: loading produced other bytes than on rank 0"
        assert r["forward_identical"], f"rank {rank}: changed in forward: {r['forward_changed']}"
        assert r["forward_dtypes"] == [r["storage_dtype"]], f"rank {rank}: packed dtype cast to {r['forward_dtypes']}"
    assert reports[0][case]["gathered_identical"], "gathered packed bytes differ from what loading produced"
    if "-bnb-" in case:
        # Each rank quantized half of every weight's blocks: together exactly what one process computes.
        assert all(report[case]["bnb_matches_one_process"] for report in reports)


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("v2")])
def test_fsdp2_keeps_packed_bytes_as_uint8_under_a_casting_policy(reports: list[dict], case: str) -> None:
    assert reports[0][case]["storage_dtype"] == "torch.uint8"


def test_without_the_exclusion_mixed_precision_casts_the_bytes_and_verify_packed_says_so(reports: list[dict]) -> None:
    """FSDP1, mp_bf16, quantized layers not ignored: their fp32 float view reaches forward as bf16."""
    for report in reports:
        r = report["control-v1-not-ignored"]
        assert not r["forward_identical"] and r["forward_dtypes"] == ["torch.bfloat16"]
        assert "packed dtype torch.bfloat16, was torch.float32" in r["error"]


def test_a_same_size_cast_is_silent_without_verify_packed_and_caught_with_it(reports: list[dict]) -> None:
    """bf16 bytes cast to fp16: same size, so the forward runs on wrong weights unless verify_packed stops it."""
    for report in reports:
        silent = report["control-v1-same-size-cast-verify-False"]
        assert silent["error"] is None, "the control should not crash: its corruption is silent"
        assert len(silent["forward_changed"]) == 14, "every quantized layer computed with rewritten bytes"
        caught = report["control-v1-same-size-cast-verify-True"]
        assert "packed dtype torch.float16, was torch.bfloat16" in caught["error"]
        # verify_packed stopped the forward at the first layer, before it computed anything with it.
        assert caught["forward_changed"] == ["model.layers.0.self_attn.q_proj"]


def test_fsdp2_would_cast_a_float_view_which_is_why_it_stores_uint8(reports: list[dict]) -> None:
    for report in reports:
        r = report["control-v2-float-storage"]
        assert r["storage_dtype"] == "torch.float32" and r["forward_dtypes"] == ["torch.bfloat16"]
        assert "packed dtype torch.bfloat16, was torch.float32" in r["error"]
