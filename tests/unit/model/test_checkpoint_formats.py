"""Quantized checkpoints as the hub ships them (qlora_fsdp/model/formats/): pre-quantized bitsandbytes 4-bit, FP8
and gpt-oss's MXFP4 experts, each written in the hub's layout (tests/quantized_checkpoints.py).

The bar is transformers' own loading of the same files: the first step's loss, adapters fresh, equals the mean
label loss of `from_pretrained`'s model on the same rows. A pre-quantized 4-bit weight trained with --quant bnb is
the file's bytes and state, by digest, and so are kept MXFP4 experts; anything else quantized is refused in one
line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qlora_fsdp.checkpoint.manifest import layer_digests, tensor_digest
from qlora_fsdp.config.options import ModelConfig, QuantConfig, build_config
from qlora_fsdp.errors import UserError
from qlora_fsdp.model.formats import checkpoint_format, kept_experts_layer
from qlora_fsdp.model.streaming import load_model
from qlora_fsdp.quant import make_backend
from qlora_fsdp.quant.base import QuantizedLinear
from qlora_fsdp.train.metrics import read_metrics
from qlora_fsdp.train.trainer import run
from tests.parity import label_loss_sum, step_batches
from tests.quantized_checkpoints import (
    bnb_4bit_checkpoint,
    e2m1_encode,
    file_digests,
    fp4_expert_digests,
    fp8_checkpoint,
    mxfp4_checkpoint,
    mxfp4_digests,
)
from tests.unit.model.conftest import ROWS

CONTEXT = 128
BNB = {
    "nf4-double-uint8": {"quant_type": "nf4", "double_quant": True},
    "nf4-double-bf16": {"quant_type": "nf4", "double_quant": True, "storage": torch.bfloat16},
    "fp4": {"quant_type": "fp4", "double_quant": False},
}
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized")
    made = {name: bnb_4bit_checkpoint(tiny_model, root / name, **kw) for name, kw in BNB.items()}
    made["fp8-block"] = fp8_checkpoint(tiny_model, root / "fp8-block", block=(16, 16))
    made["fp8-tensor"] = fp8_checkpoint(tiny_model, root / "fp8-tensor", block=None)
    return made


@pytest.fixture(scope="module")
def deepseek_fp8(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """A tiny DeepSeek-V3 whose experts are stored one tensor per expert, each FP8 with its scales."""
    from tests.moe_models import build_moe_model

    root = tmp_path_factory.mktemp("deepseek")
    dense = build_moe_model("deepseek_v3", root / "dense", tokenizer_from=tiny_model)
    return fp8_checkpoint(dense, root / "fp8", block=(8, 8))


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """A tiny gpt-oss whose routed experts are MXFP4 blocks and scales, as gpt-oss ships them."""
    from tests.moe_models import build_moe_model

    root = tmp_path_factory.mktemp("gpt-oss")
    return mxfp4_checkpoint(build_moe_model("gpt_oss", root / "dense", tokenizer_from=tiny_model), root / "mxfp4")


def transformers_label_loss(model: Path, rows: Path) -> float:
    """The mean label loss over the run's rows of transformers' own loading of `model` (fp32)."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, device_map="cpu").eval()
    total, count = torch.zeros(()), 0
    with torch.no_grad():
        for batch in step_batches(model, rows, context=CONTEXT, rows=ROWS):
            loss, n = label_loss_sum(reference, batch)
            total, count = total + loss, count + n
    return (total / count).item()


def first_loss(model: Path, rows: Path, out: Path, quant: str, **flags: object) -> float:
    """The logged loss of one step over all ROWS rows, fp32, fresh adapters, in this process."""
    cfg = {"model": str(model), "quant": quant, "dataset": str(rows), "batch_size": ROWS,
           "context_length": CONTEXT, "max_steps": 1, "precision": "fp32", "lora_rank": 4, "device": "cpu",
           "log_to": "stdout", "output_dir": str(out), "save_model": False, **flags}  # fmt: skip
    run(build_config(cfg).validate())
    return read_metrics(out)[0]["loss"]


