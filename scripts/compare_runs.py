"""Overlay the loss curves of several training runs and tabulate them (bnb vs HQQ, one setting against another).

Usage:
    python scripts/compare_runs.py RUN_DIR [RUN_DIR ...] [--output compare.png] [--labels a,b] [--smooth N] [--json]

Each RUN_DIR is one of:
  * a train.py --output_dir: its metrics.jsonl is read;
  * a Weights & Biases offline run directory (OUTPUT_DIR/wandb/offline-run-*, written with --log_to wandb and
    WANDB_MODE=offline): its files/wandb-history.jsonl if there is one (older wandb versions), else its
    run-*.wandb file, the log that `wandb sync` uploads (read here directly; wandb >= 0.19 has no Python reader).

The plot (x: optimizer step, y: loss) goes to --output, with each run's evaluation loss (train.py --eval_dataset or
--eval_split) as a dashed line in the run's colour; stdout gets a Markdown table, or JSON with --json, with one row
per run: name, steps, final and min training loss, final and min evaluation loss, mean tokens/s (of the per-step
values) and peak memory (the largest per-rank peak of any step, GiB). Preference runs (--objective dpo, ipo, orpo,
simpo) add their final reward accuracy and margin, training and evaluation, to the table, and a second panel with
both curves to the plot; GRPO runs their final mean reward, and its curve in that panel. A step logged twice (a
resumed run's W&B log) counts once, with its last record.
Bad input prints one line, `error: ...`, and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

METRICS_FILE = "metrics.jsonl"
WANDB_HISTORY_FILE = Path("files") / "wandb-history.jsonl"
GIB = 2**30

# The .wandb run log is a LevelDB-style log: a 7-byte file header (":W&B", magic 0xBEE1, version 0), then 32 KiB
# blocks of chunks, each a 7-byte header (CRC-32 of type byte + data, data length, type) and its data. A record
# (a serialized wandb.proto Record) is one FULL chunk or FIRST, MIDDLE..., LAST chunks across blocks.
_WANDB_IDENT, _WANDB_MAGIC = b":W&B", 0xBEE1
_BLOCK, _CHUNK_HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


class CompareError(Exception):
    """Bad input; main() prints it as one `error:` line and exits 2."""


@dataclass
class Run:
    name: str
    source: Path
    records: list[dict[str, Any]]  # one per optimizer step, sorted by step
    evals: list[dict[str, Any]]  # one per evaluation (step, eval_loss), sorted by step; empty without evaluation


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, like every other error of this tool (argparse would print the usage block too)."""
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(
        prog="compare_runs.py",
        description="Overlay the loss curves of several runs and print a summary table.",
    )
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="train.py output dir or W&B offline run")
    parser.add_argument("--output", type=Path, default=Path("compare.png"), help="plot file (default compare.png)")
    parser.add_argument("--labels", default="", help="comma-separated names, one per RUN_DIR, in order")
    parser.add_argument("--smooth", type=int, default=1, help="trailing moving average over N steps (1: raw)")
    parser.add_argument("--json", action="store_true", help="print the table as JSON instead of Markdown")
    args = parser.parse_args(argv)
    if args.smooth < 1:
        parser.error(f"--smooth must be >= 1, got {args.smooth}")
    return args


