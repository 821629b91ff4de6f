"""Every training option on real 2- and 4-rank CPU jobs (one torchrun job each, many short trainings inside)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qlora_fsdp.config import PRECISIONS
from tests.conftest import REPO_ROOT, launch

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("options_worker.py")


@pytest.fixture(scope="module")
def pro_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-pro")
    result = launch(REPO_ROOT / "scripts" / "block_expansion.py",
                    ["--model", str(tiny_model), "--output", str(out), "--expansion_rate", "0.5"], nproc=0)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from scripts.make_tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-tied"), tie_word_embeddings=True)


def _suite(name: str, nproc: int, models: list[Path], out: Path, version: int) -> dict[str, dict]:
    result = launch(WORKER, [*map(str, models), str(out), name, str(version)], nproc=nproc, timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]
    results = json.loads((out / "results.json").read_text())
    failed = {k: v["error"] for k, v in results.items() if v["error"]}
    assert not failed, failed
    return results


@pytest.fixture(scope="module", params=[2, 1], ids=["fsdp2", "fsdp1"])
def version(request: pytest.FixtureRequest) -> int:
    """Every option is checked under both FSDP versions."""
    return request.param


@pytest.fixture(scope="module")
def two(
    tiny_model: Path, pro_model: Path, tied_model: Path, tmp_path_factory: pytest.TempPathFactory, version: int
) -> dict[str, dict]:
    out = tmp_path_factory.mktemp(f"options-two-v{version}")
    return _suite("two", 2, [tiny_model, pro_model, tied_model], out, version)


@pytest.fixture(scope="module")
def four(
    tiny_model: Path, pro_model: Path, tied_model: Path, tmp_path_factory: pytest.TempPathFactory, version: int
) -> dict[str, dict]:
    out = tmp_path_factory.mktemp(f"options-four-v{version}")
    return _suite("four", 4, [tiny_model, pro_model, tied_model], out, version)


def falls(losses: list[float]) -> bool:
    return len(losses) == 5 and losses[-1] < losses[0] and min(losses[1:]) < losses[0]


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_precision_mode_trains(two: dict, precision: str, quant: str) -> None:
    """Each mode trains (the packed-storage check after wrapping runs inside every run and would have failed it)."""
    r = two[f"precision-{precision}-{quant}"]
    assert falls(r["losses"]), r["losses"]


def test_bf16_parameters_halve_resident_bytes(two: dict) -> None:
    fp32, bf16 = two["precision-fp32-bnb"]["param_bytes"][0], two["precision-bf16-bnb"]["param_bytes"][0]
    # Packed storage follows the parameter dtype in bytes per element but holds the same bits: only the
    # unquantized parameters shrink, so the total shrinks but not by half.
    assert bf16 < fp32


def test_sharding_strategies_agree_and_full_shard_shrinks_with_world_size(two: dict, four: dict) -> None:
    reference = two["sharding-full_shard"]["losses"]
    for strategy in ("shard_grad_op", "no_shard"):
        assert two[f"sharding-{strategy}"]["losses"] == pytest.approx(reference, rel=1e-3), strategy
    whole = two["sharding-no_shard"]["param_bytes"][0]  # a full replica: what one rank holds alone
    at2 = two["sharding-full_shard"]["param_bytes"][0]
    at4 = four["four-full_shard"]["param_bytes"][0]
    assert at2 < whole and at4 < at2
    assert at2 <= whole / 2 * 1.05 and at4 <= whole / 4 * 1.1


def test_hybrid_sharding_on_four_ranks(four: dict) -> None:
    reference = four["four-full_shard"]["losses"]
    for name in ("four-hybrid_shard", "four-hybrid_shard_zero2"):
        assert four[name]["losses"] == pytest.approx(reference, rel=1e-3), name
        # 2 groups of 2: each rank holds half the model, twice what full sharding over 4 leaves it.
        assert four[name]["param_bytes"][0] == pytest.approx(2 * four["four-full_shard"]["param_bytes"][0], rel=0.05)


def test_memory_savers_keep_losses(two: dict) -> None:
    reference = two["ckpt-off"]["losses"]
    for name in ("ckpt-nonreentrant", "ckpt-reentrant", "activation-offload"):
        assert two[name]["losses"] == pytest.approx(reference, rel=1e-3), name


def test_accumulation_matches_larger_batch(two: dict) -> None:
    assert two["accum-2x1"]["losses"] == pytest.approx(two["accum-1x2"]["losses"], rel=1e-3)


@pytest.mark.parametrize("optimizer", ["adam", "sgd", "adadelta"])
def test_optimizers_train(two: dict, optimizer: str) -> None:
    assert falls(two[f"optimizer-{optimizer}"]["losses"]), two[f"optimizer-{optimizer}"]["losses"]


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_dora_trains_on_quantized_base(two: dict, quant: str) -> None:
    dora, lora = two[f"dora-{quant}"]["losses"], two[f"precision-fp32-{quant}"]["losses"]
    assert falls(dora), dora
    # At step 1 DoRA's magnitude equals the column norms of the dequantized base weight and B is zero, so the
    # model is the base model: equal to LoRA's first loss only if the weight DoRA dequantizes under FSDP is right.
    assert dora[0] == pytest.approx(lora[0], rel=1e-5)
    assert dora[1:] != pytest.approx(lora[1:], rel=1e-3), "DoRA trained exactly like LoRA: magnitude ignored?"


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_dora_adapter_loads_in_peft(two: dict, quant: str, tiny_model: Path) -> None:
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = Path(two[f"dora-{quant}"]["output_dir"])
    saved = load_file(out / "adapter_model.safetensors")
    assert sum("lora_magnitude_vector" in k for k in saved) == 14  # one per adapted linear
    loaded = get_peft_model_state_dict(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), out))
    assert set(loaded) == set(saved)
    assert all(torch.equal(loaded[k].to(v.dtype), v) for k, v in saved.items())


def test_llama_pro_trains_only_new_blocks(two: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    r = two["llama-pro-hqq"]
    assert falls(r["losses"]), r["losses"]
    assert "llama_pro_blocks.safetensors" in r["files"] and "adapter_model.safetensors" not in r["files"]


def test_profile_writes_chrome_traces(two: dict) -> None:
    assert {"trace-rank0.json", "trace-rank1.json"} <= set(two["profile"]["files"])


def test_block_expansion_keeps_outputs(tiny_model: Path, pro_model: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(tiny_model)
    expanded = AutoModelForCausalLM.from_pretrained(pro_model)
    assert expanded.config.num_hidden_layers == original.config.num_hidden_layers + 1
    assert expanded.config.llama_pro_new_layers == [2]
    ids = torch.arange(3, 40).view(1, -1)
    with torch.no_grad():
        assert torch.equal(original(ids).logits, expanded(ids).logits)
    state = {}
    for shard in pro_model.glob("*.safetensors"):
        state.update(load_file(shard))
    assert torch.count_nonzero(state["model.layers.2.self_attn.o_proj.weight"]) == 0
    assert torch.equal(state["model.layers.2.self_attn.q_proj.weight"], state["model.layers.1.self_attn.q_proj.weight"])


def test_tied_embeddings_train_on_two_ranks(two: dict) -> None:
    """A tied input/output embedding is one tensor with two owners: synced once, trained, saved."""
    r = two["tied-embeddings"]
    assert falls(r["losses"]), r["losses"]
    assert "adapter_model.safetensors" in r["files"]


def test_fp16_skip_policy_survives_non_finite_steps(two: dict) -> None:
    r = two["fp16-nan-skip"]
    assert len(r["losses"]) == 5 and any(loss != loss for loss in r["losses"])  # NaN != NaN


def test_gradient_clipping_limits_the_update(two: dict) -> None:
    free, clipped = two["optimizer-sgd"]["losses"], two["optimizer-sgd-clipped"]["losses"]
    assert clipped[0] == pytest.approx(free[0], rel=1e-6)
    # SGD's step is proportional to the gradient, so clipping its norm to 0.01 must slow the descent.
    assert free[0] - free[-1] > 2 * (clipped[0] - clipped[-1])


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_logged_learning_rates_follow_the_schedule(two: dict, schedule: str) -> None:
    import math

    total, warmup, peak, floor = 5, 1, 0.01, 0.1  # warmup = ceil(0.2 * 5)
    expected = []
    for step in range(total):
        if step < warmup:
            factor = (step + 1) / warmup
        else:
            progress = (step - warmup) / (total - warmup)
            factor = (
                floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
            )
        expected.append(peak * factor)
    assert two[f"schedule-{schedule}"]["lrs"] == pytest.approx(expected, rel=1e-9)


def test_train_on_inputs_puts_prompt_tokens_in_the_loss(two: dict) -> None:
    base, full = two["precision-fp32-bnb"]["label_tokens"], two["train-on-inputs"]["label_tokens"]
    assert all(f > 2 * b for f, b in zip(full, base, strict=True)), (full, base)
    assert falls(two["train-on-inputs"]["losses"])


@pytest.mark.parametrize("style", ["guanaco", "qna"])
def test_prompt_styles_train(two: dict, style: str) -> None:
    r = two[f"prompt-{style}"]
    assert falls(r["losses"]), r["losses"]
    # Same rows, other template: other prompt tokens, so another first loss than the alpaca template's.
    assert r["losses"][0] != pytest.approx(two["precision-fp32-bnb"]["losses"][0], rel=1e-4)


def test_dummy_dataset_fills_the_context(two: dict) -> None:
    r = two["dummy-dataset"]
    # 2 rows per step, each long enough to be truncated to the 64-token context: no padding at all.
    assert r["tokens"] == [2 * 64] * 5, r["tokens"]
    assert falls(r["losses"]), r["losses"]


def test_full_finetune_saves_a_loadable_model(two: dict, tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    r = two["full-finetune"]
    assert falls(r["losses"]), r["losses"]
    trained = AutoModelForCausalLM.from_pretrained(r["output_dir"])
    original = AutoModelForCausalLM.from_pretrained(tiny_model)
    changed = [n for n, p in trained.named_parameters() if not torch.equal(p, original.get_parameter(n))]
    assert len(changed) == len(list(original.parameters())), "full fine-tuning left weights untouched"


def test_plain_lora_without_quantization(two: dict) -> None:
    r = two["plain-lora"]
    assert falls(r["losses"]) and "adapter_model.safetensors" in r["files"]
