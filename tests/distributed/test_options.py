"""Every training option on real 2- and 4-rank CPU jobs (one torchrun job each, many short trainings inside), under
both FSDP versions.

Each scenario is a set of flags over OVERFIT, defined here beside the tests that read its result (TWO for 2 ranks,
FOUR for 4); options_worker.py runs them. Each fp32 run's first step is checked against the same step computed
without sharding (options_worker's reference): loss and gradient norm. Other checks test what the option itself must
do: a dtype, a checkpoint's optimizer state, fewer saved activations, a count of collectives, which parameters train.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qlora_fsdp.config.options import choices
from tests.conftest import REPO_ROOT, launch, run_worker

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("options_worker.py")
# Two rows per step, the same two every step (batch 1 on each of 2 ranks). Chunks of 2 label tokens: every
# scenario's loss goes through the head in several chunks, and its reference uses whole logits.
OVERFIT = {
    "dataset": str(REPO_ROOT / "data" / "alpaca_tiny.jsonl"), "dataset_samples": 2, "batch_size": 1,
    "context_length": 64, "max_steps": 5, "lr": 0.01, "lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.0,
    "device": "cpu", "log_to": "stdout", "precision": "fp32", "quant": "bnb", "seed": 1, "loss_chunk_tokens": 2,
}  # fmt: skip
LORA_RANK = OVERFIT["lora_rank"]
LAYERS = 2  # the tiny models'
# The scenarios: name -> flags over OVERFIT, run in the order they are defined below. "model" names one of the
# `models` fixture's models (default "tiny").
TWO: dict[str, dict] = {}
FOUR: dict[str, dict] = {}
MEASURED = ("ckpt-off", "ckpt-nonreentrant", "ckpt-reentrant", "activation-offload")
"""Scenarios whose step-1 activations are counted (gradient checkpointing and activation offload must show)."""


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


@pytest.fixture(scope="module")
def odd_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Widths 100 and 200, k/v 20: no weight splits into HQQ's 64-groups (nor, for most, bnb's 64-blocks)."""
    from scripts.make_tiny_model import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-odd"), hidden_size=100, intermediate_size=200, num_heads=10, num_kv_heads=2
    )


