"""qlora_fsdp.lora (targets, injection, adapter keys) and qlora_fsdp.metrics (peak memory, metrics.jsonl)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import get_peft_model_state_dict
from torch import nn

from qlora_fsdp.config import LoraConfig, ModelConfig, OutputConfig, QuantConfig
from qlora_fsdp.distributed import DistEnv
from qlora_fsdp.errors import UserError
from qlora_fsdp.lora import adapter_keys, inject_lora, target_modules
from qlora_fsdp.metrics import METRICS_FILE, MetricsLogger, peak_memory_bytes, read_metrics
from qlora_fsdp.model import load_model
from qlora_fsdp.quant import QuantBackend, make_backend

CPU = torch.device("cpu")
LLAMA_LINEARS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
NUM_LAYERS = 2  # the session tiny model


def loaded(path: Path, quant: str) -> tuple[QuantBackend | None, nn.Module]:
    backend = make_backend(QuantConfig(quant=quant), storage_dtype=torch.bfloat16, compute_dtype=torch.bfloat16)
    result = load_model(
        ModelConfig(model=str(path)),
        backend=backend,
        env=DistEnv(0, 0, 1, 1, CPU, "gloo"),
        param_dtype=torch.bfloat16,
    )
    return backend, result.model


@pytest.fixture(scope="module")
def read_only_models(tiny_model: Path):
    """quant -> (backend, model), loaded once per module, for tests that never modify the model."""
    cache: dict[str, tuple[QuantBackend | None, nn.Module]] = {}

    def get(quant: str) -> tuple[QuantBackend | None, nn.Module]:
        if quant not in cache:
            cache[quant] = loaded(tiny_model, quant)
        return cache[quant]

    return get


def classes_of(backend: QuantBackend | None) -> tuple[type[nn.Module], ...]:
    return (nn.Linear, *(backend.module_classes if backend else ()))


# --- target_modules -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("quant", ["bnb", "hqq", "none"])
def test_all_targets_every_projection_but_the_head(read_only_models, quant: str) -> None:
    backend, model = read_only_models(quant)
    names = target_modules("all", model, classes_of(backend))
    assert sorted(names) == LLAMA_LINEARS
    assert "lm_head" not in names


def test_all_needs_the_quantized_classes(read_only_models) -> None:
    # Quantized HQQ layers are not nn.Linear: only the classes passed in are found.
    backend, model = read_only_models("hqq")
    assert target_modules("all", model, (nn.Linear,)) == []
    assert sorted(target_modules("all", model, backend.module_classes)) == LLAMA_LINEARS


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("q_proj, v_proj", ["q_proj", "v_proj"]),
        ("q_proj,v_proj", ["q_proj", "v_proj"]),
        (" q_proj , ,v_proj, ", ["q_proj", "v_proj"]),
        ("down_proj", ["down_proj"]),
    ],
)
def test_explicit_targets_are_parsed(spec: str, expected: list[str]) -> None:
    assert target_modules(spec, nn.Module(), (nn.Linear,)) == expected


# --- inject_lora and adapter_keys ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_only_adapters_train_in_the_requested_dtype(tiny_model: Path, quant: str, dtype: torch.dtype) -> None:
    backend, model = loaded(tiny_model, quant)
    cfg = LoraConfig(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0)
    peft_model = inject_lora(model, cfg, dtype=dtype, quantized_classes=backend.module_classes)
    trainable = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in peft_model.named_parameters() if not p.requires_grad}
    # A and B for each of 7 projections in each layer.
    assert len(trainable) == 2 * len(LLAMA_LINEARS) * NUM_LAYERS
    for name, param in trainable.items():
        assert ".lora_A." in name or ".lora_B." in name, name
        assert param.dtype == dtype, name
        assert not param.is_meta, name
    assert not [n for n in frozen if "lora_" in n]
    assert any("lm_head" in n for n in frozen)
    assert not any("lm_head" in n for n in trainable)
    # Shapes follow the rank: A is [r, in], B is [out, r]; B starts at zero so the model starts unchanged.
    q = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert tuple(q.lora_A["default"].weight.shape) == (4, 128)
    assert tuple(q.lora_B["default"].weight.shape) == (128, 4)
    assert torch.count_nonzero(q.lora_B["default"].weight) == 0
    assert backend.is_quantized(q.base_layer)


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_explicit_targets_get_the_only_adapters(tiny_model: Path, quant: str) -> None:
    backend, model = loaded(tiny_model, quant)
    cfg = LoraConfig(lora_rank=2, lora_dropout=0.0, lora_target_modules="q_proj, v_proj")
    peft_model = inject_lora(model, cfg, dtype=torch.float32, quantized_classes=backend.module_classes)
    owners = {n.split(".lora_")[0].rpartition(".")[2] for n, p in peft_model.named_parameters() if p.requires_grad}
    assert owners == {"q_proj", "v_proj"}
    assert sum(p.requires_grad for p in peft_model.parameters()) == 2 * 2 * NUM_LAYERS


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_adapters_change_the_output(tiny_model: Path, quant: str) -> None:
    backend, model = loaded(tiny_model, quant)
    cfg = LoraConfig(lora_rank=2, lora_alpha=2.0, lora_dropout=0.0)
    peft_model = inject_lora(model, cfg, dtype=torch.bfloat16, quantized_classes=backend.module_classes).eval()
    ids = torch.tensor([[4, 9, 33, 120, 7]])
    with torch.no_grad():
        before = peft_model(input_ids=ids).logits.float()
        for name, param in peft_model.named_parameters():
            if ".lora_B." in name:
                param.fill_(0.05)
        after = peft_model(input_ids=ids).logits.float()
    assert torch.isfinite(before).all() and torch.isfinite(after).all()
    assert (after - before).abs().max() > 1e-3


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_adapter_keys_are_peft_saved_keys(tiny_model: Path, quant: str) -> None:
    backend, model = loaded(tiny_model, quant)
    cfg = LoraConfig(lora_rank=4)
    peft_model = inject_lora(model, cfg, dtype=torch.float32, quantized_classes=backend.module_classes)
    keys = adapter_keys(peft_model)
    saved = get_peft_model_state_dict(peft_model)
    qualified = {id(p): n for n, p in peft_model.named_parameters()}
    mapped = []
    for module, by_name in keys.items():
        assert set(by_name) == {n for n, _ in module.named_parameters(recurse=False)}
        for name, key in by_name.items():
            param = getattr(module, name)
            assert param.requires_grad
            # PEFT saves "<path>.lora_A.weight": the parameter's qualified name without the adapter name.
            assert key == qualified[id(param)].replace(".default.", "."), key
            assert torch.equal(saved[key], param.detach()), key
            mapped.append(key)
    assert len(mapped) == len(set(mapped))
    assert set(mapped) == set(saved)
    trainable = {id(p) for p in peft_model.parameters() if p.requires_grad}
    assert {id(getattr(m, n)) for m, d in keys.items() for n in d} == trainable


@pytest.mark.parametrize("quant", ["bnb", "none"])
def test_unknown_target_names_the_flag(tiny_model: Path, quant: str) -> None:
    backend, model = loaded(tiny_model, quant)
    cfg = LoraConfig(lora_target_modules="qkv_proj")
    with pytest.raises(UserError) as info:
        inject_lora(model, cfg, dtype=torch.float32, quantized_classes=classes_of(backend)[1:])
    assert "--lora_target_modules" in str(info.value)
    assert "qkv_proj" in str(info.value)


# --- metrics -------------------------------------------------------------------------------------------------------


def test_peak_memory_is_positive_and_covers_a_live_tensor() -> None:
    before = peak_memory_bytes(CPU)
    assert before > 0
    size = 64 * 2**20
    block = torch.ones(size, dtype=torch.uint8)  # written, so its pages are resident
    after = peak_memory_bytes(CPU)
    assert after >= before
    # Bytes, not KiB: the high-water mark includes the 64 MiB block that is alive right now.
    assert after >= size
    assert int(block[-1]) == 1


def record(step: int) -> dict[str, float | int]:
    return {"step": step, "loss": 2.5 - 0.25 * step, "lr": 1e-4 * step, "tokens_per_s": 1000.0 + step, "peak": 7}


def test_metrics_logger_writes_one_json_line_per_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logger = MetricsLogger(
        OutputConfig(log_to="stdout"), output_dir=tmp_path, is_main=True, total_steps=3, run_config={"lr": 1e-4}
    )
    records = [record(s) for s in (1, 2, 3)]
    for r in records:
        logger.log(r)
    logger.close()
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert len(lines) == 3
    assert [json.loads(line) for line in lines] == records
    assert read_metrics(tmp_path) == records
    out = capsys.readouterr().out
    step_lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(step_lines) == 3
    assert step_lines[0].startswith("step 1 loss 2.2500")


def test_metrics_logger_off_main_rank_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logger = MetricsLogger(
        OutputConfig(log_to="stdout"), output_dir=tmp_path, is_main=False, total_steps=2, run_config={}
    )
    logger.log(record(1))
    logger.message("hello")
    logger.close()
    assert not (tmp_path / METRICS_FILE).exists()
    assert list(tmp_path.iterdir()) == []
    assert capsys.readouterr().out == ""
