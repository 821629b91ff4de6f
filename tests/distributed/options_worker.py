"""Worker for test_options: many short trainings in one torchrun job (imports and process group paid once).

python options_worker.py MODEL_DIR PRO_MODEL_DIR TIED_MODEL_DIR ODD_MODEL_DIR OUT_DIR SUITE FSDP_VERSION [NAMES]
(SUITE: two | four; NAMES: comma-separated scenarios to run, default all). Rank 0 writes OUT_DIR/results.json:
{scenario: {"losses", "grad_norms", ..., "error"}}.

Besides what each run logs, rank 0 computes a reference for the first step of every fp32 run: the same first
global batch through the same model built without any sharding, in this one process, with PyTorch's own cross
entropy and gradient norm. A sharded run must match it: that is what catches a wrong gradient normalisation, a
broken tie or a misplaced shard, which a falling loss on memorised rows would not.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from qlora_fsdp.config.options import TrainConfig, build_config, choices
from qlora_fsdp.data.loader import Batching, build_loaders
from qlora_fsdp.model.hub import load_tokenizer
from qlora_fsdp.model.lora import init_adapters, inject_lora, lora_layers, prepare_full_finetune
from qlora_fsdp.model.skeleton import build_skeleton, expanded_layer_prefixes
from qlora_fsdp.model.streaming import stream_weights
from qlora_fsdp.parallel.distributed import DistEnv, init_distributed
from qlora_fsdp.parallel.precision import PRECISIONS as MODES
from qlora_fsdp.parallel.precision import quant_compute_dtype
from qlora_fsdp.quant import make_backend
from qlora_fsdp.train.metrics import read_metrics
from qlora_fsdp.train.trainer import run
from tests.distributed.scenarios import run_scenarios

DATASET = str(Path(__file__).resolve().parents[2] / "data" / "alpaca_tiny.jsonl")
# Two rows per step, the same two every step (batch 1 on each of 2 ranks). Chunks of 2 label tokens: every
# scenario's loss goes through the head in several chunks, and its reference uses whole logits.
OVERFIT = {
    "dataset": DATASET, "dataset_samples": 2, "batch_size": 1, "context_length": 64, "max_steps": 5,
    "lr": 0.01, "lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.0, "device": "cpu", "log_to": "stdout",
    "precision": "fp32", "quant": "bnb", "seed": 1, "loss_chunk_tokens": 2,
}  # fmt: skip
# Scenarios whose step-1 activations are counted (gradient checkpointing and activation offload must show).
MEASURED = ("ckpt-off", "ckpt-nonreentrant", "ckpt-reentrant", "activation-offload")


def two_rank_scenarios(model: str, pro_model: str, tied_model: str, odd_model: str, version: int) -> dict[str, dict]:
    s: dict[str, dict] = {}
    if version == 2:  # FSDP1 refuses --compile. HQQ: its dequantization is plain PyTorch that inductor fuses (the GPU
        # suite times bnb too); one compilation costs the suite a minute on 2 cores.
        s["compile-hqq"] = {"compile": True, "quant": "hqq"}
    for quant in ("bnb", "hqq"):
        for precision in choices("precision"):
            s[f"precision-{precision}-{quant}"] = {"quant": quant, "precision": precision}
    for strategy in ("full_shard", "shard_grad_op", "no_shard"):
        s[f"sharding-{strategy}"] = {"sharding_strategy": strategy}
    s["ckpt-off"] = {"gradient_checkpointing": False}
    s["ckpt-nonreentrant"] = {"gradient_checkpointing": True, "reentrant_checkpointing": False}
    s["ckpt-reentrant"] = {"gradient_checkpointing": True, "reentrant_checkpointing": True}
    s["activation-offload"] = {"activation_offload": True, "gradient_checkpointing": False}
    s["tiled-mlp"] = {"tiled_mlp": "3"}  # inside the layers' checkpoints: tiles recomputed within a recompute
    s["accum-2x1"] = {"gradient_accumulation_steps": 2, "dataset_samples": 4}
    s["accum-1x2"] = {"batch_size": 2, "dataset_samples": 4}
    # Each optimizer saves its state at step 5, so the test can see which optimizer really ran.
    s["optimizer-adam"] = {"optimizer": "adam", "save_steps": 5}
    s["optimizer-sgd"] = {"optimizer": "sgd", "lr": 1.0, "save_steps": 5}
    s["optimizer-adadelta"] = {"optimizer": "adadelta", "lr": 10.0, "save_steps": 5}
    s["optimizer-adamw"] = {"optimizer": "adamw", "wd": 0.1, "save_steps": 5}
    for quant in ("bnb", "hqq"):
        s[f"dora-{quant}"] = {"train_type": "dora", "quant": quant}
        # Layer widths of 100: no multiple of HQQ's group size or bnb's block size.
        s[f"odd-shapes-{quant}"] = {"model": odd_model, "quant": quant}
    s["full-finetune"] = {"train_type": "full", "quant": "none", "lr": 0.001}
    s["plain-lora"] = {"quant": "none"}
    s["llama-pro-hqq"] = {"model": pro_model, "train_type": "llama_pro", "quant": "hqq", "lr": 0.001}
    s["profile"] = {"profile": True, "profile_steps": "2,3"}
    s["tied-embeddings"] = {"model": tied_model}
    s["loss-whole-logits"] = {"loss_chunk_tokens": 0}
    s["lora-on-head"] = {"lora_target_modules": "q_proj,v_proj,lm_head"}
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


class SavedBytes:
    """Bytes of tensors the forward pass saves for backward outside any inner saved-tensor hooks: a checkpointed
    layer's activations are saved by the checkpoint's own hooks (or not at all), offloaded ones by save_on_cpu's.
    Saves during backward (a reentrant checkpoint's recompute) are not kept from forward to backward: not counted."""

    def __init__(self) -> None:
        self.total = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if torch._C._current_graph_task_id() == -1:  # not inside a backward pass
            self.total += tensor.numel() * tensor.element_size()
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def first_global_batch(cfg: TrainConfig, world_size: int) -> dict[str, torch.Tensor]:
    """The rows of step 1: what one rank with batch world x batch x accumulation draws first (the data design every
    rank relies on). Padded to the longest of them, not to each rank's own longest: right padding under the
    attention mask changes nothing the loss sees."""
    env = DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo")
    data = dict(vars(cfg.data), batch_size=cfg.data.batch_size * world_size * cfg.optim.gradient_accumulation_steps)
    tokenizer = load_tokenizer(Path(cfg.model.model))
    loader, _ = build_loaders(
        type(cfg.data)(**data), cfg.eval, tokenizer, env, Batching(seed=cfg.run.seed, fixed_shapes=cfg.compute.compile)
    )
    return next(iter(loader))


def unsharded_model(cfg: TrainConfig) -> torch.nn.Module:
    """The model a run trains, with its initial adapters, built in this one process without any sharding."""
    path = Path(cfg.model.model)
    mode = MODES[cfg.fsdp.precision]
    compute = quant_compute_dtype(mode, cfg.quant.compute_dtype)
    backend = make_backend(cfg.quant, storage_dtype=torch.uint8, compute_dtype=compute)
    new_blocks = expanded_layer_prefixes(path) if cfg.lora.train_type == "llama_pro" else ()
    skeleton = build_skeleton(
        cfg.model, backend=backend, param_dtype=mode.param_dtype, full_precision_prefixes=new_blocks
    )
    if cfg.lora.train_type in ("lora", "dora"):
        model = inject_lora(skeleton.model, cfg.lora, dtype=mode.param_dtype)
    else:
        model = prepare_full_finetune(skeleton.model, only_prefixes=new_blocks)
    in_layers = {id(m) for layer in skeleton.units.values() for m in lora_layers(layer)}
    stream_weights(
        skeleton,
        backend=backend,
        device=torch.device("cpu"),
        on_unit_ready=lambda name, layer: init_adapters(lora_layers(layer), seed=cfg.run.seed, name=name),
    )
    init_adapters([m for m in lora_layers(model) if id(m) not in in_layers], seed=cfg.run.seed, name="")
    return model


def reference_first_step(cfg: TrainConfig, world_size: int) -> dict[str, float]:
    """Loss and gradient norm of step 1 computed in this one process, with nothing sharded; the loss is the mean
    over all the step's label tokens."""
    batch = first_global_batch(cfg, world_size)
    model = unsharded_model(cfg)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(), ignore_index=-100)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return {"loss": loss.item(), "grad_norm": torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()}


