"""Fixtures the model tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import DATASET

ROWS = 4
"""Rows of one step's batch in the tests that compare a first step with transformers' own model."""


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first ROWS rows of the shipped Alpaca sample, of different lengths: one step's batch."""
    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    path.write_text("".join(DATASET.read_text().splitlines(keepends=True)[:ROWS]))
    return path
