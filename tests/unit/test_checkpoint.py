"""Checkpoint bookkeeping that needs no process group: completeness, resume choice and compatibility."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from qlora_fsdp.checkpoint import (
    TRAINER_STATE,
    TrainState,
    check_resume_compatible,
    list_checkpoints,
    resolve_resume,
)
from qlora_fsdp.errors import UserError


def make_checkpoint(out: Path, step: int, *, complete: bool = True, **settings: object) -> Path:
    path = out / f"checkpoint-{step}"
    path.mkdir(parents=True)
    if complete:
        state = TrainState(step=step, world_size=2, settings=dict(settings))
        (path / TRAINER_STATE).write_text(json.dumps(asdict(state)))
    return path


def test_only_complete_checkpoints_count_newest_last(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 10)
    make_checkpoint(tmp_path, 9)
    make_checkpoint(tmp_path, 12, complete=False)  # killed before trainer_state.json was written
    (tmp_path / ".checkpoint-15.tmp").mkdir()  # killed mid-write
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-9", "checkpoint-10"]
    assert resolve_resume("auto", tmp_path) == tmp_path / "checkpoint-10"


def test_resume_choice(tmp_path: Path) -> None:
    assert resolve_resume("", tmp_path) is None
    assert resolve_resume("auto", tmp_path) is None  # nothing saved yet: a fresh start
    incomplete = make_checkpoint(tmp_path, 3, complete=False)
    with pytest.raises(UserError, match=r"--resume_from .*not a complete checkpoint"):
        resolve_resume(str(incomplete), tmp_path)


def test_resume_must_match_world_size_and_settings(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path, 3, batch_size=2, lora_rank=8, dataset="a.jsonl")
    check_resume_compatible(ckpt, {"batch_size": 2, "lora_rank": 8, "dataset": "a.jsonl"}, world_size=2)
    with pytest.raises(UserError, match="saved by 2 processes but this job has 4"):
        check_resume_compatible(ckpt, {"batch_size": 2}, world_size=4)
    with pytest.raises(UserError, match=r"--batch_size 2 -> 4; --lora_rank 8 -> 16"):
        check_resume_compatible(ckpt, {"batch_size": 4, "lora_rank": 16, "dataset": "a.jsonl"}, world_size=2)
