"""scripts/compare_runs.py on real runs of train.py (bnb with evaluation, HQQ without), their W&B offline logs, and
bad input."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qlora_fsdp.train.metrics import read_metrics
from tests.conftest import DATASET, REPO_ROOT, train, worker_env

pytestmark = pytest.mark.distributed  # every test here runs the CLI or a script in a process

SCRIPT = REPO_ROOT / "scripts" / "compare_runs.py"
STEPS = 3
COMMON = [
    "--precision", "fp32", "--batch_size", "1", "--lora_dropout", "0", "--lr_scheduler", "constant", "--lr", "0.01",
    "--device", "cpu", "--dataset", str(DATASET), "--context_length", "64", "--max_steps", str(STEPS),
    "--save_model", "false",
]  # fmt: skip
GIB = 2**30


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two short one-process runs; bnb also evaluates (steps 2 and 3) and logs to W&B (offline, as worker_env sets
    WANDB_MODE)."""
    out = {}
    bnb = ["--log_to", "wandb", "--project_name", "cmp", "--run_name", "bnb-run", "--eval_split", "0.05",
           "--eval_steps", "2"]  # fmt: skip
    for quant, logging in (("bnb", bnb), ("hqq", ["--log_to", "stdout"])):
        out[quant] = tmp_path_factory.mktemp(f"cmp-{quant}")
        args = ["--model", str(tiny_model), "--quant", quant, *COMMON, *logging, "--output_dir", str(out[quant])]
        train(args, nproc=0)
    return out


def compare(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        cwd=REPO_ROOT,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def expected_row(run_dir: Path) -> dict[str, float | int]:
    """The table row, computed here straight from metrics.jsonl."""
    records = [r for r in read_metrics(run_dir) if "loss" in r]
    losses = [r["loss"] for r in records]
    evals = [r["eval_loss"] for r in read_metrics(run_dir) if "eval_loss" in r]
    return {
        "steps": len(records),
        "final_loss": losses[-1],
        "min_loss": min(losses),
        "final_eval_loss": evals[-1] if evals else None,
        "min_eval_loss": min(evals) if evals else None,
        "mean_tokens_per_s": sum(r["tokens_per_s"] for r in records) / len(records),
        "peak_memory_gib": max(max(r["peak_memory_bytes_per_rank"]) for r in records) / GIB,
    }


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG: opened with PIL when installed, else read from the signature and IHDR chunk."""
    try:
        from PIL import Image
    except ImportError:
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
        assert data[12:16] == b"IHDR", "PNG without an IHDR chunk first"
        return struct.unpack(">II", data[16:24])
    with Image.open(path) as image:
        assert image.format == "PNG"
        image.load()
        return image.size


def table_rows(markdown: str) -> dict[str, list[str]]:
    """{run name: [cells after the name]} from the Markdown table."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    assert lines[0] == (
        "| run | steps | final loss | min loss | final eval loss | min eval loss | mean tokens/s | peak memory (GiB) |"
    )
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    return {row[0]: row[1:] for row in rows}


def test_plot_and_markdown_table(runs: dict[str, Path], tmp_path: Path) -> None:
    png = tmp_path / "plots" / "compare.png"
    result = compare(runs["bnb"], runs["hqq"], "--output", png, "--labels", "bnb,hqq")
    assert result.returncode == 0, result.stderr

    width, height = png_size(png)
    assert width > 0 and height > 0

    rows = table_rows(result.stdout)
    assert list(rows) == ["bnb", "hqq"]
    for name, cells in rows.items():
        exp = expected_row(runs[name])
        assert cells == [
            str(exp["steps"]),
            f"{exp['final_loss']:.4f}",
            f"{exp['min_loss']:.4f}",
            "-" if exp["final_eval_loss"] is None else f"{exp['final_eval_loss']:.4f}",
            "-" if exp["min_eval_loss"] is None else f"{exp['min_eval_loss']:.4f}",
            f"{exp['mean_tokens_per_s']:.1f}",
            f"{exp['peak_memory_gib']:.2f}",
        ], name