def _by_step(records: list[dict[str, Any]], source: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training records, evaluation records), each one per step (the last one logged) and sorted.

    A record carries a step and a training `loss`, an `eval_loss`, or both (W&B merges what one step logged).
    """
    steps: dict[int, dict[str, Any]] = {}
    evals: dict[int, dict[str, Any]] = {}
    for record in records:
        if "step" not in record or ("loss" not in record and "eval_loss" not in record):
            raise CompareError(f"{source}: a record without 'step' or 'loss': {json.dumps(record)[:200]}")
        if "loss" in record:
            steps[int(record["step"])] = record
        if "eval_loss" in record:
            evals[int(record["step"])] = record
    if not steps:
        raise CompareError(f"{source}: no steps logged")
    return [steps[s] for s in sorted(steps)], [evals[s] for s in sorted(evals)]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    with open(path) as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CompareError(f"{path}:{number}: not JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise CompareError(f"{path}:{number}: expected a JSON object")
            records.append(record)
    return records


def _wandb_chunks(data: bytes, path: Path) -> Iterator[bytes]:
    """The records of a .wandb log; stops quietly at a torn tail (a run still writing, or killed)."""
    if len(data) < _CHUNK_HEADER or data[:4] != _WANDB_IDENT:
        raise CompareError(f"{path}: not a W&B run log (no ':W&B' header)")
    _, magic, version = struct.unpack("<4sHB", data[:_CHUNK_HEADER])
    if magic != _WANDB_MAGIC or version != 0:
        raise CompareError(f"{path}: unsupported W&B run log (magic {magic:#x}, version {version})")
    pos, pending = _CHUNK_HEADER, b""
    while pos + _CHUNK_HEADER <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _CHUNK_HEADER:  # block trailer: zero padding
            pos += room
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos : pos + _CHUNK_HEADER])
        body = data[pos + _CHUNK_HEADER : pos + _CHUNK_HEADER + length]
        if kind == 0 or len(body) < length or zlib.crc32(bytes([kind]) + body) != checksum:
            if pos + _CHUNK_HEADER + length < len(data) and any(data[pos:]):
                print(f"warning: {path}: unreadable record at byte {pos}; using the steps before it", file=sys.stderr)
            return
        pos += _CHUNK_HEADER + length
        if kind == _FULL:
            yield body
        elif kind == _FIRST:
            pending = body
        elif kind == _MIDDLE:
            pending += body
        elif kind == _LAST:
            yield pending + body
            pending = b""


def _read_wandb_log(path: Path) -> tuple[str, list[dict[str, Any]]]:
    """(run display name, history rows) from a run-*.wandb file."""
    try:
        from wandb.proto import wandb_internal_pb2
    except ImportError:
        raise CompareError(f"{path}: reading .wandb files needs the wandb package (pip install wandb)") from None
    name, rows = "", []
    for chunk in _wandb_chunks(path.read_bytes(), path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        kind = record.WhichOneof("record_type")
        if kind == "run" and record.run.display_name:
            name = record.run.display_name
        elif kind == "history":
            row: dict[str, Any] = {}
            for item in record.history.item:
                key = ".".join(item.nested_key) if item.nested_key else item.key
                row[key] = json.loads(item.value_json)
            row["step"] = row.pop("_step", record.history.step.num)
            rows.append(row)
    return name, rows


def load_run(path: Path, label: str = "") -> Run:
    """Read one run directory (see the module docstring for the kinds accepted)."""
    if not path.is_dir():
        raise CompareError(f"{path}: no such directory")
    if (path / METRICS_FILE).is_file():
        return Run(label or str(path), path, *_by_step(_read_jsonl(path / METRICS_FILE), path / METRICS_FILE))
    if (path / WANDB_HISTORY_FILE).is_file():
        history = path / WANDB_HISTORY_FILE
        rows = _read_jsonl(history)
        for i, row in enumerate(rows, 1):
            row["step"] = row.pop("_step", i)
        return Run(label or path.name, path, *_by_step(rows, history))
    logs = sorted(path.glob("run-*.wandb"))
    if len(logs) > 1:
        raise CompareError(f"{path}: several run-*.wandb files; pass one run directory per run")
    if logs:
        name, rows = _read_wandb_log(logs[0])
        return Run(label or name or path.name, path, *_by_step(rows, logs[0]))
    raise CompareError(
        f"{path}: no {METRICS_FILE}, {WANDB_HISTORY_FILE} or run-*.wandb (give a train.py --output_dir or a "
        "wandb/offline-run-* directory)"
    )


def _finite(values: list[float]) -> list[float]:
    return [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def summarize(run: Run) -> dict[str, Any]:
    """The table row of one run; None where the metric was not logged (or never finite)."""
    losses = [float(r["loss"]) for r in run.records]
    speeds = _finite([r.get("tokens_per_s", math.nan) for r in run.records])
    peaks = []
    for r in run.records:
        per_rank = r.get("peak_memory_bytes_per_rank") or [r.get("peak_memory_bytes")]
        peaks += _finite([p for p in per_rank if p is not None])
    finite_losses = _finite(losses)
    eval_losses = [float(r["eval_loss"]) for r in run.evals]
    finite_evals = _finite(eval_losses)
    rewards = {
        f"final_{prefix}reward_{what}": _last(records, f"{prefix}rewards/{key}")
        for prefix, records in (("", run.records), ("eval_", run.evals))
        for what, key in (("accuracy", "accuracies"), ("margin", "margins"))
    }
    return {
        "name": run.name,
        "source": str(run.source),
        "steps": len(run.records),
        "final_loss": losses[-1] if math.isfinite(losses[-1]) else None,
        "min_loss": min(finite_losses) if finite_losses else None,
        "final_eval_loss": eval_losses[-1] if eval_losses and math.isfinite(eval_losses[-1]) else None,
        "min_eval_loss": min(finite_evals) if finite_evals else None,
        "mean_tokens_per_s": sum(speeds) / len(speeds) if speeds else None,
        "peak_memory_gib": max(peaks) / GIB if peaks else None,
        **rewards,
        "final_reward": _last(run.records, "reward"),
    }


REWARD_COLUMNS = {
    "final_reward_accuracy": "reward accuracy",
    "final_reward_margin": "reward margin",
    "final_eval_reward_accuracy": "eval reward accuracy",
    "final_eval_reward_margin": "eval reward margin",
    "final_reward": "reward",
}
"""The preference and GRPO columns of the table (shown when some run has them)."""


def _last(records: list[dict[str, Any]], key: str) -> float | None:
    values = _finite([r[key] for r in records if key in r])
    return values[-1] if values else None


def markdown_table(rows: list[dict[str, Any]]) -> str:
    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    rewards = [key for key in REWARD_COLUMNS if any(r.get(key) is not None for r in rows)]
    header = (
        "| run | steps | final loss | min loss | final eval loss | min eval loss | mean tokens/s | peak memory (GiB) |"
    )
    lines = [
        header + "".join(f" {REWARD_COLUMNS[key]} |" for key in rewards),
        "|---|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(rewards),
    ]
    for r in rows:
        cells = [
            r["name"].replace("|", "\\|"),
            str(r["steps"]),
            fmt(r["final_loss"], ".4f"),
            fmt(r["min_loss"], ".4f"),
            fmt(r["final_eval_loss"], ".4f"),
            fmt(r["min_eval_loss"], ".4f"),
            fmt(r["mean_tokens_per_s"], ".1f"),
            fmt(r["peak_memory_gib"], ".2f"),
            *(fmt(r[key], ".3f" if key.endswith("accuracy") else ".4f") for key in rewards),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over up to `window` points (the first points average what exists so far)."""
    out, total, kept = [], 0.0, []
    for v in values:
        kept.append(v)
        total += v
        if len(kept) > window:
            total -= kept.pop(0)
        out.append(total / len(kept))
    return out