@pytest.mark.parametrize("quant", ["bnb", "none"])
@pytest.mark.parametrize("layout", list(BNB))
def test_pre_quantized_bnb_loss_equals_transformers(no_launcher: None, checkpoints: dict[str, Path], rows: Path,
                                                     tmp_path: Path, layout: str, quant: str) -> None:  # fmt: skip
    """--quant bnb trains on the file's bytes, --quant none on their exact dequantization: both are what
    transformers' 4-bit model computes."""
    model = checkpoints[layout]
    ours = first_loss(model, rows, tmp_path, quant)
    assert ours == pytest.approx(transformers_label_loss(model, rows), rel=2e-4)


@pytest.mark.parametrize("layout", ["fp8-block", "fp8-tensor"])
def test_fp8_loss_equals_transformers(no_launcher: None, checkpoints: dict[str, Path], rows: Path, tmp_path: Path,
                                      layout: str) -> None:  # fmt: skip
    model = checkpoints[layout]
    assert first_loss(model, rows, tmp_path, "none") == pytest.approx(transformers_label_loss(model, rows), rel=2e-4)


def test_fp8_experts_of_deepseek_v3_loss_equals_transformers(no_launcher: None, deepseek_fp8: Path, rows: Path,
                                                             tmp_path: Path) -> None:  # fmt: skip
    """Each expert's FP8 weight is dequantized with its own scales before transformers' conversion fuses them."""
    ours = first_loss(deepseek_fp8, rows, tmp_path, "none", lora_target_modules="all")
    assert ours == pytest.approx(transformers_label_loss(deepseek_fp8, rows), rel=2e-4)


@pytest.mark.parametrize("mode", ["keep", "dequantize"])
def test_mxfp4_experts_loss_equals_transformers(no_launcher: None, gpt_oss_mxfp4: Path, rows: Path, tmp_path: Path,
                                               mode: str) -> None:  # fmt: skip
    """Kept, the experts compute from the file's bytes; dequantized, from their exact values: either way what
    transformers' dequantizing load computes."""
    ours = first_loss(gpt_oss_mxfp4, rows, tmp_path, "none", mxfp4=mode, lora_target_modules="all")
    assert ours == pytest.approx(transformers_label_loss(gpt_oss_mxfp4, rows), rel=2e-4)


def test_kept_mxfp4_experts_are_the_file_bit_for_bit(gpt_oss_mxfp4: Path) -> None:
    kept = kept_experts_layer(gpt_oss_mxfp4, QuantConfig(quant="bnb"), storage_dtype=torch.uint8,
                              compute_dtype=torch.float32)  # fmt: skip
    backend = make_backend(QuantConfig(quant="bnb"), storage_dtype=torch.uint8, compute_dtype=torch.float32)
    skeleton = load_model(ModelConfig(model=str(gpt_oss_mxfp4)), backend=backend, device=CPU,
                          param_dtype=torch.float32, kept_experts=kept)  # fmt: skip
    experts = {n: layer_digests(m) for n, m in skeleton.model.named_modules() if type(m).__name__ == "Mxfp4Linear"}
    assert len(experts) == 2 * 2 * 8  # layers x projections x experts
    assert experts == mxfp4_digests(gpt_oss_mxfp4)
    attention = skeleton.model.get_submodule("model.layers.0.self_attn.q_proj")
    assert type(attention).__name__ == "Bnb4bitLinear"  # everything else is quantized with --quant


@pytest.mark.parametrize("layout", list(BNB))
def test_pre_quantized_bnb_is_kept_bit_for_bit(checkpoints: dict[str, Path], layout: str) -> None:
    """No second rounding: every quantized layer holds the file's packed bytes and state (digests), and
    quantizing the dequantized weights again would have given other bytes (the control)."""
    model = checkpoints[layout]
    quant = checkpoint_format(model).quant_settings(QuantConfig(quant="bnb"), frozenset())
    backend = make_backend(quant, storage_dtype=torch.uint8, compute_dtype=torch.float32)
    skeleton = load_model(ModelConfig(model=str(model)), backend=backend, device=CPU, param_dtype=torch.float32)
    ours = {n: layer_digests(m) for n, m in skeleton.model.named_modules() if isinstance(m, QuantizedLinear)}
    assert ours == file_digests(model)
    layer = skeleton.model.get_submodule("model.layers.0.mlp.down_proj")
    again = backend.quantize(layer.dequantize())
    assert tensor_digest(again.packed) != ours["model.layers.0.mlp.down_proj"]["packed"] or not torch.equal(
        again.state["absmax"], layer.state_tensor("absmax")
    ), "requantizing reproduced the file's bytes: the control cannot tell kept from requantized"


