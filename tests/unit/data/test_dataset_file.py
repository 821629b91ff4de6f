"""Tests for the shipped data/alpaca_tiny.jsonl and the script that generates it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qlora_fsdp.data.formats import Example, format_prompt, load_examples
from scripts.make_dataset import generate_rows

REPO_ROOT = Path(__file__).resolve().parents[3]
DATA = REPO_ROOT / "data" / "alpaca_tiny.jsonl"


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    """The shipped file, parsed line by line (each line must be standalone JSON)."""
    with open(DATA, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_shipped_file_parses_with_alpaca_fields(rows: list[dict]) -> None:
    assert len(rows) >= 300
    for i, row in enumerate(rows):
        assert set(row) == {"instruction", "input", "output"}, i
        assert all(isinstance(row[k], str) for k in row), i
        assert row["instruction"].strip() and row["output"].strip(), i


def test_dataset_samples_takes_the_first_rows(rows: list[dict]) -> None:
    """--dataset_samples 3 on the shipped file trains on exactly its first 3 rows, in file order."""
    examples = load_examples(str(DATA), samples=3)
    assert examples == [Example(format_prompt(r["instruction"], r["input"]), r["output"]) for r in rows[:3]]


def test_rows_mix_inputs_and_stay_short_ascii(rows: list[dict]) -> None:
    with_input = sum(1 for r in rows if r["input"])
    assert 0.2 * len(rows) < with_input < 0.8 * len(rows)
    assert DATA.read_bytes().isascii()
    assert max(len(r["output"]) for r in rows) < 120
    assert len({r["instruction"].split()[0] for r in rows}) >= 8, "expected a mix of task types"
    assert len({json.dumps(r, sort_keys=True) for r in rows}) > 0.5 * len(rows), "too many duplicate rows"


def test_rows_are_correct_for_checkable_tasks(rows: list[dict]) -> None:
    """Spot-check the answers so a generator bug cannot teach the model wrong patterns."""
    checked = 0
    for r in rows:
        if r["instruction"] == "Add the two numbers.":
            a, b = r["input"].split(" + ")
            assert int(r["output"]) == int(a) + int(b)
            checked += 1
        elif r["instruction"] == "Reverse the letters of the word.":
            assert r["output"] == r["input"][::-1]
            checked += 1
        elif r["instruction"] == "Sort the numbers in ascending order.":
            assert [int(x) for x in r["output"].split(", ")] == sorted(int(x) for x in r["input"].split(", "))
            checked += 1
    assert checked >= 30


@pytest.mark.distributed
def test_regenerating_reproduces_file_byte_for_byte(tmp_path: Path) -> None:
    out = tmp_path / "regen.jsonl"
    subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "scripts" / "make_dataset.py"),
            "--output",
            str(out),
            "--rows",
            "400",
            "--seed",
            "0",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    assert out.read_bytes() == DATA.read_bytes()


@pytest.mark.distributed
def test_regenerating_the_preference_pairs_reproduces_their_file(tmp_path: Path) -> None:
    out = tmp_path / "pairs.jsonl"
    script = str(REPO_ROOT / "scripts" / "make_dataset.py")
    subprocess.run([sys.executable, script, "--output", str(out), "--preference"], check=True, capture_output=True,
                   timeout=60)  # fmt: skip
    assert out.read_bytes() == (REPO_ROOT / "data" / "preference_tiny.jsonl").read_bytes()


def test_seed_changes_rows() -> None:
    assert generate_rows(50, seed=0) != generate_rows(50, seed=1)
    assert generate_rows(50, seed=0) == generate_rows(50, seed=0)


def test_license_is_cc0() -> None:
    text = (REPO_ROOT / "data" / "LICENSE").read_text()
    assert "CC0 1.0" in text and "make_dataset.py" in text