def plot(runs: list[Run], output: Path, window: int) -> None:
    """Loss against step for every run on one axis, evaluation loss dashed, written to `output` (format from its
    suffix)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise CompareError("the plot needs matplotlib (pip install matplotlib)") from None
    preference = any("rewards/accuracies" in r or "reward" in r for run in runs for r in run.records)
    if preference:
        fig, (ax, reward_ax) = plt.subplots(2, 1, figsize=(8, 8), layout="constrained", sharex=True)
        _plot_rewards(reward_ax, runs, window)
    else:
        fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    for run in runs:
        steps = [r["step"] for r in run.records]
        losses = [float(r["loss"]) for r in run.records]
        if window > 1:
            (line,) = ax.plot(steps, losses, alpha=0.25, linewidth=1)
            ax.plot(steps, smooth(losses, window), color=line.get_color(), label=run.name)
        else:
            (line,) = ax.plot(steps, losses, label=run.name, marker="." if len(steps) < 50 else None)
        if run.evals:
            eval_steps = [r["step"] for r in run.evals]
            eval_losses = [float(r["eval_loss"]) for r in run.evals]
            ax.plot(eval_steps, eval_losses, "--o", color=line.get_color(), markersize=4, label=f"{run.name} (eval)")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("loss" + (f" ({window}-step moving average)" if window > 1 else ""))
    ax.set_title("Training and evaluation loss" if any(run.evals for run in runs) else "Training loss")
    ax.grid(True, alpha=0.3)
    ax.legend()
    output.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(output, dpi=120)
    except (OSError, ValueError) as exc:
        raise CompareError(f"--output {output}: {exc}") from None
    finally:
        plt.close(fig)


def _plot_rewards(ax: Any, runs: list[Run], window: int) -> None:
    """Reward accuracy (solid) and margin (dotted, right axis) against step, evaluation values as markers; GRPO's
    mean reward (dashed)."""
    margin_ax = ax.twinx()
    for run in runs:
        sampled = [r for r in run.records if "reward" in r]
        if sampled:
            values = [float(r["reward"]) for r in sampled]
            ax.plot([r["step"] for r in sampled], smooth(values, window) if window > 1 else values, "--",
                    label=f"{run.name} reward")  # fmt: skip
        records = [r for r in run.records if "rewards/accuracies" in r]
        if not records:
            continue
        steps = [r["step"] for r in records]
        accuracy = [float(r["rewards/accuracies"]) for r in records]
        margin = [float(r["rewards/margins"]) for r in records]
        if window > 1:
            accuracy, margin = smooth(accuracy, window), smooth(margin, window)
        (line,) = ax.plot(steps, accuracy, label=f"{run.name} accuracy")
        margin_ax.plot(steps, margin, ":", color=line.get_color(), label=f"{run.name} margin")
        evals = [r for r in run.evals if "eval_rewards/accuracies" in r]
        if evals:
            ax.plot([r["step"] for r in evals], [r["eval_rewards/accuracies"] for r in evals], "o",
                    color=line.get_color(), label=f"{run.name} eval accuracy")  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("reward accuracy; GRPO's reward (dashed)")
    margin_ax.set_ylabel("reward margin (dotted)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    labels = [s.strip() for s in args.labels.split(",")] if args.labels else [""] * len(args.runs)
    try:
        if len(labels) != len(args.runs):
            raise CompareError(f"--labels has {len(labels)} names for {len(args.runs)} runs")
        runs = [load_run(path, label) for path, label in zip(args.runs, labels, strict=True)]
        plot(runs, args.output, args.smooth)
    except CompareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = [summarize(run) for run in runs]
    print(json.dumps(rows, indent=2) if args.json else markdown_table(rows))
    print(f"plot written to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