def test_file_decides_the_4bit_type_unless_a_flag_contradicts_it(checkpoints: dict[str, Path]) -> None:
    fmt = checkpoint_format(checkpoints["fp4"])
    settled = fmt.quant_settings(QuantConfig(quant="bnb"), frozenset())
    assert (settled.bnb_quant_type, settled.bnb_double_quant) == ("fp4", False)
    given = build_config({"quant": "bnb", "bnb_quant_type": "nf4"})
    with pytest.raises(UserError, match=r"^--bnb_quant_type nf4 contradicts the checkpoint.*bnb_4bit_quant_type=fp4"):
        fmt.quant_settings(given.quant, given.given)
    # Any other --quant dequantizes the file: its flags stand, whatever the file says.
    assert fmt.quant_settings(QuantConfig(quant="hqq"), given.given) == QuantConfig(quant="hqq")


def _copy(model: Path, out: Path, *, config: dict | None = None, drop: str | None = None) -> Path:
    """`model` with its config.json's quantization_config replaced, or with tensors whose names end in `drop`
    removed from its files."""
    shutil.copytree(model, out)
    if config is not None:
        cfg = json.loads((out / "config.json").read_text())
        cfg["quantization_config"] = config
        (out / "config.json").write_text(json.dumps(cfg))
    if drop is not None:
        for file in out.glob("*.safetensors"):
            tensors = load_file(file)
            save_file({k: v for k, v in tensors.items() if not k.endswith(drop)}, file, metadata={"format": "pt"})
        index = out / "model.safetensors.index.json"
        if index.is_file():
            kept = json.loads(index.read_text())
            kept["weight_map"] = {k: v for k, v in kept["weight_map"].items() if not k.endswith(drop)}
            index.write_text(json.dumps(kept))
    return out


@pytest.mark.parametrize("method", ["gptq", "awq", "compressed-tensors", "mystery"])
def test_an_unread_quantization_is_refused_in_one_line(tiny_model: Path, tmp_path: Path, method: str) -> None:
    model = _copy(tiny_model, tmp_path / "m", config={"quant_method": method, "bits": 4})
    with pytest.raises(UserError, match=rf"quantized with '{method}'.*it reads plain weights, bitsandbytes 4-bit"):
        checkpoint_format(model)


