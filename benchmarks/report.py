"""results.json -> results.md: one table per section, ours beside the peer, a suite's own sections, the launches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.harness import behind

PLAIN = {"s": "{:.2f} s", "tokens": "{:,.0f}", "abs": "{:.2e}", "bits": "{:.3f}"}
"""Units whose figures need no choice of scale."""
SETTINGS = ("precision", "quantization", "threads", "tokenizers", "our_training", "adapters", "shapes", "long_context",
            "mfu")  # fmt: skip
"""The settings results.md lists under the header; the rest stay in results.json."""


def fmt(value: float, unit: str) -> str:
    """A figure in the unit a reader expects: MiB for bytes, percent for MFU, 3 digits otherwise."""
    if unit == "bytes":
        for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if value >= scale:
                return f"{value / scale:.1f} {name}"
        return f"{value:.0f} B"
    if unit == "tokens/s":
        return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"
    if unit == "fraction":
        return f"{100 * value:.1f}%" if value >= 1e-3 else f"{100 * value:.2g}%"
    return PLAIN.get(unit, "{:.3g}").format(value)


def _header(results: dict[str, Any]) -> list[str]:
    """Where and when, the model, the settings, the GPU test tier."""
    machine = results.get("machine", {})
    where = ", ".join(str(machine[k]) for k in ("cpu", "gpu") if machine.get(k)) or "unknown machine"
    versions = ", ".join(f"{k} {machine.get(k, '?')}" for k in ("torch", "transformers", "peft", "bitsandbytes", "hqq"))
    lines = [f"## qlora-fsdp {results['suite'].upper()} benchmark{' (quick mode)' if results.get('quick') else ''}",
             "", f"Run {results.get('date', '?')} on {where} ({machine.get('cores', '?')} cores); {versions}. "
             f"Suite wall time {results['wall_time_s']:.0f} s."]  # fmt: skip
    if model := results.get("model"):
        sizes = ", ".join(f"{k} {v}" for k, v in model["sizes"].items())
        lines += ["", f"Model: random Llama, {model['parameters']:,} parameters in {model['shards']} shards ({sizes})."]
    settings = results.get("settings", {})
    if notes := [f"- {k}: {settings[k]}" for k in SETTINGS if k in settings]:
        lines += ["", *notes]
    if tests := results.get("tests"):
        counts = ", ".join(f"{tests[k]} {k}" for k in ("passed", "failed", "skipped", "xfailed") if tests.get(k))
        why = f" ({tests['skipped_because']})" if tests.get("skipped_because") and not tests.get("passed") else ""
        lines += ["", f"GPU test tier (`{tests['command']}`): {counts or 'no result'}{why}, {tests['wall_s']:.0f} s."]
    return lines


def _tables(rows: list[dict[str, Any]]) -> list[str]:
    """A table per section, under its sides' labels and notes."""
    lines = ["", "Every figure is a median over runs (`runs` in results.json); ratio = ours / peer."]
    for section in dict.fromkeys(r["section"] for r in rows):
        section_rows = [r for r in rows if r["section"] == section]
        lines += ["", f"### {section}", ""]
        labels = sorted({(r.get("ours_label", ""), r.get("peer_label", "")) for r in section_rows})
        lines += [f"Ours: {ours or 'qlora-fsdp'}. Peer: {peer or '-'}.  " for ours, peer in labels if ours or peer]
        lines += [f"{n}.  " for n in sorted({r["note"] for r in section_rows if r.get("note")})]
        lines += ["", "| figure | ours | peer | ours/peer | better |", "|---|---:|---:|---:|:---:|"]
        for r in section_rows:
            figure = r["figure"].replace("|", "\\|")  # a pipe would end the cell
            lines.append(f"| {figure} | {fmt(r['ours'], r['unit'])} | {fmt(r['peer'], r['unit'])} | "
                         f"{r['ratio']:.2f}x | {r['better']} |")  # fmt: skip
    return lines


def _conditions(results: dict[str, Any]) -> list[str]:
    """Contention, runs kept after the teardown abort, where we trail most, errors and what is missing."""
    lines, conditions = [], results.get("conditions", {})
    if "foreign_cores_median" in conditions:
        lines += ["", f"Contention: other processes on the machine used a median "
                  f"{conditions['foreign_cores_median']:.2f} (max {conditions['foreign_cores_max']:.2f}) cores during "
                  f"the kept launches; {conditions.get('discarded_launches', 0)} launch(es) were discarded and "
                  f"measured again because others took more than "
                  f"{results.get('settings', {}).get('retry_above_cores', 0)} cores; the harness waited "
                  f"{conditions.get('waited_for_idle_s', 0):.0f} s in total for quiet periods."]  # fmt: skip
    if aborted := conditions.get("aborted_at_exit_after_finishing", 0):
        lines += ["", f'{aborted} launch(es) wrote every figure, then aborted at exit with "terminate called without '
                  'an active exception" (the FSDP + gloo teardown race described in benchmarks/README.md); they were '
                  "kept."]  # fmt: skip
    if worst := behind(results["rows"]):
        lines += ["", "Furthest behind the peer:", ""]
        lines += [f"1. {r['section']}: {r['figure']}: {r['ratio']:.2f}x ({r['better']} is better)" for r in worst]
    if errors := results.get("errors"):
        lines += ["", "Errors (these measurements are missing):", "", *(f"- {e.splitlines()[0]}" for e in errors)]
    if missing := results.get("missing"):
        lines += ["", f"To measure what is missing: `bash benchmarks/gpu.sh OUT_DIR --only {','.join(missing)}`."]
    return lines


def render(results: dict[str, Any], extra: Sequence[str] = ()) -> str:
    """The Markdown report of a suite run: the tables, then `extra` (the suite's own lines), then every launch."""
    lines = [*_header(results), *_tables(results["rows"]), *_conditions(results), *extra]
    if launches := [e for e in results.get("conditions", {}).get("launches", []) if "foreign_cores" in e]:
        lines += ["", "### Launches", "", "| launch | wall | other processes' cores | waited |", "|---|---:|---:|---:|"]
        lines += [f"| {e['what']}{' (discarded)' if e['discarded'] else ''} | {e['wall_s']:.1f} s | "
                  f"{e['foreign_cores']:.2f} | {e['waited_for_idle_s']:.0f} s |" for e in launches]  # fmt: skip
    return "\n".join(lines) + "\n"


def acceptance(title: str, items: Sequence[str], *, quick_note: str = "") -> list[str]:
    """A section of pass/FAIL lines against a suite's bars."""
    return ["", f"### {title}", "", *([quick_note, ""] if quick_note else []), *items] if items else []


def verdict(passed: bool) -> str:
    return "pass" if passed else "FAIL"