def test_json_table_matches_metrics(runs: dict[str, Path], tmp_path: Path) -> None:
    result = compare(runs["bnb"], runs["hqq"], "--output", tmp_path / "c.png", "--json", "--smooth", "2")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [row["name"] for row in rows] == [str(runs["bnb"]), str(runs["hqq"])]  # default name: the path given
    for row, quant in zip(rows, ("bnb", "hqq"), strict=True):
        exp = expected_row(runs[quant])
        assert row["steps"] == exp["steps"] == STEPS
        last_step = [r for r in read_metrics(runs[quant]) if "loss" in r][-1]
        assert row["final_loss"] == exp["final_loss"] == last_step["loss"]
        for key in ("min_loss", "mean_tokens_per_s", "peak_memory_gib"):
            assert row[key] == pytest.approx(exp[key], rel=1e-12), key
        assert (row["final_eval_loss"], row["min_eval_loss"]) == (exp["final_eval_loss"], exp["min_eval_loss"])
    # bnb evaluated after steps 2 and 3 (the end): both rows are in the table's figures; HQQ shows none.
    evals = [r for r in read_metrics(runs["bnb"]) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 3]
    assert rows[0]["final_eval_loss"] == evals[-1]["eval_loss"] != evals[0]["eval_loss"]
    assert rows[1]["final_eval_loss"] is None and rows[1]["min_eval_loss"] is None
    assert rows[0]["final_loss"] != rows[1]["final_loss"], "bnb and HQQ runs should differ"
    assert png_size(tmp_path / "c.png")[0] > 0


def test_wandb_offline_run_gives_the_same_row(runs: dict[str, Path], tmp_path: Path) -> None:
    """The run-*.wandb log of the bnb run, read without W&B servers, holds the same series as metrics.jsonl."""
    (wandb_run,) = (runs["bnb"] / "wandb").glob("offline-run-*")
    result = compare(wandb_run, runs["bnb"], "--json", "--output", tmp_path / "w.png")
    assert result.returncode == 0, result.stderr
    from_wandb, from_metrics = json.loads(result.stdout)
    assert from_wandb["name"] == "bnb-run"  # the --run_name, from the log's run record
    for key in ("steps", "final_loss", "min_loss", "final_eval_loss", "min_eval_loss", "mean_tokens_per_s"):
        assert from_wandb[key] == pytest.approx(from_metrics[key], rel=1e-12), key
    assert from_wandb["peak_memory_gib"] == pytest.approx(from_metrics["peak_memory_gib"], rel=1e-12)


def test_wandb_log_spanning_many_blocks(tmp_path: Path) -> None:
    """600 steps and one 70 kB record: records cross the log's 32 KiB blocks (FIRST/MIDDLE/LAST chunks)."""
    writer = textwrap.dedent(
        f"""
        import wandb
        run = wandb.init(project="p", name="synthetic", dir={str(tmp_path)!r})
        for s in range(1, 601):
            record = {{"loss": 10.0 / s, "tokens_per_s": 100.0 + s, "peak_memory_bytes_per_rank": [s, 2 * s]}}
            if s == 300:
                record["note"] = "x" * 70000
            run.log(record, step=s)
        run.finish()
        """
    )
    env = {**worker_env(), "WANDB_SILENT": "true"}
    subprocess.run([sys.executable, "-c", writer], env=env, check=True, timeout=120, capture_output=True)
    (wandb_run,) = (tmp_path / "wandb").glob("offline-run-*")
    assert next(wandb_run.glob("run-*.wandb")).stat().st_size > 4 * 32768

    result = compare(wandb_run, "--json", "--output", tmp_path / "s.png", "--smooth", "50")
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(result.stdout)
    assert row["name"] == "synthetic" and row["steps"] == 600
    assert row["final_loss"] == row["min_loss"] == 10.0 / 600
    assert row["mean_tokens_per_s"] == pytest.approx(100.0 + 300.5)
    assert row["peak_memory_gib"] == pytest.approx(1200 / GIB)


@pytest.mark.parametrize("kind", ["empty", "missing"])
def test_dir_without_metrics_is_one_line_error(runs: dict[str, Path], tmp_path: Path, kind: str) -> None:
    bad = tmp_path / "not-a-run"
    if kind == "empty":
        bad.mkdir()
    result = compare(runs["bnb"], bad, "--output", tmp_path / "x.png")
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(bad) in lines[0], result.stderr
    assert not (tmp_path / "x.png").exists()