def test_bnb_8bit_is_refused_by_name(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    model = _copy(checkpoints["fp4"], tmp_path / "m", config={"quant_method": "bitsandbytes", "load_in_8bit": True})
    with pytest.raises(UserError, match="quantized with 'bitsandbytes 8-bit'"):
        checkpoint_format(model)


INCOMPLETE = [
    ("nf4-double-uint8", "layers.0.mlp.down_proj.weight.absmax", "incomplete: model.layers.0.mlp.down_proj.weight.abs"),
    ("fp4", "layers.1.self_attn.q_proj.weight.quant_state.bitsandbytes__fp4", "weight.absmax has no quant_state"),
    ("fp8-block", "layers.0.mlp.up_proj.weight_scale_inv", "incomplete: model.layers.0.mlp.up_proj.weight has no"),
    ("mxfp4", "layers.1.mlp.experts.down_proj_scales", "incomplete: model.layers.1.mlp.experts.down_proj_blocks has"),
]  # fmt: skip
"""(checkpoint, the tensor removed, what the refusal says)."""


@pytest.mark.parametrize(("layout", "drop", "message"), INCOMPLETE)
def test_an_incomplete_quantized_checkpoint_is_refused_before_loading(
    checkpoints: dict[str, Path], gpt_oss_mxfp4: Path, tmp_path: Path, layout: str, drop: str, message: str
) -> None:
    model = _copy(checkpoints.get(layout, gpt_oss_mxfp4), tmp_path / "m", drop=drop)
    with pytest.raises(UserError, match=message):
        load_model(ModelConfig(model=str(model)), backend=None, device=CPU, param_dtype=torch.float32)


def test_generate_reads_an_fp8_base_as_training_does(checkpoints: dict[str, Path]) -> None:
    """scripts/generate.py on an FP8 release with --quant bnb: the FP8 weights dequantized and quantized with bnb,
    the bytes training holds, not refused as an export of another quantization."""
    from qlora_fsdp.config.options import TrainConfig
    from qlora_fsdp.tools.config import GenerateConfig
    from qlora_fsdp.tools.generate import load_for_generation

    model = checkpoints["fp8-block"]
    cfg = TrainConfig()
    cfg.model.model, cfg.quant.quant, cfg.fsdp.precision = str(model), "bnb", "fp32"
    generating, _ = load_for_generation(cfg, GenerateConfig())
    backend = make_backend(QuantConfig(quant="bnb"), storage_dtype=torch.uint8, compute_dtype=torch.float32)
    training = load_model(ModelConfig(model=str(model)), backend=backend, device=CPU, param_dtype=torch.float32)
    ids = torch.arange(24).view(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(generating(input_ids=ids).logits, training.model.eval()(input_ids=ids).logits)


@pytest.mark.parametrize("block", [(16, 32), None])
def test_fp8_dequantization_is_transformers_chunk_by_chunk(monkeypatch: pytest.MonkeyPatch,
                                                           block: tuple[int, int] | None) -> None:  # fmt: skip
    """A few blocks of rows at a time (here 2 blocks of 16 rows a chunk), bit for bit what transformers' own FP8
    dequantization computes for the whole weight at once."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    from qlora_fsdp.model.formats import fp8

    quantizer = FineGrainedFP8HfQuantizer(FineGrainedFP8Config(weight_block_size=block))
    parts = Fp8Quantize(quantizer)._quantize_one("w", torch.randn(96, 64, generator=torch.Generator().manual_seed(0)))
    monkeypatch.setattr(fp8, "CHUNK_VALUES", 2 * 16 * 64)
    ours = fp8.dequantize_fp8(parts["w"], parts["w_scale_inv"], None if block is None else list(block), torch.float32)
    theirs = Fp8Dequantize(quantizer)._dequantize_one(parts["w"], parts["w_scale_inv"], output_dtype=torch.float32)
    assert torch.equal(ours, theirs)


# --------------------------------------------------------------------------------- DeepSeek-V4's release format


def _tensors_only(out: Path, tensors: dict[str, torch.Tensor], quantization: dict, **config: object) -> list[Path]:
    """A directory holding `tensors` in one file and a config.json of fp32 weights whose quantization_config is FP8
    with `quantization`: what a format reads (no model is built from it); returns its weight files."""
    out.mkdir()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", **quantization}
    (out / "config.json").write_text(json.dumps({"dtype": "float32", "quantization_config": quant, **config}))
    return [out / "model.safetensors"]


@pytest.mark.parametrize("scale_name", ["weight_scale_inv", "scale"])
def test_e8m0_scales_are_read_as_transformers_dequantizes_them(tmp_path: Path, scale_name: str) -> None:
    """DeepSeek-V4's dense weights: float8 with E8M0 scales (`scale_fmt: ue8m0`, safetensors F8_E8M0), under either
    name its releases use, decoded bit for bit as transformers' own FP8 dequantization decodes them. Before, an E8M0
    scale tensor was counted as an FP8 weight that lacks scales of its own, and the checkpoint refused."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    quantizer = FineGrainedFP8HfQuantizer(FineGrainedFP8Config(weight_block_size=(16, 16), scale_fmt="ue8m0"))
    weight = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
    parts = Fp8Quantize(quantizer)._quantize_one("w.weight", weight)
    values, scales = parts["w.weight"], parts["w.weight_scale_inv"]
    assert scales.dtype == torch.float8_e8m0fnu
    stored = {"w.weight": values, f"w.{scale_name}": scales}
    files = _tensors_only(tmp_path / "m", stored, {"weight_block_size": [16, 16], "scale_fmt": "ue8m0"})
    fmt = checkpoint_format(tmp_path / "m")
    assert fmt.names(files) == ["w.weight"]
    ((name, ours),) = fmt.tensors(files)
    theirs = Fp8Dequantize(quantizer)._dequantize_one(values, scales, output_dtype=torch.float32)
    assert name == "w.weight" and torch.equal(ours.read(), theirs)


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "float"])
def test_fp4_experts_are_read_as_transformers_dequantizes_them(tmp_path: Path, scale_fmt: str) -> None:
    """DeepSeek-V4's routed experts (`expert_dtype: fp4`): int8 bytes of two e2m1 values, low nibble first, one
    scale per 32 values of a row, E8M0 as V4 ships them or float32. Decoded bit for bit as transformers' FP8
    dequantization decodes them; with E8M0 they are MXFP4, which a kept MXFP4 layer holds as the file's bytes.
    Before, the bytes were multiplied as plain integers (float scales) or the E8M0 scales refused."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    from qlora_fsdp.quant.mxfp4 import mxfp4_layer

    generator = torch.Generator().manual_seed(0)
    codes, exponents = e2m1_encode(torch.randn(64, 96, generator=generator))
    values = codes.view(torch.int8)
    scales = exponents.view(torch.float8_e8m0fnu) if scale_fmt == "ue8m0" else torch.rand(64, 3, generator=generator)
    quant = {"scale_fmt": scale_fmt, "expert_dtype": "fp4"}  # no weight_block_size: FP4's block is its own
    files = _tensors_only(tmp_path / "m", {"e.weight": values, "e.weight_scale_inv": scales}, quant)
    ((_, stored),) = checkpoint_format(tmp_path / "m").tensors(files)
    theirs = Fp8Dequantize(FineGrainedFP8HfQuantizer(FineGrainedFP8Config()))._dequantize_one(
        values, scales, output_dtype=torch.float32
    )
    if scale_fmt == "float":
        assert torch.equal(stored.read(), theirs)
        return
    assert torch.equal(stored.dequantize(), theirs)
    layer = mxfp4_layer(torch.nn.Linear(96, 64, device="meta"), storage_dtype=torch.uint8, compute_dtype=torch.float32)
    kept = stored.kept(layer)
    assert torch.equal(kept.packed, codes.flatten()) and torch.equal(kept.state["scales"], exponents)


@pytest.fixture(scope="module")
def deepseek_v4_fp8(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """A tiny DeepSeek-V4 as its release lays it out: FP8 dense weights with E8M0 scales (`X.scale`), routed
    experts FP4 with E8M0 scales, `expert_dtype: fp4`."""
    from tests.moe_models import build_moe_model

    root = tmp_path_factory.mktemp("deepseek-v4")
    dense = build_moe_model("deepseek_v4", root / "dense", tokenizer_from=tiny_model)
    return fp8_checkpoint(dense, root / "fp8", block=(2, 16), scale_fmt="ue8m0", fp4_experts=True)


def loaded_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of a model loaded here under transformers' names: experts split per expert fused back (kept
    ones dequantized)."""
    from qlora_fsdp.quant.experts import QuantizedExperts

    experts = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedExperts)}
    out = {f"{n}.{fused}": m.fused(fused) for n, m in experts.items() for fused in m.fused_names()}
    inside = tuple(f"{n}." for n in experts)
    return out | {k: v for k, v in model.state_dict().items() if not (inside and k.startswith(inside))}


