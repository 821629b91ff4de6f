"""The core path end to end: torchrun, 2 CPU ranks, bnb and HQQ, FSDP1 and FSDP2, down to an adapter PEFT loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qlora_fsdp.train.metrics import read_metrics
from tests.conftest import DATASET, train

pytestmark = pytest.mark.distributed

STEPS = 30
COMMON = [
    "--dataset", str(DATASET), "--precision", "fp32", "--context_length", "96", "--lr", "0.01",
    "--lora_rank", "16", "--lora_alpha", "32", "--lora_dropout", "0", "--lr_scheduler", "constant",
    "--device", "cpu", "--log_to", "stdout", "--seed", "7",
]  # fmt: skip


RUNS = [("bnb", 2), ("hqq", 2), ("bnb", 1), ("hqq", 1)]
_RUNS: dict[tuple[str, int], tuple[Path, object]] = {}


def run_two_ranks(quant: str, version: int, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """30 steps on 2 ranks x batch 1 (global batch 2), the product's main path; each run once per session, under
    torchrun itself (the other files' launches fork their ranks from tests/warm_launcher.py)."""
    if (quant, version) not in _RUNS:
        out = tmp_path_factory.mktemp(f"run-{quant}-v{version}")
        args = ["--model", str(tiny_model), "--quant", quant, "--fsdp_version", str(version), "--batch_size", "1",
                "--max_steps", str(STEPS)]  # fmt: skip
        _RUNS[quant, version] = out, train([*args, *COMMON, "--output_dir", str(out)], nproc=2, cold=True)
    return _RUNS[quant, version]


# The 5-minute tier (scripts/test.sh --fast) takes the default FSDP2 runs of both backends.
@pytest.fixture(
    scope="module",
    params=[pytest.param(r, marks=[pytest.mark.fast] if r[1] == 2 else []) for r in RUNS],
    ids=[f"{q}-fsdp{v}" for q, v in RUNS],
)
def two_rank_run(request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    quant, version = request.param
    out, result = run_two_ranks(quant, version, tiny_model, tmp_path_factory)
    return quant, version, out, result


def test_loss_falls(two_rank_run) -> None:
    _, _, out, _ = two_rank_run
    losses = [r["loss"] for r in read_metrics(out)]
    assert len(losses) == STEPS
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first, f"loss did not fall: first 5 mean {first:.4f}, last 5 mean {last:.4f}"


def test_the_run_prints_no_warning_and_no_line_twice(two_rank_run) -> None:
    """What the user reads of a 2-rank run: no warning from anyone (ours or a library's, on any rank), and each
    line once (rank 0 alone speaks)."""
    _, _, _, result = two_rank_run
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert not [line for line in lines if "warn" in line.lower()], lines
    assert len(lines) == len(set(lines)), [line for line in lines if lines.count(line) > 1]


def test_metrics_records_have_required_fields(two_rank_run) -> None:
    _, _, out, _ = two_rank_run
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert r["tokens_per_s"] > 0 and r["lr"] > 0 and r["loss"] > 0
        assert len(r["peak_memory_bytes_per_rank"]) == 2 and min(r["peak_memory_bytes_per_rank"]) > 0
        assert r["peak_memory_bytes"] == r["peak_memory_bytes_per_rank"][0]


def test_adapter_loads_in_peft_without_key_mismatch(two_rank_run, tiny_model: Path) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    _, _, out, result = two_rank_run
    assert f"adapter saved to {out.resolve()}" in result.stdout + result.stderr
    saved = load_file(out / "adapter_model.safetensors")

    fresh = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), LoraConfig.from_pretrained(out))
    expected = set(get_peft_model_state_dict(fresh))
    assert set(saved) == expected, f"missing {expected - set(saved)}, unexpected {set(saved) - expected}"
    incompatible = set_peft_model_state_dict(fresh, saved)
    assert not incompatible.unexpected_keys
    assert not [k for k in incompatible.missing_keys if "lora_" in k]

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), out)
    state = get_peft_model_state_dict(loaded)
    for key, tensor in saved.items():
        assert torch.equal(state[key].to(tensor.dtype), tensor), key


def test_adapter_trained(two_rank_run) -> None:
    _, _, out, _ = two_rank_run
    saved = load_file(out / "adapter_model.safetensors")
    lora_b = [t for k, t in saved.items() if "lora_B" in k]
    assert lora_b and any(t.abs().sum() > 0 for t in lora_b), "every lora_B is still zero: nothing trained"
    # Every target of 'all' was adapted: 7 linears x 2 layers x (A, B).
    assert len(saved) == 7 * 2 * 2


def test_rank_equivalence(two_rank_run, tiny_model: Path, tmp_path: Path) -> None:
    """1 rank x batch 2 must reproduce the per-step losses AND gradient norms of 2 ranks x batch 1.

    A gradient off by the world size (a missing or doubled average) leaves the loss of step 1 alone; its norm is
    where it shows first, and it changes every later loss.
    """
    quant, version, out, _ = two_rank_run
    args = ["--model", str(tiny_model), "--quant", quant, "--fsdp_version", str(version), "--batch_size", "2",
            "--max_steps", "5", "--save_model", "false"]  # fmt: skip
    train([*args, *COMMON, "--output_dir", str(tmp_path)], nproc=0)
    single, sharded = read_metrics(tmp_path), read_metrics(out)[:5]
    for key in ("loss", "grad_norm"):
        one, two = [r[key] for r in single], [r[key] for r in sharded]
        assert one == pytest.approx(two, rel=1e-3), f"{key}: 1x2 {one} vs 2x1 {two}"
    assert not (tmp_path / "adapter_model.safetensors").exists()


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_fsdp2_matches_fsdp1(quant: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Same data, seed and fp32 math: the two sharding implementations must train the same model."""
    v1 = read_metrics(run_two_ranks(quant, 1, tiny_model, tmp_path_factory)[0])
    v2 = read_metrics(run_two_ranks(quant, 2, tiny_model, tmp_path_factory)[0])
    # Gradient norms are sums of squares over differently grouped shards (flat parameters vs per-parameter): fp32
    # rounding alone moves them by ~1e-5, still far below what a wrong gradient would.
    for key, rel in (("loss", 1e-5), ("grad_norm", 1e-4)):
        one, two = [r[key] for r in v1[:10]], [r[key] for r in v2[:10]]
        assert two == pytest.approx(one, rel=rel), f"{key}: FSDP1 {one} vs FSDP2 {two}"