def test_bad_metrics_line_names_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": \n')
    result = compare(tmp_path, "--output", tmp_path / "x.png")
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {tmp_path / 'metrics.jsonl'}:2: not JSON (Expecting value)"


def test_resumed_run_counts_each_step_once(tmp_path: Path) -> None:
    """A step logged twice (training resumed from an earlier checkpoint) counts once, with its last value."""
    records = [(1, 3.0), (2, 2.0), (3, 1.5), (2, 2.5), (3, 1.0), (4, 0.5)]
    lines = [json.dumps({"step": s, "loss": loss, "tokens_per_s": 10.0}) for s, loss in records]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    result = compare(tmp_path, "--json", "--output", tmp_path / "x.png")
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(result.stdout)
    assert (row["steps"], row["final_loss"], row["min_loss"]) == (4, 0.5, 0.5)
    assert row["peak_memory_gib"] is None
    assert not math.isnan(row["mean_tokens_per_s"])


def test_preference_runs_tabulate_and_plot_reward_accuracy_and_margin(tmp_path: Path) -> None:
    """A DPO run's reward accuracy and margin, training and evaluation, become columns (absent for SFT runs) and a
    second panel of the plot."""
    dpo, sft = tmp_path / "dpo", tmp_path / "sft"
    dpo.mkdir()
    sft.mkdir()
    steps = [{"step": s, "loss": 0.7 - 0.1 * s, "rewards/accuracies": 0.25 * s, "rewards/margins": 0.1 * s}
             for s in (1, 2, 3)]  # fmt: skip
    evals = [{"step": 3, "eval_loss": 0.4, "eval_rewards/accuracies": 0.9, "eval_rewards/margins": 0.35}]
    (dpo / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*steps, *evals]))
    (sft / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    result = compare(dpo, sft, "--labels", "dpo,sft", "--json", "--output", tmp_path / "x.png")
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert rows["dpo"]["final_reward_accuracy"] == 0.75 and rows["dpo"]["final_eval_reward_margin"] == 0.35
    assert rows["sft"]["final_reward_accuracy"] is None
    table = compare(dpo, sft, "--labels", "dpo,sft", "--output", tmp_path / "y.png").stdout
    assert "| reward accuracy | reward margin | eval reward accuracy | eval reward margin |" in table
    assert "| 0.750 | 0.3000 | 0.900 | 0.3500 |" in table and "| - | - | - | - |" in table
    from PIL import Image

    plain = compare(sft, "--output", tmp_path / "z.png")
    assert "reward accuracy" not in plain.stdout
    assert Image.open(tmp_path / "y.png").size[1] > Image.open(tmp_path / "z.png").size[1]  # the second panel


def test_grpo_runs_tabulate_and_plot_the_reward(tmp_path: Path) -> None:
    """A GRPO run's mean reward is a column (its last value) and a curve in the second panel."""
    grpo, sft = tmp_path / "grpo", tmp_path / "sft"
    grpo.mkdir()
    sft.mkdir()
    steps = [{"step": s, "loss": 0.01 * s, "reward": 0.2 * s, "reward_std": 0.1} for s in (1, 2, 3)]
    (grpo / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    (sft / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    rows = {row["name"]: row for row in json.loads(compare(grpo, sft, "--labels", "grpo,sft", "--json", "--output",
                                                            tmp_path / "x.png").stdout)}  # fmt: skip
    assert rows["grpo"]["final_reward"] == pytest.approx(0.6) and rows["sft"]["final_reward"] is None
    table = compare(grpo, sft, "--labels", "grpo,sft", "--output", tmp_path / "y.png").stdout
    assert "| reward |" in table and "| 0.6000 |" in table and "reward accuracy" not in table
    from PIL import Image

    compare(sft, "--output", tmp_path / "z.png")
    assert Image.open(tmp_path / "y.png").size[1] > Image.open(tmp_path / "z.png").size[1]  # the second panel
