"""One result row: our figure beside the peer's from the same run, both medians of their runs, and their ratio.

Every suite reports through these rows so results.json has one shape the test and the Markdown renderer rely on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.common import median


def row(
    section: str,
    key: str,
    figure: str,
    unit: str,
    better: str,
    ours_runs: Sequence[float],
    peer_runs: Sequence[float],
    *,
    ours_label: str = "",
    peer_label: str = "",
    note: str = "",
) -> dict[str, Any]:
    """A comparison row; `better` is "higher" or "lower"; ratio is always ours / peer."""
    if better not in ("higher", "lower"):
        raise ValueError(f"better must be higher or lower, got {better!r}")
    ours, peer = median(ours_runs), median(peer_runs)
    if peer == 0:
        raise ValueError(f"{key}: the peer's figure is zero, no ratio")
    out = {
        "section": section,
        "key": key,
        "figure": figure,
        "unit": unit,
        "better": better,
        "ours": ours,
        "peer": peer,
        "ratio": ours / peer,
        "runs": {"ours": [float(v) for v in ours_runs], "peer": [float(v) for v in peer_runs]},
    }
    for name, value in (("ours_label", ours_label), ("peer_label", peer_label), ("note", note)):
        if value:
            out[name] = value
    return out


def behind(rows: Sequence[dict[str, Any]], n: int = 3) -> list[dict[str, Any]]:
    """The `n` rows where we trail the peer most (ratio oriented so that > 1 means we are worse)."""

    def badness(r: dict[str, Any]) -> float:
        return r["ratio"] if r["better"] == "lower" else 1.0 / r["ratio"]

    return sorted((r for r in rows if badness(r) > 1.0), key=badness, reverse=True)[:n]