@pytest.mark.parametrize("mode", ["keep", "dequantize"])
def test_deepseek_v4_release_loads_as_transformers_loads_it(deepseek_v4_fp8: Path, mode: str) -> None:
    """Every tensor equals transformers' own loading of the same files (its FP8 CPU fallback, which dequantizes):
    kept, each expert's layer is the file's FP4 bytes and scales, gate and up (w1, w3) joined as transformers fuses
    them; dequantized, transformers' fused experts module. Before, the E8M0 scales were refused."""
    from transformers import AutoModelForCausalLM

    from qlora_fsdp.quant.mxfp4 import Mxfp4Linear

    quant = QuantConfig(quant="none", mxfp4=mode)
    kept = kept_experts_layer(deepseek_v4_fp8, quant, storage_dtype=torch.uint8, compute_dtype=torch.float32)
    assert (kept is None) == (mode == "dequantize")
    skeleton = load_model(ModelConfig(model=str(deepseek_v4_fp8)), backend=None, device=CPU,
                          param_dtype=torch.float32, kept_experts=kept)  # fmt: skip
    reference = AutoModelForCausalLM.from_pretrained(deepseek_v4_fp8, dtype=torch.float32, device_map="cpu")
    theirs, ours = reference.state_dict(), loaded_tensors(skeleton.model)
    assert ours.keys() == theirs.keys()
    differ = [k for k in theirs if not torch.equal(ours[k], theirs[k])]
    assert not differ, differ
    experts = {n: layer_digests(m) for n, m in skeleton.model.named_modules() if isinstance(m, Mxfp4Linear)}
    assert experts == (fp4_expert_digests(deepseek_v4_fp8) if mode == "keep" else {})


