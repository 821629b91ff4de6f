"""Every preset in configs/ loads, validates, keeps its keys in the right sections and says how to launch it."""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

import pytest
import yaml

from qlora_fsdp.config.options import FLAGS, PER_OBJECTIVE, SECTIONS, build_config
from qlora_fsdp.objectives.specs import OBJECTIVES

REPO_ROOT = Path(__file__).resolve().parents[3]
PRESETS = sorted((REPO_ROOT / "configs").glob("*.yaml"))
TOOL_PRESETS = ("trl-defaults.yaml", "axolotl-defaults.yaml", "fsdp_qlora-defaults.yaml")
"""Another tool's defaults, for any model and device (tests/unit/config/test_tool_presets.py)."""
GPU_PRESETS = [p for p in PRESETS if p.name != "tiny-cpu.yaml" and p.name not in TOOL_PRESETS]


def _launch_lines(path: Path) -> list[str]:
    """The comment lines that run train.py with this very file."""
    needle = f"train.py --config configs/{path.name}"
    lines = path.read_text().splitlines()
    return [line.lstrip("# ").strip() for line in lines if line.startswith("#") and needle in line]


def test_presets_exist() -> None:
    names = {p.name for p in PRESETS}
    for expected in (
        "tiny-cpu.yaml",
        "llama-70b-2x24gb-bnb.yaml",
        "llama-70b-4xa100-hqq.yaml",
        "llama-8b-1gpu.yaml",
        "mistral-7b-long-context.yaml",
        *TOOL_PRESETS,
    ):
        assert expected in names


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_preset_loads_and_validates(path: Path) -> None:
    cfg = build_config({}, str(path))
    if not cfg.model.model:
        cfg = build_config({"model": "x"}, str(path))
    cfg.validate()


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_preset_keys_sit_in_their_sections(path: Path) -> None:
    raw = yaml.safe_load(path.read_text())
    assert isinstance(raw, dict) and raw
    for objective, values in raw.pop(PER_OBJECTIVE, {}).items():  # flat: one objective's few values
        assert objective in OBJECTIVES and all(key in FLAGS for key in values), (path.name, objective)
    for section, values in raw.items():
        assert section in SECTIONS, f"{path.name}: top-level key {section!r} is not a section"
        for key in values:
            assert FLAGS[key][0] == section, f"{path.name}: {key} belongs under {FLAGS[key][0]}, not {section}"


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_preset_has_a_launch_comment_whose_flags_exist(path: Path) -> None:
    lines = _launch_lines(path)
    assert lines, f"{path.name} has no '# ... train.py --config configs/{path.name}' launch comment"
    for line in lines:
        words = shlex.split(line)
        assert words[0] in ("torchrun", "python"), line
        if words[0] == "torchrun":
            assert any(re.fullmatch(r"--nproc_per_node=\d+", w) for w in words), line
        rest = words[words.index("train.py") + 1 :]
        flags = {w[2:]: v for w, v in itertools.pairwise(rest) if w.startswith("--") and w != "--config"}
        build_config(flags, str(path))  # unknown flags in the command raise ConfigError


@pytest.mark.parametrize("path", GPU_PRESETS, ids=lambda p: p.name)
def test_gpu_preset_names_a_hub_model_and_cuda(path: Path) -> None:
    cfg = build_config({}, str(path))
    assert re.fullmatch(r"[\w.-]+/[\w.-]+", cfg.model.model), cfg.model.model
    assert cfg.dist.device == "cuda"
    assert cfg.output.output_dir != "output", "give each preset its own output_dir"