SCENARIOS: tuple[str, ...] | None = None
"""The two-rank scenarios this module runs (None: every one); test_options_fsdp1.py takes fewer."""


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`scenario` takes the referenced scenarios that the collecting module runs."""
    if "scenario" in metafunc.fixturenames:
        runs = metafunc.module.SCENARIOS
        metafunc.parametrize("scenario", [s for s in REFERENCED if runs is None or s in runs])


def _suite(scenarios: dict[str, dict], nproc: int, models: dict[str, Path], out: Path, version: int,
           names: tuple[str, ...] | None = None) -> dict[str, dict]:  # fmt: skip
    """Runs `scenarios` (those in `names`, if given) in one job of `nproc` ranks under FSDP `version`."""
    chosen = {}
    for name, flags in scenarios.items():
        if names is not None and name not in names:
            continue
        flags = {**OVERFIT, "fsdp_version": version, **flags}
        flags["model"] = str(models[flags.get("model", "tiny")])
        reference = nproc == 2 and flags["precision"] == "fp32"
        chosen[name] = {"flags": flags, "measure": name in MEASURED, "reference": reference}
    unknown = set(names or ()) - set(chosen)
    assert not unknown, f"no such scenario: {sorted(unknown)}"
    (out / "scenarios.json").write_text(json.dumps(chosen, indent=1))
    return run_worker(WORKER, [str(out / "scenarios.json"), str(out)], nproc=nproc, out=out)


@pytest.fixture(scope="module")
def version() -> int:
    """Every option is checked under both FSDP versions: FSDP2 here, FSDP1 in test_options_fsdp1.py."""
    return 2


@pytest.fixture(scope="module")
def models(tiny_model: Path, pro_model: Path, tied_model: Path, odd_model: Path) -> dict[str, Path]:
    return {"tiny": tiny_model, "pro": pro_model, "tied": tied_model, "odd": odd_model}


@pytest.fixture(scope="module")
def two(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, version: int, request: pytest.FixtureRequest
) -> dict[str, dict]:
    out = tmp_path_factory.mktemp(f"options-two-v{version}")
    return _suite(TWO, 2, models, out, version, request.module.SCENARIOS)


@pytest.fixture(scope="module")
def four(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, version: int) -> dict[str, dict]:
    return _suite(FOUR, 4, models, tmp_path_factory.mktemp(f"options-four-v{version}"), version)


def _checkpoint_tensors(model: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(model.glob("*.safetensors")) for k, v in load_file(f).items()}


def _lora_parameters(model: Path) -> int:
    """A and B of rank r on every projection: r x (in + out) each."""
    return sum(LORA_RANK * sum(t.shape) for k, t in _checkpoint_tensors(model).items() if k.endswith("proj.weight"))


REFERENCED = [name for name in (
    "precision-fp32-bnb", "precision-fp32-hqq", "sharding-full_shard", "sharding-shard_grad_op", "sharding-no_shard",
    "ckpt-off", "ckpt-nonreentrant", "ckpt-reentrant", "activation-offload", "accum-2x1", "accum-1x2",
    "optimizer-adam", "optimizer-sgd", "optimizer-adadelta", "optimizer-adamw", "dora-bnb", "dora-hqq",
    "odd-shapes-bnb", "odd-shapes-hqq", "full-finetune", "plain-lora", "llama-pro-hqq", "profile",
    "tied-embeddings", "optimizer-sgd-clipped", "schedule-cosine", "train-on-inputs", "prompt-guanaco",
    "prompt-qna", "dummy-dataset", "loss-whole-logits", "lora-on-head",
)]  # fmt: skip


def test_first_step_equals_the_unsharded_computation(two: dict, scenario: str) -> None:
    """Loss and gradient norm of step 1 on 2 ranks = the same batch through the unsharded model in one process."""
    r = two[scenario]
    assert len(r["losses"]) == 5
    assert r["losses"][0] == pytest.approx(r["reference"]["loss"], rel=1e-5), scenario
    assert r["grad_norms"][0] == pytest.approx(r["reference"]["grad_norm"], rel=1e-4), scenario
    assert r["losses"][-1] != r["losses"][0], "five steps changed nothing"


TWO["loss-whole-logits"] = {"loss_chunk_tokens": 0}


def test_chunked_loss_equals_whole_logits_on_two_ranks(two: dict) -> None:
    """--loss_chunk_tokens 2 (every scenario) against 0: the same first step to fp32 rounding, not just close."""
    chunked, whole = two["precision-fp32-bnb"], two["loss-whole-logits"]
    assert chunked["label_tokens"][0] > 2 * 2, "one chunk a rank would test nothing"
    assert chunked["losses"][0] == pytest.approx(whole["losses"][0], rel=1e-6)
    assert chunked["grad_norms"][0] == pytest.approx(whole["grad_norms"][0], rel=1e-6)


# FSDP2 only: FSDP1 refuses --compile (test_options_fsdp1.py's SCENARIOS leave it out). HQQ: its dequantization is
# plain PyTorch that inductor fuses (the GPU suite times bnb too); one compilation costs the suite a minute on 2 cores.
TWO["compile-hqq"] = {"compile": True, "quant": "hqq"}


def test_compiled_layers_compute_what_eager_layers_do(two: dict, version: int) -> None:
    """--compile true: dynamo really compiled the layers (from step 2 on), and they train as the eager ones do."""
    if version == 1:
        pytest.skip("FSDP1 refuses --compile (tests/unit/config/test_options.py checks the refusal)")
    compiled, eager = two["compile-hqq"], two["precision-fp32-hqq"]
    assert compiled["compiled_graphs"] > 0 and eager["compiled_graphs"] == 0
    # Steps 2-5 run compiled code (kernels fused by inductor): equal up to float reassociation.
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-4)
    assert compiled["grad_norms"] == pytest.approx(eager["grad_norms"], rel=1e-3)


TWO["lora-on-head"] = {"lora_target_modules": "q_proj,v_proj,lm_head"}


def test_lora_on_the_head_trains_the_head(two: dict) -> None:
    """The chunked loss's checkpointed path (a head that trains): the head's B, zero at the start, has moved."""
    saved = load_file(Path(two["lora-on-head"]["output_dir"]) / "adapter_model.safetensors")
    (head_b,) = [k for k in saved if "lm_head" in k and "lora_B" in k]
    assert saved[head_b].abs().sum() > 0


TWO.update({f"precision-{p}-{q}": {"quant": q, "precision": p} for q in ("bnb", "hqq") for p in choices("precision")})


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
@pytest.mark.parametrize("precision", [p for p in choices("precision") if p != "fp32"])
def test_precision_mode_computes_close_to_fp32_in_its_own_dtype(two: dict, precision: str, quant: str) -> None:
    r, fp32 = two[f"precision-{precision}-{quant}"], two[f"precision-fp32-{quant}"]
    # Same model, same batch: half-precision compute moves the loss by well under 1%...
    assert r["losses"][0] == pytest.approx(fp32["losses"][0], rel=1e-2)
    # ...but does move it: the mode really computed in 16 bits.
    assert r["losses"][0] != fp32["losses"][0]
    if precision != "fp16_autocast":  # its scaler's first scale overflows (see the fp16 test)
        assert r["grad_norms"][0] == pytest.approx(fp32["grad_norms"][0], rel=5e-2)


def test_fp16_steps_the_scaler_skips_are_logged_as_skipped(two: dict) -> None:
    r = two["precision-fp16_autocast-bnb"]
    assert r["skipped"] == [not math.isfinite(g) for g in r["grad_norms"]]
    assert r["skipped"][0], "the scaler's initial scale 65536 overflows the first step's fp16 gradients"
    # The same two rows every step: a skipped step leaves the weights, hence the next loss, exactly as they were.
    assert r["losses"][1] == r["losses"][0]
    assert not r["skipped"][1] and r["losses"][2] != r["losses"][1]


TWO["fp16-nan-skip"] = {"precision": "fp16_autocast", "lr": 1e30, "nan_policy": "skip"}


def test_fp16_nan_policy_skip_keeps_going(two: dict) -> None:
    r = two["fp16-nan-skip"]
    assert len(r["losses"]) == 5 and any(not math.isfinite(loss) for loss in r["losses"])
    assert all(s for loss, s in zip(r["losses"], r["skipped"], strict=True) if not math.isfinite(loss))


def test_bf16_halves_exactly_the_unquantized_bytes(two: dict, tiny_model: Path) -> None:
    """Packed weights and their state are bytes either way; every other parameter (embeddings, head, norms, LoRA)
    takes 2 bytes instead of 4. Per rank, with two ranks: fp32 - bf16 = (4 - 2) x floats / 2."""
    floats = sum(t.numel() for k, t in _checkpoint_tensors(tiny_model).items() if not k.endswith("proj.weight"))
    floats += _lora_parameters(tiny_model)
    fp32, bf16 = two["precision-fp32-bnb"]["param_bytes"], two["precision-bf16-bnb"]["param_bytes"]
    for rank in range(2):
        assert fp32[rank] - bf16[rank] == pytest.approx(floats, rel=0.01)


TWO.update({f"sharding-{s}": {"sharding_strategy": s} for s in ("full_shard", "shard_grad_op", "no_shard")})
FOUR["four-full_shard"] = {"dataset_samples": 4, "sharding_strategy": "full_shard"}


def test_sharding_strategies_agree_and_full_shard_shrinks_with_world_size(two: dict, four: dict) -> None:
    reference = two["sharding-full_shard"]
    for strategy in ("shard_grad_op", "no_shard"):
        for key in ("losses", "grad_norms"):
            assert two[f"sharding-{strategy}"][key] == pytest.approx(reference[key], rel=1e-3), strategy
    whole = two["sharding-no_shard"]["param_bytes"][0]  # a full replica: what one rank holds alone
    at2 = two["sharding-full_shard"]["param_bytes"][0]
    at4 = four["four-full_shard"]["param_bytes"][0]
    assert at2 < whole and at4 < at2
    assert at2 <= whole / 2 * 1.05 and at4 <= whole / 4 * 1.1


FOUR["four-hybrid_shard"] = {"dataset_samples": 4, "sharding_strategy": "hybrid_shard", "shard_group_size": 2}
FOUR["four-hybrid_shard_zero2"] = {**FOUR["four-hybrid_shard"], "sharding_strategy": "hybrid_shard_zero2"}


def test_hybrid_sharding_on_four_ranks(four: dict) -> None:
    reference = four["four-full_shard"]
    for name in ("four-hybrid_shard", "four-hybrid_shard_zero2"):
        for key in ("losses", "grad_norms"):
            assert four[name][key] == pytest.approx(reference[key], rel=1e-3), name
        # 2 groups of 2: each rank holds half the model, twice what full sharding over 4 leaves it.
        assert four[name]["param_bytes"][0] == pytest.approx(2 * reference["param_bytes"][0], rel=0.05)


TWO["ckpt-off"] = {"gradient_checkpointing": False}
TWO["ckpt-nonreentrant"] = {"gradient_checkpointing": True, "reentrant_checkpointing": False}
TWO["ckpt-reentrant"] = {"gradient_checkpointing": True, "reentrant_checkpointing": True}
TWO["activation-offload"] = {"activation_offload": True, "gradient_checkpointing": False}


def test_memory_savers_save_fewer_activations_and_keep_the_losses(two: dict) -> None:
    off = two["ckpt-off"]
    for name in ("ckpt-nonreentrant", "ckpt-reentrant", "activation-offload"):
        assert two[name]["losses"] == pytest.approx(off["losses"], rel=1e-3), name
    # What autograd keeps for backward outside the layers: with checkpointing only the layers' inputs and what
    # lies outside them (embeddings, head); with offload everything goes through save_on_cpu's hooks.
    for name in ("ckpt-nonreentrant", "ckpt-reentrant"):
        assert two[name]["saved_bytes_per_step"] < 0.5 * off["saved_bytes_per_step"], name
    assert two["activation-offload"]["saved_bytes_per_step"] < 0.1 * off["saved_bytes_per_step"]


TWO["tiled-mlp"] = {"tiled_mlp": "3"}  # inside the layers' checkpoints: tiles recomputed within a recompute


def test_tiled_mlp_trains_as_the_untiled_mlp(two: dict) -> None:
    """--tiled_mlp 3 against the same flags untiled: every step's loss and gradient norm within 1e-6."""
    tiled, plain = two["tiled-mlp"], two["precision-fp32-bnb"]
    assert len(tiled["losses"]) == len(plain["losses"]) == 5
    assert tiled["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    assert tiled["grad_norms"] == pytest.approx(plain["grad_norms"], rel=1e-6)


TWO["accum-2x1"] = {"gradient_accumulation_steps": 2, "dataset_samples": 4}
TWO["accum-1x2"] = {"batch_size": 2, "dataset_samples": 4}


def test_accumulation_matches_larger_batch(two: dict) -> None:
    for key in ("losses", "grad_norms"):
        assert two["accum-2x1"][key] == pytest.approx(two["accum-1x2"][key], rel=1e-3)


# Each optimizer saves its state at step 5, so the test can see which optimizer really ran.
TWO["optimizer-adam"] = {"optimizer": "adam", "save_steps": 5}
TWO["optimizer-sgd"] = {"optimizer": "sgd", "lr": 1.0, "save_steps": 5}
TWO["optimizer-adadelta"] = {"optimizer": "adadelta", "lr": 10.0, "save_steps": 5}
TWO["optimizer-adamw"] = {"optimizer": "adamw", "wd": 0.1, "save_steps": 5}


def _optimizer_state(two: dict, name: str, tmp_path: Path) -> dict:
    """The optimizer state of the run's checkpoint, as DCP wrote it (all ranks' shards joined)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(Path(two[name]["output_dir"]) / "checkpoint-5" / "sharded", tmp_path / "state.pt")
    optim = torch.load(tmp_path / "state.pt", weights_only=False)["optim"]
    return {"state": {}, **optim}  # DCP leaves out an empty one (SGD without momentum)


@pytest.mark.parametrize(
    ("optimizer", "state_keys", "decoupled"),
    [("adam", {"step", "exp_avg", "exp_avg_sq"}, False), ("adamw", {"step", "exp_avg", "exp_avg_sq"}, True),
     ("adadelta", {"step", "square_avg", "acc_delta"}, None), ("sgd", set(), None)],
)  # fmt: skip
def test_the_optimizer_asked_for_is_the_one_that_ran(
    two: dict, optimizer: str, state_keys: set, decoupled: bool | None, tmp_path: Path
) -> None:
    state = _optimizer_state(two, f"optimizer-{optimizer}", tmp_path)
    kept = {k for s in state["state"].values() for k, v in s.items() if v is not None}
    assert kept == state_keys, kept
    group = state["param_groups"][0]
    if decoupled is not None:
        assert group["decoupled_weight_decay"] is decoupled
    assert group["weight_decay"] == (0.1 if optimizer == "adamw" else 0.0)


TWO.update({f"dora-{q}": {"train_type": "dora", "quant": q} for q in ("bnb", "hqq")})


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_dora_trains_on_quantized_base(two: dict, quant: str) -> None:
    dora, lora = two[f"dora-{quant}"]["losses"], two[f"precision-fp32-{quant}"]["losses"]
    # At step 1 DoRA's magnitude equals the row norms of the dequantized base weight and B is zero, so the
    # model is the base model: equal to LoRA's first loss only if the weight DoRA dequantizes under FSDP is right.
    assert dora[0] == pytest.approx(lora[0], rel=1e-5)
    assert dora[1:] != pytest.approx(lora[1:], rel=1e-3), "DoRA trained exactly like LoRA: magnitude ignored?"


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_dora_adapter_loads_in_peft(two: dict, quant: str, tiny_model: Path) -> None:
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    out = Path(two[f"dora-{quant}"]["output_dir"])
    saved = load_file(out / "adapter_model.safetensors")
    assert sum("lora_magnitude_vector" in k for k in saved) == 14  # one per adapted linear
    loaded = get_peft_model_state_dict(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), out))
    assert set(loaded) == set(saved)
    assert all(torch.equal(loaded[k].to(v.dtype), v) for k, v in saved.items())


# Layer widths of 100: no multiple of HQQ's group size or bnb's block size.
TWO.update({f"odd-shapes-{q}": {"model": "odd", "quant": q} for q in ("bnb", "hqq")})


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_odd_layer_widths_train_and_save_an_adapter_peft_loads(two: dict, quant: str, odd_model: Path) -> None:
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    out = Path(two[f"odd-shapes-{quant}"]["output_dir"])
    saved = load_file(out / "adapter_model.safetensors")
    loaded = get_peft_model_state_dict(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(odd_model), out))
    assert set(loaded) == set(saved) and all(loaded[k].shape == v.shape for k, v in saved.items())
    assert any(torch.count_nonzero(v) for k, v in saved.items() if "lora_B" in k), "nothing trained"


TWO["llama-pro-hqq"] = {"model": "pro", "train_type": "llama_pro", "quant": "hqq", "lr": 0.001}


def test_llama_pro_trains_only_the_new_block(two: dict, pro_model: Path) -> None:
    r = two["llama-pro-hqq"]
    original = _checkpoint_tensors(pro_model)
    new_block = {k: t for k, t in original.items() if k.startswith("model.layers.2.")}
    # Nothing but the added block trains: every old block and the embeddings stay frozen.
    assert r["trainable_parameters"] == sum(t.numel() for t in new_block.values())
    assert "llama_pro_blocks.safetensors" in r["files"] and "adapter_model.safetensors" not in r["files"]
    blocks = load_file(Path(r["output_dir"]) / "llama_pro_blocks.safetensors")
    assert set(blocks) == set(new_block)
    assert any(not torch.equal(blocks[k], new_block[k].to(blocks[k].dtype)) for k in blocks), "the block did not train"


def test_lora_trains_exactly_the_adapters(two: dict, tiny_model: Path) -> None:
    assert two["precision-fp32-bnb"]["trainable_parameters"] == _lora_parameters(tiny_model)


TWO["profile"] = {"profile": True, "profile_steps": "2,3"}


def _collectives_per_step(trace: Path, steps: int) -> dict[str, float]:
    names = Counter(e.get("name", "").split(" (")[0] for e in json.loads(trace.read_text())["traceEvents"])
    return {
        "fsdp_all_gathers": names["FSDP::all_gather"] / steps,
        "fsdp_reduce_scatters": names["FSDP::post_backward_reduce"] / steps,
        "gloo_all_gathers": names["gloo:all_gather"] / steps,
    }


def test_profile_traces_count_the_collectives_of_a_step(two: dict, version: int) -> None:
    """--profile_steps 2,3 traces two steps on every rank; FSDP2 gathers each unit at most twice and reduces each
    trainable unit once a step: at most 2L+1 all-gathers and L reduce-scatters for L decoder layers."""
    r = two["profile"]
    assert {"profile/trace-rank0.json", "profile/trace-rank1.json"} <= set(r["files"])
    counts = _collectives_per_step(Path(r["output_dir"]) / "profile" / "trace-rank0.json", steps=2)
    if version == 2:
        assert 0 < counts["fsdp_all_gathers"] <= 2 * LAYERS + 1, counts
        assert counts["fsdp_reduce_scatters"] == LAYERS, counts
    else:
        # FSDP1's units: a layer, each quantized module and each adapter leaf; its gathers show as gloo's.
        assert counts["gloo_all_gathers"] > 2 * LAYERS + 1, counts


def test_block_expansion_keeps_outputs(tiny_model: Path, pro_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(tiny_model)
    expanded = AutoModelForCausalLM.from_pretrained(pro_model)
    assert expanded.config.num_hidden_layers == original.config.num_hidden_layers + 1
    assert expanded.config.llama_pro_new_layers == [2]
    ids = torch.arange(3, 40).view(1, -1)
    with torch.no_grad():
        assert torch.equal(original(ids).logits, expanded(ids).logits)
    state = _checkpoint_tensors(pro_model)
    assert torch.count_nonzero(state["model.layers.2.self_attn.o_proj.weight"]) == 0
    assert torch.equal(state["model.layers.2.self_attn.q_proj.weight"], state["model.layers.1.self_attn.q_proj.weight"])


TWO["tied-embeddings"] = {"model": "tied"}


def test_tied_embeddings_train_and_save(two: dict) -> None:
    """A tied input/output embedding is one tensor with two owners: filled once, sharded once, matched step 1."""
    assert "adapter_model.safetensors" in two["tied-embeddings"]["files"]


TWO["optimizer-sgd-clipped"] = {"optimizer": "sgd", "lr": 1.0, "grad_norm": 0.01, "wd": 0.1}


def test_gradient_clipping_limits_the_update(two: dict) -> None:
    free, clipped = two["optimizer-sgd"]["losses"], two["optimizer-sgd-clipped"]["losses"]
    assert clipped[0] == pytest.approx(free[0], rel=1e-6)
    # SGD's step is proportional to the gradient, so clipping its norm to 0.01 must slow the descent.
    assert free[0] - free[-1] > 2 * (clipped[0] - clipped[-1])


TWO["schedule-cosine"] = {"lr_scheduler": "cosine", "warmup_ratio": 0.2, "cosine_min_lr_ratio": 0.1}
TWO["schedule-linear"] = {"lr_scheduler": "linear", "warmup_ratio": 0.2}


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_logged_learning_rates_follow_the_schedule(two: dict, schedule: str) -> None:
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


TWO["train-on-inputs"] = {"train_on_inputs": True}


def test_train_on_inputs_puts_prompt_tokens_in_the_loss(two: dict) -> None:
    base, full = two["precision-fp32-bnb"]["label_tokens"], two["train-on-inputs"]["label_tokens"]
    assert all(f > 2 * b for f, b in zip(full, base, strict=True)), (full, base)


TWO.update({f"prompt-{style}": {"prompt_style": style} for style in ("guanaco", "qna")})


@pytest.mark.parametrize("style", ["guanaco", "qna"])
def test_prompt_styles_change_the_prompt(two: dict, style: str) -> None:
    r, alpaca = two[f"prompt-{style}"], two["precision-fp32-bnb"]
    # Same rows, other template: other prompt tokens, so another first loss than the alpaca template's.
    assert r["losses"][0] != pytest.approx(alpaca["losses"][0], rel=1e-4)
    assert r["tokens"] != alpaca["tokens"]


TWO["dummy-dataset"] = {"dataset": "dummy", "dataset_samples": 4}


def test_dummy_dataset_fills_the_context(two: dict) -> None:
    # 2 rows per step, each long enough to be truncated to the 64-token context: no padding at all.
    assert two["dummy-dataset"]["tokens"] == [2 * 64] * 5


TWO["full-finetune"] = {"train_type": "full", "quant": "none", "lr": 0.001}


def test_full_finetune_trains_every_weight_and_saves_a_loadable_model(two: dict, tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    r = two["full-finetune"]
    assert r["trainable_parameters"] == sum(t.numel() for t in _checkpoint_tensors(tiny_model).values())
    trained = AutoModelForCausalLM.from_pretrained(r["output_dir"])
    original = AutoModelForCausalLM.from_pretrained(tiny_model)
    changed = [n for n, p in trained.named_parameters() if not torch.equal(p, original.get_parameter(n))]
    assert len(changed) == len(list(original.parameters())), "full fine-tuning left weights untouched"


TWO["plain-lora"] = {"quant": "none"}


def test_plain_lora_saves_an_adapter(two: dict) -> None:
    assert "adapter_model.safetensors" in two["plain-lora"]["files"]