def main() -> None:
    model, pro_model, tied_model, odd_model = sys.argv[1:5]
    out, suite, version = Path(sys.argv[5]), sys.argv[6], int(sys.argv[7])
    env = init_distributed(device="cpu", timeout_s=120)  # a scenario failing on one rank must not hang the rest
    if suite == "two":
        scenarios = two_rank_scenarios(model, pro_model, tied_model, odd_model, version)
    else:
        scenarios = four_rank_scenarios(model)
    if len(sys.argv) > 8:
        names = sys.argv[8].split(",")
        scenarios = {name: scenarios[name] for name in names}  # a KeyError names a scenario that does not exist

    def one(name: str) -> dict:
        run_dir = out / name
        cfg = build_config({**OVERFIT, "fsdp_version": version, **scenarios[name], "output_dir": str(run_dir)})
        cfg = cfg.validate()
        saved = SavedBytes()
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            run(cfg)
        records = read_metrics(run_dir) if env.rank == 0 else []
        result = {
            "losses": [r["loss"] for r in records],
            "grad_norms": [r["grad_norm"] for r in records],
            "lrs": [r["lr"] for r in records],
            "skipped": [r["skipped"] for r in records],
            "label_tokens": [r["label_tokens"] for r in records],
            "tokens": [r["tokens"] for r in records],
            "param_bytes": records[0]["param_bytes_per_rank"] if records else [],
            "trainable_parameters": records[0]["trainable_parameters"] if records else 0,
            "saved_bytes_per_step": saved.total / cfg.optim.max_steps if name in MEASURED else None,
            "files": sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())
            if env.rank == 0
            else [],
            "output_dir": str(run_dir),
            "compiled_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs,
        }
        if env.rank == 0 and cfg.fsdp.precision == "fp32" and suite == "two":
            result["reference"] = reference_first_step(cfg, env.world_size)
        return result

    run_scenarios(scenarios, one, out, env, failed={"param_bytes": [], "files": []})


if __name__ == "__main__":
    main()
