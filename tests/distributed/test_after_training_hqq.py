"""SmolLM2 learns a new fact with hqq QLoRA on 2 ranks; generate, merge and export give it back (after_training.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.after_training import check_answers, train_fact

pytestmark = pytest.mark.distributed


def test_adapter_merge_and_export_answer(
    smollm2: Path, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    adapter = train_fact("hqq", smollm2, tmp_path_factory.mktemp("fact-hqq"))
    check_answers("hqq", adapter, smollm2, tmp_path, capsys)
