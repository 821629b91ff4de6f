"""Worker for test_sequence_parallel: the parity runs of one world size in one torchrun job.

python sequence_worker.py MODEL_DIR MIXTRAL_DIR OUT_DIR SUITE [SAVED_RUN]
SUITE one: every reference on 1 rank, --sequence_parallel_size 1 (the same rows, whole);
SUITE two: the same runs at --sequence_parallel_size 2 on 2 ranks, plus one that saves a checkpoint every step;
SUITE four: --sequence_parallel_size 4 on 4 ranks (a model with 2 key-value heads), dp 2 x sp 2 with hybrid
sharding, and SAVED_RUN's checkpoint of step 2 resumed as dp 2 x sp 2.
Rank 0 writes OUT_DIR/results.json: {scenario: {"losses", "grad_norms", "steps", "label_tokens", "error"}}.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch.distributed as dist

from qlora_fsdp.config.options import build_config
from qlora_fsdp.parallel.distributed import init_distributed
from qlora_fsdp.train.metrics import METRICS_FILE, read_metrics
from qlora_fsdp.train.trainer import run
from tests.distributed.scenarios import run_scenarios

DATA = Path(__file__).resolve().parents[2] / "data"
# Two rows of up to 64 tokens per step on a group (batch 2; dp 2 x batch 1 on four ranks), fp32, three steps: the
# first with the fresh adapters, the others with trained ones.
BASE = {
    "dataset": str(DATA / "alpaca_tiny.jsonl"), "dataset_samples": 8, "batch_size": 2, "context_length": 64,
    "max_steps": 3, "lr": 0.01, "lora_dropout": 0.0, "precision": "fp32", "device": "cpu", "log_to": "stdout",
    "seed": 1, "quant": "bnb",
}  # fmt: skip


def scenarios(model: str, mixtral: str, suite: str) -> dict[str, dict]:
    """Runs of `suite`, each named after the reference (suite one) it must equal."""
    parity = {
        "bnb": {},
        "hqq": {"quant": "hqq"},
        "bnb-fsdp1": {"fsdp_version": 1},
        "hqq-packing": {"quant": "hqq", "packing": True},
        "dpo": {"objective": "dpo", "dataset": str(DATA / "preference_tiny.jsonl")},
        "orpo": {"objective": "orpo", "dataset": str(DATA / "preference_tiny.jsonl")},
        "simpo-eval": {"objective": "simpo", "dataset": str(DATA / "preference_tiny.jsonl"), "eval_split": 0.02},
        "dora-offload": {"train_type": "dora", "activation_offload": True, "gradient_checkpointing": False},
        "mixtral": {"model": mixtral},
    }
    if suite == "one":
        runs = parity
    elif suite == "two":
        runs = {**parity, "saved": {"save_steps": 1}}
        runs = {name: {**flags, "sequence_parallel_size": 2} for name, flags in runs.items()}
    else:
        four = {"batch_size": 1, "sequence_parallel_size": 2, "sharding_strategy": "hybrid_shard",
                "shard_group_size": 2}  # fmt: skip
        runs = {"gqa-s4": {"sequence_parallel_size": 4}, "dp2xsp2": four, "resumed": {**four, "resume_from": "auto"}}
    return {name: {"model": model, **flags} for name, flags in runs.items()}


def main() -> None:
    model, mixtral, out, suite = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    env = init_distributed(device="cpu", timeout_s=120)
    runs = scenarios(model, mixtral, suite)

    def one(name: str) -> dict:
        run_dir = out / name
        if name == "resumed" and env.rank == 0:  # the 2-rank run, stopped after its checkpoint of step 2
            saved = Path(sys.argv[5])
            run_dir.mkdir(parents=True)
            shutil.copytree(saved / "checkpoint-2", run_dir / "checkpoint-2")
            shutil.copy(saved / METRICS_FILE, run_dir / METRICS_FILE)
        dist.barrier()
        run(build_config({**BASE, **runs[name], "output_dir": str(run_dir)}).validate())
        records = read_metrics(run_dir) if env.rank == 0 else []
        steps = [r for r in records if "loss" in r]
        return {
            "losses": [r["loss"] for r in steps],
            "grad_norms": [r["grad_norm"] for r in steps],
            "steps": [r["step"] for r in steps],
            "label_tokens": [r["label_tokens"] for r in steps],
            "eval_losses": [r["eval_loss"] for r in records if "eval_loss" in r],
            "output_dir": str(run_dir),
        }

    run_scenarios(runs, one, out, env)


if __name__ == "__main__":
    main()
