"""Bad input through the real CLI: non-zero exit, one `error:` line naming the flag, no traceback, no output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import DATASET, launch

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_cli(args: list[str]) -> tuple[int, list[str], str]:
    result = launch(REPO_ROOT / "train.py", args, nproc=0, timeout=120)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    return result.returncode, errors, result.stdout + result.stderr


def assert_one_line_error(code: int, errors: list[str], output: str, *needles: str) -> str:
    assert code != 0
    assert "Traceback" not in output, output[-3000:]
    assert len(errors) == 1, output[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def test_nonexistent_model_path(tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, errors, output = run_cli(["--model", str(tmp_path / "no-such-model"), "--output_dir", str(out)])
    assert_one_line_error(code, errors, output, "--model", "no-such-model")
    assert not out.exists()


def test_unknown_quant(tiny_model: Path) -> None:
    code, errors, output = run_cli(["--model", str(tiny_model), "--quant", "gptq"])
    assert_one_line_error(code, errors, output, "--quant", "gptq", "bnb, hqq, none")


def test_unsupported_hqq_bits(tiny_model: Path) -> None:
    code, errors, output = run_cli(["--model", str(tiny_model), "--quant", "hqq", "--hqq_bits", "5"])
    assert_one_line_error(code, errors, output, "--hqq_bits", "5", "1, 2, 3, 4, 8")


def test_several_bad_flags_reported_together(tiny_model: Path) -> None:
    code, errors, output = run_cli(["--model", str(tiny_model), "--quant", "gptq", "--batch_size", "0"])
    assert_one_line_error(code, errors, output, "--quant", "--batch_size")


def test_dataset_row_missing_output(tiny_model: Path, tmp_path: Path) -> None:
    rows = [json.loads(line) for line in DATASET.read_text().splitlines()[:6]]
    del rows[4]["output"]
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    args = ["--model", str(tiny_model), "--dataset", str(data), "--output_dir", str(out), "--device", "cpu"]
    code, errors, output = run_cli(args)
    assert_one_line_error(code, errors, output, "--dataset", str(data), "row 5", "'output'")
    assert not out.exists(), "a failed run must not leave an output directory behind"


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_options(flag: str) -> None:
    result = launch(REPO_ROOT / "train.py", [flag], nproc=0, timeout=60)
    assert result.returncode == 0
    for name in ("--model", "--quant", "--hqq_bits", "--lora_rank", "--sharding_strategy", "--log_to"):
        assert name in result.stdout
