"""The GPU tier (`pytest -m gpu`): every test here is marked gpu and skipped where no CUDA GPU is visible, so the
default test command (CI, the CPU machines) collects and skips it."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture
def fp32_matmuls() -> object:
    """Full fp32 matmuls on CUDA (no TF32) while a test compares CUDA against the CPU."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)
