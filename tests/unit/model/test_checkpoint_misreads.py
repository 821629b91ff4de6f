"""A checkpoint is never misread silently: every tensor a format yields is checked against what it fills, and a
quantized one against what config.json declares, before it is used. Each case below is a real checkpoint (tiny,
written in its release's layout by tests/quantized_checkpoints.py) with one thing changed, which loading used to
take without a word (or stop on with a traceback), and now refuses in one line naming the tensor, what was expected
and what was found."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qlora_fsdp.config.options import ModelConfig, QuantConfig
from qlora_fsdp.errors import UserError
from qlora_fsdp.model.formats import kept_experts_layer
from qlora_fsdp.model.skeleton import build_skeleton
from qlora_fsdp.model.streaming import stream_weights
from tests.quantized_checkpoints import bnb_4bit_experts_checkpoint, fp8_checkpoint, mxfp4_checkpoint

Tensors = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def releases(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Path]:
    """The tiny Llama plain, pre-quantized bnb 4-bit (all its layer weights) and FP8 (blocks of 16), and a tiny
    gpt-oss with MXFP4 experts."""
    from tests.moe_models import build_moe_model

    root = tmp_path_factory.mktemp("releases")
    gpt_oss = build_moe_model("gpt_oss", root / "gpt-oss", tokenizer_from=tiny_model)
    return {
        "dense": tiny_model,
        "bnb": bnb_4bit_experts_checkpoint(tiny_model, root / "bnb", double_quant=False),
        "fp8": fp8_checkpoint(tiny_model, root / "fp8", block=(16, 16)),
        "mxfp4": mxfp4_checkpoint(gpt_oss, root / "mxfp4"),
    }


def _edited(model: Path, out: Path, *, tensors: Callable[[Tensors], Tensors] | None = None,
            quantization: dict | None = None, config: dict | None = None) -> Path:  # fmt: skip
    """A copy of `model` with each weight file's tensors passed through `tensors` (names may change; the index
    follows) and `quantization` / `config` merged into config.json's quantization_config / top level."""
    shutil.copytree(model, out)
    weight_map = {}
    for file in sorted(out.glob("*.safetensors")):
        edited = tensors(load_file(file)) if tensors is not None else load_file(file)
        save_file(edited, file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(edited, file.name)
    index = out / "model.safetensors.index.json"
    if index.is_file():
        index.write_text(json.dumps(json.loads(index.read_text()) | {"weight_map": weight_map}))
    settings = json.loads((out / "config.json").read_text()) | (config or {})
    if quantization:
        settings["quantization_config"] = settings["quantization_config"] | quantization
    (out / "config.json").write_text(json.dumps(settings))
    return out


def _replace(name: str, make: Callable[[Tensors], Tensors], *, drop: tuple[str, ...] = ()) -> Callable:
    """Where the file holds `name`: the tensors `make(tensors)` makes in place of those of the same names, and the
    `drop` ones gone."""

    def edit(tensors: Tensors) -> Tensors:
        if name not in tensors:
            return tensors
        return {k: v for k, v in tensors.items() if k not in drop} | make(tensors)

    return edit


def _mxfp4(name: str) -> tuple[str, str]:
    """The two tensors an MXFP4 checkpoint stores a fused experts projection `name` as."""
    return f"{name}_blocks", f"{name}_scales"


DOWN = "model.layers.0.mlp.down_proj.weight"
Q = "model.layers.0.self_attn.q_proj.weight"
EXPERTS = "model.layers.1.mlp.experts.down_proj"
CASES = {
    "plain-shape": (
        "dense", {"tensors": _replace(DOWN, lambda t: {DOWN: t[DOWN][:, :200].clone()})},
        rf"{DOWN}: expected \[128, 256\] floating-point values \(config.json's model\), found float32 \[128, 200\]",
    ),
    "plain-integers": (
        "dense", {"tensors": _replace(DOWN, lambda t: {DOWN: t[DOWN].to(torch.int32)})},
        rf"{DOWN}: expected \[128, 256\] floating-point values \(config.json's model\), found int32 \[128, 256\]",
    ),
    "pre-quantized-shape": (
        "bnb", {"config": {"intermediate_size": 128}},
        r"model\.layers\.0\.mlp\.\w+_proj\.weight: expected \[128, 128\] floating-point values \(config.json's "
        r"model\), found quantized \[\d+, \d+\]",
    ),
    "fp8-not-float8": (
        "fp8", {"tensors": _replace(Q, lambda t: {Q: t[Q].to(torch.bfloat16)})},
        rf"{Q} has scales \({Q}_scale_inv\) but is stored as bfloat16 \[128, 128\]: expected a float8 matrix",
    ),
    "fp8-int8-undeclared": (
        "fp8", {"tensors": _replace(Q, lambda t: {Q: t[Q].view(torch.int8)})},
        rf"{Q} has scales \({Q}_scale_inv\) but is stored as int8 \[128, 128\]: expected a float8 matrix \(e4m3 or "
        r"e5m2\), as config.json's",
    ),
    "fp8-scale-grid": (
        "fp8", {"quantization": {"weight_block_size": [32, 32]}},
        r"_scale_inv holds \[\d+, \d+\] scales, but model\.\S+ \[\d+, \d+\] \(\d+ x \d+ values\) in blocks of "
        r"\[32, 32\] \(weight_block_size\) needs \[\d+, \d+\]",
    ),
    "fp8-byte-scales-undeclared": (
        "fp8", {"tensors": _replace(Q, lambda t: {f"{Q}_scale_inv": t[f"{Q}_scale_inv"].to(torch.uint8)})},
        rf"{Q}_scale_inv, the scales of {Q}, is stored as uint8: expected float32, bfloat16 or float16 scales, or "
        r"E8M0 ones",
    ),
    "plain-for-kept": (
        "mxfp4",
        {"tensors": _replace(f"{EXPERTS}_blocks", lambda t: {EXPERTS: torch.zeros(8, 128, 64)}, drop=_mxfp4(EXPERTS))},
        rf"{EXPERTS} arrives unquantized for model.layers.1.mlp.experts.down.0.weight, which holds the checkpoint's "
        r"own quantization \(Mxfp4Linear, kept as stored\)",
    ),
    "expert-count": (
        "mxfp4",
        {"tensors": _replace(f"{EXPERTS}_blocks", lambda t: {n: t[n][:-1].clone() for n in _mxfp4(EXPERTS)})},
        rf"{EXPERTS} holds 7 experts, but the model has 8 \(config.json\)",
    ),
}  # fmt: skip
"""case -> (release, how it is changed, the refusal)."""


@pytest.mark.parametrize("case", list(CASES))
def test_a_checkpoint_that_does_not_fit_is_refused_in_one_line(releases: dict[str, Path], tmp_path: Path,
                                                               case: str) -> None:  # fmt: skip
    release, edits, message = CASES[case]
    model = _edited(releases[release], tmp_path / "m", **edits)
    kept = kept_experts_layer(model, QuantConfig(quant="none"), storage_dtype=torch.uint8, compute_dtype=torch.float32)
    skeleton = build_skeleton(ModelConfig(model=str(model)), backend=None, param_dtype=torch.float32, kept_experts=kept)
    skeleton.model.requires_grad_(False)  # what training streams into: a base frozen by its adapters
    with pytest.raises(UserError, match=message) as refused:
        stream_weights(skeleton, backend=None, device=torch.device("cpu"))
    assert "\n" not in str(refused.value)


def test_fp8_blocks_cut_short_are_read_as_transformers_reads_whole_ones(tmp_path: Path) -> None:
    """Real DeepSeek-V3 shapes: a 576 x 7168 weight has 5 x 56 scales at block 128, the last row of blocks 64 rows
    high. Its grid is accepted and each value takes its block's scale: transformers' own dequantization of the
    weight padded to whole blocks, cut back."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    from qlora_fsdp.model.formats import checkpoint_format

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(576, 7168, generator=generator).to(torch.float8_e4m3fn)
    scales = torch.rand(5, 56, generator=generator)
    (tmp_path / "m").mkdir()
    save_file({"w.weight": weight, "w.weight_scale_inv": scales}, tmp_path / "m" / "model.safetensors")
    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (tmp_path / "m" / "config.json").write_text(json.dumps({"dtype": "float32", "quantization_config": quant}))
    ((_, ours),) = checkpoint_format(tmp_path / "m").tensors([tmp_path / "m" / "model.safetensors"])
    padded = torch.cat([weight, torch.zeros(64, 7168, dtype=weight.dtype)])
    dequantize = Fp8Dequantize(FineGrainedFP8HfQuantizer(FineGrainedFP8Config()))._dequantize_one
    theirs = dequantize(padded, scales, output_dtype=torch.float32)[:576]
    assert torch.equal(ours.read(), theirs)
    # A run of rows read alone (a rank's share), across block edges and into the cut-short block: the same values.
    assert torch.equal(ours.read_rows(100, 300), theirs[100:300])
    assert torch.equal(ours.read_rows(500, 576), theirs[500:])
