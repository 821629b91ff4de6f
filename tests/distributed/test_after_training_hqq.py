"""SmolLM2 learns a new fact with hqq QLoRA on 2 ranks; generate, merge and export give it back (after_training.py),
and refuse, before writing anything, a flag that contradicts the manifest or a base quantized into other bytes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qlora_fsdp.checkpoint.manifest import MANIFEST_FILE
from scripts import export_quantized
from tests.cli.test_after_training_bad_input import one_error
from tests.distributed.after_training import check_answers, train_fact

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def adapter(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The adapter of one training run, with a checkpoint of its last step."""
    return train_fact("hqq", smollm2, tmp_path_factory.mktemp("fact-hqq"), "--save_steps", "16")


def test_adapter_merge_and_export_answer(adapter: Path, smollm2: Path, tmp_path: Path, capsys) -> None:
    check_answers("hqq", adapter, smollm2, tmp_path, capsys)


def test_each_checkpoint_carries_the_manifest(adapter: Path) -> None:
    assert (adapter / "checkpoint-16" / MANIFEST_FILE).read_text() == (adapter / MANIFEST_FILE).read_text()


def test_a_contradicting_flag_and_other_bytes_are_refused(adapter: Path, smollm2: Path, tmp_path: Path, capsys):
    out = tmp_path / "out"
    args = ["--model", str(smollm2), "--adapter", str(adapter), "--hqq_group_size", "32", "--output", str(out)]
    one_error(capsys, export_quantized.main(args), "--hqq_group_size 32 contradicts the adapter's manifest (64)")
    assert not out.exists()

    # Training ran in fp32 (--compute_dtype auto): a manifest edited to bf16 makes HQQ quantize in bf16.
    edited = tmp_path / "edited"
    shutil.copytree(adapter, edited, ignore=shutil.ignore_patterns("checkpoint-*"))
    manifest = json.loads((edited / MANIFEST_FILE).read_text())
    assert manifest["quantized_with"]["compute_dtype"] == "float32"
    manifest["flags"]["compute_dtype"] = "bf16"
    (edited / MANIFEST_FILE).write_text(json.dumps(manifest))
    args = ["--model", str(smollm2), "--adapter", str(edited), "--output", str(out)]
    line = one_error(capsys, export_quantized.main(args), "model.layers.0.", "scale", "zero")
    assert "training quantized in float32, this run in bfloat16" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["edited"]
