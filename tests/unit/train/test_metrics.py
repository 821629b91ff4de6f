"""qlora_fsdp.train.metrics: peak memory and metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qlora_fsdp.config.options import OutputConfig
from qlora_fsdp.train.metrics import METRICS_FILE, MetricsLogger, peak_memory_bytes, read_metrics

CPU = torch.device("cpu")


def _resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_peak_memory_counts_a_tensor_allocated_after_the_first_reading() -> None:
    before = peak_memory_bytes(CPU)
    resident = _resident_bytes()
    # The high-water mark after imports can lie far above what is resident now: allocate enough to pass it, so the
    # reading after allocation can only be met by counting this block (in bytes, not KiB).
    size = max(0, before - resident) + 64 * 2**20
    block = torch.ones(size, dtype=torch.uint8)  # written, so its pages are resident
    after = peak_memory_bytes(CPU)
    assert after >= resident + 0.95 * size
    assert after > before
    assert int(block[-1]) == 1


def record(step: int) -> dict[str, float | int]:
    return {"step": step, "loss": 2.5 - 0.25 * step, "lr": 1e-4 * step, "tokens_per_s": 1000.0 + step, "peak": 7}


def test_metrics_logger_writes_one_json_line_per_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logger = MetricsLogger(
        OutputConfig(log_to="stdout"), output_dir=tmp_path, is_main=True, total_steps=3, run_config={"lr": 1e-4}
    )
    records = [record(s) for s in (1, 2, 3)]
    for r in records:
        logger.log(r)
    logger.close()
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert len(lines) == 3
    assert [json.loads(line) for line in lines] == records
    assert read_metrics(tmp_path) == records
    out = capsys.readouterr().out
    step_lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(step_lines) == 3
    assert step_lines[0].startswith("step 1 loss 2.2500")


def test_metrics_logger_off_main_rank_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logger = MetricsLogger(
        OutputConfig(log_to="stdout"), output_dir=tmp_path, is_main=False, total_steps=2, run_config={}
    )
    logger.log(record(1))
    logger.message("hello")
    logger.close()
    assert not (tmp_path / METRICS_FILE).exists()
    assert list(tmp_path.iterdir()) == []
    assert capsys.readouterr().out == ""
