"""Worker for test_options: many short trainings in one torchrun job (imports and process group paid once).

python options_worker.py MODEL_DIR PRO_MODEL_DIR TIED_MODEL_DIR OUT_DIR SUITE FSDP_VERSION   (SUITE: two | four)
Rank 0 writes OUT_DIR/results.json: {scenario: {"losses", "param_bytes", "error"}}.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

from qlora_fsdp.config import PRECISIONS, build_config
from qlora_fsdp.distributed import init_distributed, teardown
from qlora_fsdp.metrics import read_metrics
from qlora_fsdp.trainer import run

DATASET = str(Path(__file__).resolve().parents[2] / "data" / "alpaca_tiny.jsonl")
# Two rows per step, the same two every step: the loss must fall when anything trains.
OVERFIT = {
    "dataset": DATASET, "dataset_samples": 2, "batch_size": 1, "context_length": 64, "max_steps": 5,
    "lr": 0.01, "lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.0, "device": "cpu", "log_to": "stdout",
    "precision": "fp32", "quant": "bnb", "seed": 1,
}  # fmt: skip


def two_rank_scenarios(model: str, pro_model: str, tied_model: str) -> dict[str, dict]:
    s: dict[str, dict] = {}
    for quant in ("bnb", "hqq"):
        for precision in PRECISIONS:
            s[f"precision-{precision}-{quant}"] = {"quant": quant, "precision": precision}
    for strategy in ("full_shard", "shard_grad_op", "no_shard"):
        s[f"sharding-{strategy}"] = {"sharding_strategy": strategy}
    s["ckpt-off"] = {"gradient_checkpointing": False}
    s["ckpt-nonreentrant"] = {"gradient_checkpointing": True, "reentrant_checkpointing": False}
    s["ckpt-reentrant"] = {"gradient_checkpointing": True, "reentrant_checkpointing": True}
    s["activation-offload"] = {"activation_offload": True}
    s["accum-2x1"] = {"gradient_accumulation_steps": 2, "dataset_samples": 4}
    s["accum-1x2"] = {"batch_size": 2, "dataset_samples": 4}
    s["optimizer-adam"] = {"optimizer": "adam"}
    s["optimizer-sgd"] = {"optimizer": "sgd", "lr": 1.0}
    s["optimizer-adadelta"] = {"optimizer": "adadelta", "lr": 10.0}
    for quant in ("bnb", "hqq"):
        s[f"dora-{quant}"] = {"train_type": "dora", "quant": quant}
    s["full-finetune"] = {"train_type": "full", "quant": "none", "lr": 0.001}
    s["plain-lora"] = {"quant": "none"}
    s["llama-pro-hqq"] = {"model": pro_model, "train_type": "llama_pro", "quant": "hqq", "lr": 0.001}
    s["profile"] = {"profile": True, "profile_steps": "2,3"}
    s["tied-embeddings"] = {"model": tied_model}
    s["optimizer-sgd-clipped"] = {"optimizer": "sgd", "lr": 1.0, "grad_norm": 0.01, "wd": 0.1}
    s["schedule-cosine"] = {"lr_scheduler": "cosine", "warmup_ratio": 0.2, "cosine_min_lr_ratio": 0.1}
    s["schedule-linear"] = {"lr_scheduler": "linear", "warmup_ratio": 0.2}
    s["train-on-inputs"] = {"train_on_inputs": True}
    for style in ("guanaco", "qna"):
        s[f"prompt-{style}"] = {"prompt_style": style}
    s["dummy-dataset"] = {"dataset": "dummy", "dataset_samples": 4}
    s["fp16-nan-skip"] = {"precision": "fp16_autocast", "lr": 1e30, "nan_policy": "skip"}
    for name in s:
        s[name].setdefault("model", model)
    return s


def four_rank_scenarios(model: str) -> dict[str, dict]:
    base = {"model": model, "dataset_samples": 4}
    return {
        "four-full_shard": {**base, "sharding_strategy": "full_shard"},
        "four-hybrid_shard": {**base, "sharding_strategy": "hybrid_shard", "shard_group_size": 2},
        "four-hybrid_shard_zero2": {**base, "sharding_strategy": "hybrid_shard_zero2", "shard_group_size": 2},
    }


def main() -> None:
    model, pro_model, tied_model, out, suite = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4]), sys.argv[5]
    version = int(sys.argv[6])
    env = init_distributed(device="cpu", timeout_s=120)  # a scenario failing on one rank must not hang the rest
    scenarios = two_rank_scenarios(model, pro_model, tied_model) if suite == "two" else four_rank_scenarios(model)
    results = {}
    for name, flags in scenarios.items():
        run_dir = out / name
        cfg = build_config({**OVERFIT, "fsdp_version": version, **flags, "output_dir": str(run_dir)}).validate()
        try:
            run(cfg)
            records = read_metrics(run_dir) if env.rank == 0 else []
            results[name] = {
                "losses": [r["loss"] for r in records],
                "lrs": [r["lr"] for r in records],
                "label_tokens": [r["label_tokens"] for r in records],
                "tokens": [r["tokens"] for r in records],
                "param_bytes": records[0]["param_bytes_per_rank"] if records else [],
                "files": sorted(p.name for p in run_dir.rglob("*") if p.is_file()) if env.rank == 0 else [],
                "output_dir": str(run_dir),
                "error": None,
            }
        except Exception as exc:  # report every scenario, not just the first failure
            results[name] = {"losses": [], "param_bytes": [], "files": [], "error": traceback.format_exc()[-2000:]}
            print(f"{name}: {exc}", file=sys.stderr)
    if env.rank == 0:
        (out / "results.json").write_text(json.dumps(results, indent=1))
    teardown()


if __name__ == "__main__":
    main()
