"""The checkpoint-formats suite (--suite cpu-formats) run for real in its quick mode: every figure of both sections
present and positive, ratio = the format's / bf16's from the same repetitions, every format loading into the same
resident bytes; and that check, which fails when one did not. No timing thresholds."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.formats_suite import FIGURES, check_same_model
from tests.benchmarks.suites import run_suite


@pytest.mark.distributed
@pytest.mark.benchmark
def test_formats_suite_quick(tmp_path: Path) -> None:
    results, report = run_suite(tmp_path, "cpu-formats")
    rows = {r["key"]: r for r in results["rows"]}
    sums = results["details"]["summaries"]
    for fmt in ("bnb-4bit", "fp8"):
        for key, *_ in FIGURES:
            r = rows[f"{key}_{fmt.replace('-', '_')}"]
            assert r["runs"]["ours"] == [s[key] for s in sums[fmt]], key
            assert r["runs"]["peer"] == [s[key] for s in sums["bf16"]], key
            assert r["ours"] > 0 and r["peer"] > 0
    # The files people download are smaller than the bf16 release, and each rank reads less of them.
    assert rows["checkpoint_bytes_bnb_4bit"]["ratio"] < 0.5 and rows["read_bytes_bnb_4bit"]["ratio"] < 1
    assert "### pre-quantized bnb 4-bit" in report


def test_formats_must_load_into_the_same_model() -> None:
    same = {"bf16": [{"resident_bytes": 10.0}], "fp8": [{"resident_bytes": 10.0}]}
    check_same_model(same)
    with pytest.raises(RuntimeError, match="different resident bytes"):
        check_same_model({**same, "bnb-4bit": [{"resident_bytes": 11.0}]})