@pytest.mark.parametrize("mode", ["keep", "dequantize"])
def test_deepseek_v4_release_loss_equals_transformers(no_launcher: None, deepseek_v4_fp8: Path, rows: Path,
                                                      tmp_path: Path, mode: str) -> None:  # fmt: skip
    """One fp32 process, --quant none: step 1's loss is transformers' own model's on the same files, the experts
    kept as FP4 or dequantized; the resident bytes it logs are what scripts/plan.py plans for the run, which says
    whether it kept them. Before, the release's E8M0 scales were refused."""
    from qlora_fsdp.tools.config import PlanConfig
    from qlora_fsdp.tools.plan import plan_run

    ours = first_loss(deepseek_v4_fp8, rows, tmp_path, "none", mxfp4=mode)
    theirs = transformers_label_loss(deepseek_v4_fp8, rows)
    print(f"DeepSeek-V4 FP8/FP4 --mxfp4 {mode}: ours {ours:.6f}, transformers {theirs:.6f}")
    assert ours == pytest.approx(theirs, rel=2e-4)
    cfg = build_config({"model": str(deepseek_v4_fp8), "quant": "none", "mxfp4": mode, "batch_size": ROWS,
                        "context_length": CONTEXT, "precision": "fp32", "lora_rank": 4, "device": "cpu"})  # fmt: skip
    plan = plan_run(cfg.validate(), PlanConfig(nproc_per_node=1))
    assert read_metrics(tmp_path)[0]["param_bytes_per_rank"] == [rank.parameter_bytes for rank in plan.ranks]
    assert ("routed experts kept as the checkpoint's MXFP4" in plan.settings[1]) == (mode == "keep"), plan.settings


# ----------------------------------------------------------------- pre-quantized bitsandbytes experts (4.x saves)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    from tests.moe_models import build_moe_model

    return build_moe_model("qwen3_moe", tmp_path_factory.mktemp("qwen3-moe") / "dense", tokenizer_from=tiny_model)


def _bnb_expert_layers(model: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.nn.Module, list[tuple]]:
    """The model loaded with --quant bnb in the file's 4-bit settings, and the shapes --quant's quantizer was
    given (none where every weight is kept as the file stores it)."""
    quant = checkpoint_format(model).quant_settings(QuantConfig(quant="bnb"), frozenset())
    backend = make_backend(quant, storage_dtype=torch.uint8, compute_dtype=torch.float32)
    quantized = []
    quantize = backend.quantize
    monkeypatch.setattr(backend, "quantize", lambda w, **kw: quantized.append(tuple(w.shape)) or quantize(w, **kw))
    skeleton = load_model(ModelConfig(model=str(model)), backend=backend, device=CPU, param_dtype=torch.float32)
    return skeleton.model, quantized


def _file_weight(tensors: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, object]:
    """A 4-bit weight of the file: its packed bytes and QuantState, and its values as bitsandbytes decodes them."""
    import bitsandbytes.functional as bnbf

    state = bnbf.QuantState.from_dict({k[len(name) + 1 :]: v for k, v in tensors.items()
                                       if k.startswith(f"{name}.")}, device="cpu")  # fmt: skip
    return tensors[name].flatten(), state


