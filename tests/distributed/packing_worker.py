"""Worker for test_packing_eval: packed and evaluated trainings in one job (python for 1 rank, torchrun for 2).

python packing_worker.py MODEL_DIR OUT_DIR. Rank 0 writes OUT_DIR/results.json: {scenario: {"losses", "evals",
"error", ...}}. The global batch is the same at every world size (2 // world_size rows per rank), so 1- and 2-rank
jobs train the same rows.

For the packed scenarios rank 0 also computes, without any sharding, the loss of step 1's packed rows three ways:
their samples run one by one as ordinary rows ("unpacked", the reference), the packed rows through the same
unsharded model ("packed"), and what the sharded run logged.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from qlora_fsdp.config.options import TrainConfig, build_config, replace
from qlora_fsdp.data.rows import model_inputs
from qlora_fsdp.errors import UserError
from qlora_fsdp.parallel.distributed import init_distributed
from qlora_fsdp.train.metrics import read_metrics
from qlora_fsdp.train.trainer import run
from tests.distributed.options_worker import first_global_batch, unsharded_model
from tests.distributed.scenarios import run_scenarios

DATASET = str(Path(__file__).resolve().parents[2] / "data" / "alpaca_tiny.jsonl")
BASE = {
    "dataset": DATASET, "context_length": 64, "max_steps": 2, "lr": 0.01, "lora_rank": 8, "lora_alpha": 16,
    "lora_dropout": 0.0, "device": "cpu", "log_to": "stdout", "precision": "fp32", "quant": "bnb", "seed": 1,
    "save_model": False,
}  # fmt: skip
PACKED = {"packing": True, "context_length": 256, "max_steps": 1}
# Dropout on: an evaluation that drew from the training RNG would change the later training losses.
EVAL_EVERY_5 = {"eval_split": 0.1, "eval_steps": 5, "max_steps": 6, "lora_dropout": 0.1}


def scenarios(world_size: int) -> dict[str, dict]:
    s: dict[str, dict] = {
        "packed-bnb": {**PACKED, "quant": "bnb"},
        "packed-hqq": {**PACKED, "quant": "hqq"},
        "packed-split-hqq": {**PACKED, "quant": "hqq", "context_length": 48, "packing_split": True},
        # Evaluated at steps 5 and 6, against only at the end (step 6): the same training either way.
        "eval-every-5": EVAL_EVERY_5,
        "eval-at-end": {**EVAL_EVERY_5, "eval_steps": 0},
        # Compared across world sizes (no dropout, whose masks depend on the rank).
        "eval-ranks": {"eval_split": 0.1, "max_steps": 3, "packing": True, "context_length": 128},
        "packed-resume": {"packing": True, "context_length": 128, "max_steps": 6, "save_steps": 3, "lora_dropout": 0.1},
    }
    if world_size == 1:  # a property of training, not of sharding: once is enough
        s["eval-falls"] = {"eval_split": 0.1, "eval_steps": 5, "max_steps": 60, "packing": True, "context_length": 128}
    else:  # FSDP1 evaluates through flat parameters: the sharded case is the one to check
        s["eval-every-5-fsdp1"] = {**EVAL_EVERY_5, "fsdp_version": 1}
        s["eval-at-end-fsdp1"] = {**EVAL_EVERY_5, "eval_steps": 0, "fsdp_version": 1}
    for flags in s.values():
        flags.setdefault("batch_size", 2 // world_size)
    return s


def sample_rows(batch: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, labels) of every sample in the packed rows, cut where the positions restart at 0."""
    out = []
    for r in range(batch["input_ids"].shape[0]):
        starts = [*(batch["position_ids"][r] == 0).nonzero().flatten().tolist(), batch["input_ids"].shape[1]]
        for start, end in itertools.pairwise(starts):
            if batch["attention_mask"][r, start:end].all():
                out.append((batch["input_ids"][r, start:end], batch["labels"][r, start:end]))
    return out


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).double(), labels[:, 1:].flatten(), reduction="sum")


def packing_reference(cfg: TrainConfig, world_size: int) -> dict[str, float]:
    """Step 1's loss from its samples run alone and from its packed rows, both unsharded in this process."""
    batch = first_global_batch(cfg, world_size)
    model = unsharded_model(cfg).eval()  # dropout is 0: eval() changes nothing else
    tokens = int((batch["labels"][:, 1:] != -100).sum())
    with torch.no_grad():
        packed = model(
            **{k: v for k, v in model_inputs(batch, torch.device("cpu"), varlen=False).items() if k != "labels"}
        )
        unpacked = sum(loss_sum(model(input_ids=ids[None]).logits, labels[None]) for ids, labels in sample_rows(batch))
        return {
            "unpacked": unpacked.item() / tokens,
            "packed": loss_sum(packed.logits, batch["labels"]).item() / tokens,
            "samples": len(sample_rows(batch)),
            "rows": batch["input_ids"].shape[0],
        }


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    env = init_distributed(device="cpu", timeout_s=120)
    runs = scenarios(env.world_size)

    def one(name: str) -> dict:
        flags = runs[name]
        run_dir = out / name
        cfg = build_config({**BASE, "model": model, **flags, "output_dir": str(run_dir)}).validate()
        run(cfg)
        records = read_metrics(run_dir) if env.rank == 0 else []
        result = {
            "losses": [r["loss"] for r in records if "loss" in r],
            "evals": [r for r in records if "eval_loss" in r],
            "efficiency": [r["packing_efficiency"] for r in records if "loss" in r],
            "tokens": [r["tokens"] for r in records if "loss" in r],
        }
        if name == "packed-resume":
            # Resume from the step-3 checkpoint: steps 4-6 again, then a resume that changes --packing.
            resumed = build_config({**BASE, "model": model, **flags, "output_dir": str(run_dir),
                                    "resume_from": str(run_dir / "checkpoint-3")}).validate()  # fmt: skip
            run(resumed)
            result["resumed"] = [r["loss"] for r in read_metrics(run_dir) if "loss" in r] if env.rank == 0 else []
            try:
                run(replace(resumed, packing=False))
            except UserError as exc:
                result["refused"] = str(exc)
        if env.rank == 0 and name.startswith("packed-") and name != "packed-resume":
            result["reference"] = packing_reference(cfg, env.world_size)
        return result

    run_scenarios(runs, one, out, env, failed={"evals": []})


if __name__ == "__main__":
    main()
