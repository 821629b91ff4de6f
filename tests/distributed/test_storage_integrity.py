"""Packed 4-bit storage survives streaming load, sharding (FSDP1 and FSDP2) and casting mixed precision bit for bit;
the controls show that a cast of the packed bytes is caught, by the test's own digests and by verify_packed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import UINT8_FSDP2, launch

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("storage_worker.py")
CASES = [
    *(f"v2-{q}-mp_bf16" for q in ("bnb", "hqq")),
    *(f"v2float-{q}-{p}" for q in ("bnb", "hqq") for p in ("mp_bf16", "fp32", "bf16")),
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
def test_fsdp2_shards_packed_bytes_and_state_in_the_layout_of_this_torch(reports: list[dict], case: str) -> None:
    """uint8 where FSDP2 can shard it (auto on 2.12+), else viewed as the dtype FSDP2 gathers in: bf16 under
    mp_bf16's policy, the parameter dtype without one. The state is sharded either way, and gathers back whole."""
    expected = {"mp_bf16": "torch.bfloat16", "fp32": "torch.float32", "bf16": "torch.bfloat16"}[case.split("-")[-1]]
    if case.startswith("v2-") and UINT8_FSDP2:
        expected = "torch.uint8"
    for report in reports:
        assert report[case]["storage_dtype"] == expected, report[case]["layout"]
        assert report[case]["state_parameters"], "FSDP2 should shard the quantization state with the weights"
    assert reports[0][case]["gathered_state_identical"]


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_nan_bit_patterns_in_a_bf16_view_survive_mixed_precision(reports: list[dict], quant: str) -> None:
    """The float view is only safe if FSDP2 moves the bytes without touching NaN patterns: the case has some."""
    r = reports[0][f"v2float-{quant}-mp_bf16"]
    assert r["nan_patterns"] > 0, "the control is void: no packed byte pair is a bf16 NaN"
    assert r["forward_identical"] and r["gathered_identical"]


def test_forcing_uint8_where_fsdp2_cannot_shard_it_is_refused_with_the_fix(reports: list[dict]) -> None:
    error = reports[0]["forced-uint8-error"]
    if UINT8_FSDP2:
        assert error is None
    else:
        assert "--packed_layout uint8" in error and "use --packed_layout auto" in error


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


def test_fsdp2_would_cast_a_float_view_of_another_dtype_than_it_gathers_in(reports: list[dict]) -> None:
    for report in reports:
        r = report["control-v2-float-storage"]
        assert r["storage_dtype"] == "torch.float32" and r["forward_dtypes"] == ["torch.bfloat16"]
        assert "packed dtype torch.bfloat16, was torch.float32" in r["error"]