def test_pre_quantized_bnb_experts_are_kept_bit_for_bit(qwen3_moe: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A 4-bit release saved by transformers 4.x, one Linear4bit per routed expert, without double quantization:
    each expert's down_proj is its file weight and its gate_up the file's gate_proj and up_proj joined (bytes and
    absmax stacked: exact, as bitsandbytes decodes them), and nothing is quantized again. Before, every expert was
    dequantized and quantized again."""
    import bitsandbytes.functional as bnbf

    from tests.quantized_checkpoints import bnb_4bit_experts_checkpoint

    model = bnb_4bit_experts_checkpoint(qwen3_moe, tmp_path / "bnb", double_quant=False)
    loaded, quantized = _bnb_expert_layers(model, monkeypatch)
    assert quantized == []
    tensors = {k: v for f in model.glob("*.safetensors") for k, v in load_file(f).items()}
    experts = loaded.get_submodule("model.layers.1.mlp.experts")
    for e in range(experts.num_experts):
        stem = f"model.layers.1.mlp.experts.{e}"
        for layer, sources in ((experts.gate_up[e], ("gate_proj", "up_proj")), (experts.down[e], ("down_proj",))):
            parts = [_file_weight(tensors, f"{stem}.{s}.weight") for s in sources]
            assert torch.equal(layer.packed_bytes(), torch.cat([packed for packed, _ in parts]))
            assert torch.equal(layer.state_tensor("absmax"), torch.cat([state.absmax for _, state in parts]))
            values = torch.cat([bnbf.dequantize_4bit(packed, state) for packed, state in parts])
            assert torch.equal(layer.dequantize(), values)


def test_double_quantized_bnb_experts_keep_down_and_say_gate_up_is_quantized_again(
    qwen3_moe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With double quantization each stored weight's absmax has an offset of its own, so an expert's gate_proj and
    up_proj cannot be one layer's state: they are dequantized and quantized again, which one log line says; every
    down_proj still holds the file's bytes and state. Before, every expert was quantized again, without a word."""
    from tests.quantized_checkpoints import bnb_4bit_experts_checkpoint

    model = bnb_4bit_experts_checkpoint(qwen3_moe, tmp_path / "bnb", double_quant=True)
    with caplog.at_level("WARNING", logger="qlora_fsdp.model.streaming"):
        loaded, quantized = _bnb_expert_layers(model, monkeypatch)
    said = [r.getMessage() for r in caplog.records if "double quantization" in r.getMessage()]
    assert len(said) == 1 and "quantized again with --quant bnb" in said[0], said
    gate_up = [m for n, m in loaded.named_modules() if ".experts.gate_up." in n]
    assert quantized == [(m.out_features, m.in_features) for m in gate_up]  # each expert's gate_up, nothing else
    digests = file_digests(model)
    down = {n: layer_digests(m) for n, m in loaded.named_modules() if ".experts.down." in n}
    assert down == {n.replace(".experts.", ".experts.down.").removesuffix(".down_proj"): d
                    for n, d in digests.items() if n.endswith(".down_proj") and ".experts." in n}  # fmt: skip


@pytest.mark.parametrize("parts", [1, 2], ids=["per-expert", "per-expert-and-half"])
def test_fp8_scales_per_part_without_a_block_are_each_parts_own(tmp_path: Path, parts: int) -> None:
    """`weight_block_size: null` with one scale per expert ([E, 1, 1]) or per expert and gate or up half ([E, 2, 1]),
    as transformers' fused FP8 experts hold them: each part times its own scale (once refused as "needs [1]")."""
    from qlora_fsdp.model.formats.fp8 import Fp8Format

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(4, 6, 8, generator=generator).to(torch.float8_e4m3fn)
    scales = torch.rand(4, parts, 1, generator=generator) + 0.5
    name = "model.layers.0.mlp.experts.gate_up_proj"
    save_file({name: weight, f"{name}_scale_inv": scales}, tmp_path / "model.safetensors")
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": None}, "dtype": "float32"}
    fmt = Fp8Format(config, tmp_path)
    assert fmt.names([tmp_path / "model.safetensors"]) == [name]
    ((read, value),) = list(fmt.tensors([tmp_path / "model.safetensors"]))
    assert read == name
    assert torch.equal(value.read(), weight.float() * scales.repeat_interleave(6 // parts, dim=1))
