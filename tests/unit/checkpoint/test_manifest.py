"""The manifest beside the adapter: merge, export and generate take their flags from it and check its digests.

The adapters are tests/unit/tools/test_export.py's training-time models, whose manifest is made by the functions
train.py uses, from the same loading; tests/distributed/after_training.py checks the manifest of real training runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qlora_fsdp.checkpoint.manifest import MANIFEST_FILE, layer_digests, read_manifest
from qlora_fsdp.config.options import build_config
from qlora_fsdp.quant import make_backend
from scripts import export_quantized, generate, merge_adapter
from scripts.make_tiny_model import build_tiny_model
from tests.cli.test_after_training_bad_input import one_error
from tests.unit.tools.test_export import PROMPTS, Trained


def _layer(quant: str, storage_dtype: torch.dtype, weight: torch.Tensor):
    quant_cfg = build_config({"quant": quant}).quant
    backend = make_backend(quant_cfg, storage_dtype=storage_dtype, compute_dtype=torch.float32)
    layer = backend.make_module(torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False))
    backend.load_weight(layer, weight, device=torch.device("cpu"))
    return layer


@pytest.mark.parametrize("quant", ["bnb", "hqq"])
def test_digests_follow_the_bytes_not_the_storage_layout(quant: str) -> None:
    """uint8 parameters (FSDP2) and a float view padded to whole elements (FSDP1) of the same bytes digest alike;
    one changed byte does not."""
    weight = torch.randn(24, 40, generator=torch.Generator().manual_seed(0))
    as_bytes = _layer(quant, torch.uint8, weight)
    digests = layer_digests(as_bytes)
    assert set(digests) == {"packed", *as_bytes.layouts}
    for storage in (torch.bfloat16, torch.float32):
        assert layer_digests(_layer(quant, storage, weight)) == digests, storage
    as_bytes.packed_bytes()[7] ^= 1
    assert layer_digests(as_bytes)["packed"] != digests["packed"]


def test_the_manifest_records_flags_environment_and_every_quantized_layer(tiny_model: Path, tmp_path: Path) -> None:
    trained = Trained(tiny_model, tmp_path, quant="hqq", manifest=True)
    manifest = read_manifest(trained.adapter)
    assert manifest is not None
    assert manifest.flags == {"quant": "hqq", "hqq_bits": 4, "hqq_group_size": 64, "compute_dtype": "auto",
                              "precision": "fp32"}  # fmt: skip
    assert manifest.quantized_with["device"] == "cpu" and manifest.quantized_with["compute_dtype"] == "float32"
    assert {"torch", "transformers", "hqq", "cpu_threads"} <= manifest.quantized_with.keys()
    assert sorted(manifest.layers) == sorted(trained.packed()) == sorted(trained.skeleton.quantized)


def test_export_without_flags_is_export_with_them(tiny_model: Path, tmp_path: Path) -> None:
    """--adapter alone gives the same qmodel.pt as the run's flags, and its W_q are training's bytes."""
    trained = Trained(tiny_model, tmp_path, quant="hqq", manifest=True)
    bare, flagged = tmp_path / "bare", tmp_path / "flagged"
    args = ["--model", str(tiny_model), "--adapter", str(trained.adapter), "--output", str(bare)]
    assert export_quantized.main(args) == 0
    flags = ["--quant", "hqq", "--precision", "fp32"]
    assert export_quantized.main(["--model", str(tiny_model), *flags, "--output", str(flagged)]) == 0
    got, want = (torch.load(d / "qmodel.pt", weights_only=True) for d in (bare, flagged))
    assert got.keys() == want.keys()
    for name, layer in want.items():
        assert layer.keys() == got[name].keys(), name
        for key, value in layer.items():
            same = torch.equal(got[name][key], value) if isinstance(value, torch.Tensor) else got[name][key] == value
            assert same, (name, key)
    for name, packed in trained.packed().items():
        assert torch.equal(got[name]["W_q"].flatten().view(torch.uint8), packed), name


def test_dequantized_merge_without_flags_is_the_merge_with_them(tiny_model: Path, tmp_path: Path) -> None:
    trained = Trained(tiny_model, tmp_path, quant="bnb", manifest=True)
    common = ["--model", str(tiny_model), "--adapter", str(trained.adapter), "--base_weights", "dequantized"]
    bare, flagged = tmp_path / "bare", tmp_path / "flagged"
    assert merge_adapter.main([*common, "--output", str(bare)]) == 0
    assert merge_adapter.main([*common, "--quant", "bnb", "--precision", "fp32", "--output", str(flagged)]) == 0
    shards = sorted(p.name for p in flagged.glob("*.safetensors"))
    assert shards and sorted(p.name for p in bare.glob("*.safetensors")) == shards
    for shard in shards:
        got, want = load_file(str(bare / shard)), load_file(str(flagged / shard))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), shard
    # Without the manifest's --precision fp32 the merge would be bf16 (the default): the flags really came from it.
    assert json.loads((bare / "config.json").read_text())["dtype"] == "bfloat16"
    assert next(iter(load_file(str(bare / shards[0])).values())).dtype == torch.bfloat16


def test_generate_without_flags_answers_as_with_them(tiny_model: Path, tmp_path: Path, capsys) -> None:
    trained = Trained(tiny_model, tmp_path, quant="hqq", manifest=True)
    ask = ["--model", str(tiny_model), "--adapter", str(trained.adapter), "--prompt", PROMPTS[0]]
    ask += ["--max_new_tokens", "6"]
    assert generate.main([*ask, "--quant", "hqq", "--precision", "fp32"]) == 0
    with_flags = capsys.readouterr().out
    assert generate.main(ask) == 0
    assert capsys.readouterr().out == with_flags


@pytest.mark.parametrize("script", [export_quantized, merge_adapter, generate])
def test_a_flag_contradicting_the_manifest_is_refused(script, tiny_model: Path, tmp_path: Path, capsys) -> None:
    trained = Trained(tiny_model, tmp_path / "in", quant="hqq", manifest=True)
    own = {export_quantized: ["--output", str(tmp_path / "out")], merge_adapter: ["--output", str(tmp_path / "out")],
           generate: ["--prompt", "hi"]}[script]  # fmt: skip
    args = ["--model", str(tiny_model), "--adapter", str(trained.adapter), "--hqq_group_size", "32", *own]
    line = one_error(capsys, script.main(args), "--hqq_group_size 32", "manifest (64)")
    assert "drop --hqq_group_size" in line
    assert not (tmp_path / "out").exists()


def test_another_compute_dtype_quantizes_other_bytes_and_is_refused(tiny_model: Path, tmp_path: Path, capsys) -> None:
    """Trained in fp32; a manifest edited to bf16 makes HQQ quantize in bf16, whose scale and zero differ: the first
    layer stops the export, naming both dtypes, and nothing is left behind."""
    trained = Trained(tiny_model, tmp_path / "in", quant="hqq", manifest=True)
    path = trained.adapter / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    manifest["flags"]["compute_dtype"] = "bf16"
    path.write_text(json.dumps(manifest))
    out = tmp_path / "out"
    code = export_quantized.main(["--model", str(tiny_model), "--adapter", str(trained.adapter), "--output", str(out)])
    line = one_error(capsys, code, "quantizes to other bytes than training", "scale", "zero", MANIFEST_FILE)
    assert "training quantized in float32, this run in bfloat16" in line
    assert list(tmp_path.iterdir()) == [tmp_path / "in"]


def test_another_base_with_the_same_shapes_is_refused(tiny_model: Path, tmp_path: Path, capsys) -> None:
    """Same architecture, other weights: every check on shapes passes, the digests do not, and the message says
    the model's files are not training's."""
    trained = Trained(tiny_model, tmp_path / "in", quant="bnb", manifest=True)
    other = build_tiny_model(tmp_path / "other", seed=5)
    args = ["--adapter", str(trained.adapter), "--base_weights", "dequantized", "--output", str(tmp_path / "out")]
    code = merge_adapter.main(["--model", str(other), *args])
    one_error(capsys, code, "packed", "--model's files are not the ones training read")
    assert not (tmp_path / "out").exists()


def test_export_refuses_an_adapter_without_a_manifest(tiny_model: Path, tmp_path: Path, capsys) -> None:
    trained = Trained(tiny_model, tmp_path / "in", quant="bnb")
    args = ["--model", str(tiny_model), "--adapter", str(trained.adapter), "--output", str(tmp_path / "out")]
    one_error(capsys, export_quantized.main(args), "--adapter", MANIFEST_FILE, "quantization flags")
    assert not (tmp_path / "out").exists()
