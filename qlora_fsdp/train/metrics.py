"""Per-step metrics: a tqdm bar, OUTPUT_DIR/metrics.jsonl, and Weights & Biases; rank 0 writes all three.

metrics.jsonl holds one row per optimizer step (with "loss") and, when evaluating, a row per evaluation (with
"eval_loss" and "eval_ppl") after the row of the step it followed.
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import sys
from pathlib import Path
from typing import Any

import torch

from qlora_fsdp.config.options import OutputConfig

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_run_id.txt"


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak: the CUDA allocator's on GPU, the resident set's high-water mark on CPU.

    On Linux VmHWM is read: ru_maxrss can carry over the peak of the process that launched this one.
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    # ru_maxrss is KiB on Linux, bytes on macOS.
    scale = 1 if sys.platform == "darwin" else 1024
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale


class MetricsLogger:
    """Writes one JSON object per optimizer step; a no-op on ranks other than 0."""

    def __init__(
        self,
        cfg: OutputConfig,
        *,
        output_dir: Path,
        is_main: bool,
        total_steps: int,
        run_config: dict[str, Any],
        resume_step: int | None = None,
    ) -> None:
        """A fresh run starts metrics.jsonl anew; a resumed one keeps the records up to `resume_step`.

        Records past the checkpoint came from the interrupted run and are replaced by the resumed steps, so the
        file always holds one consistent trajectory.
        """
        self.is_main = is_main
        self.log_to = cfg.log_to
        self._bar = None
        self._progress: tuple[int, int] | None = None  # (total, initial) of the bar start_progress() opens
        self._wandb = None
        self._file = None
        if not is_main:
            return
        kept = []
        if resume_step is not None and (output_dir / METRICS_FILE).exists():
            kept = [r for r in read_metrics(output_dir) if r["step"] <= resume_step]
        self._file = open(output_dir / METRICS_FILE, "w", buffering=1)  # noqa: SIM115 - closed in close()
        for record in kept:
            self._file.write(json.dumps(record) + "\n")
        if cfg.log_to in ("tqdm", "wandb"):
            self._progress = (total_steps, resume_step or 0)
        if cfg.log_to == "wandb":
            import wandb

            # A resumed run continues the same W&B run rather than starting a second one.
            id_file = output_dir / WANDB_ID_FILE
            if resume_step is not None and id_file.exists():
                run_id = id_file.read_text().strip()
            else:
                run_id = secrets.token_hex(8)
                id_file.write_text(run_id + "\n")
            self._wandb = wandb.init(
                project=cfg.project_name,
                name=cfg.run_name or None,
                entity=cfg.wandb_entity or None,
                config=run_config,
                group=cfg.group or None,
                dir=str(output_dir),
                id=run_id,
                resume="allow",
            )

    def start_progress(self) -> None:
        """Open the progress bar (tqdm, wandb): once the start-up lines are out, so that none is written through it.
        The first step's record opens it if nothing did before."""
        if self._progress is None:
            return
        from tqdm.auto import tqdm

        total, initial = self._progress
        self._progress = None
        self._bar = tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True)

    def log(self, record: dict[str, Any]) -> None:
        if not self.is_main:
            return
        self.start_progress()
        self._file.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
        if self._bar is not None:
            self._bar.set_postfix(
                loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}", tok_s=f"{record['tokens_per_s']:.0f}"
            )
            self._bar.update(1)
            if self._bar.n >= self._bar.total:  # finished: the lines after training follow the bar, not go through it
                self._bar.close()
                self._bar = None
        elif self.log_to == "stdout":
            accuracy = record.get("rewards/accuracies")
            accuracy = "" if accuracy is None else f" rewards/accuracies {accuracy:.3f}"
            print(
                f"step {record['step']} loss {record['loss']:.4f}{accuracy} lr {record['lr']:.3e} "
                f"tokens/s {record['tokens_per_s']:.0f}",
                flush=True,
            )

    def log_eval(self, record: dict[str, Any]) -> None:
        """An evaluation row ({"step", "eval_loss", "eval_ppl", ...}) beside the step's training row."""
        if not self.is_main:
            return
        self._file.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
        shown = {"eval_loss": ".4f", "eval_ppl": ".2f", "eval_rewards/accuracies": ".3f"}
        fields = " ".join(f"{k} {record[k]:{form}}" for k, form in shown.items() if k in record)
        self.message(f"step {record['step']} {fields}")

    def message(self, text: str) -> None:
        """A line for the user that does not break the progress bar."""
        if not self.is_main:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._file is not None:
            self._file.close()
        self._bar = self._wandb = self._file = None


def read_metrics(output_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl (used by tests and comparison tools)."""
    with open(Path(output_dir) / METRICS_FILE) as fh:
        return [json.loads(line) for line in fh if line.strip()]
