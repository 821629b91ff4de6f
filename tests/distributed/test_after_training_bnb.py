"""SmolLM2 learns a new fact with bnb QLoRA on 2 ranks; generate, merge and export give it back (after_training.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.after_training import ANSWER, ask, check_answers, train_fact

pytestmark = pytest.mark.distributed


def test_the_base_model_does_not_know(smollm2: Path, capsys: pytest.CaptureFixture) -> None:
    assert ANSWER not in ask(capsys, "--model", str(smollm2))


def test_adapter_merge_and_export_answer(
    smollm2: Path, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    adapter = train_fact("bnb", smollm2, tmp_path_factory.mktemp("fact-bnb"))
    check_answers("bnb", adapter, smollm2, tmp_path, capsys)
