"""run(cfg): build everything in a fixed order, train, save, and always tear the process group down."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from qlora_fsdp.checkpoint import save_adapter, save_full_model
from qlora_fsdp.config import OptimConfig, TrainConfig
from qlora_fsdp.data import build_dataloader
from qlora_fsdp.distributed import DistEnv, init_distributed, teardown
from qlora_fsdp.errors import UserError
from qlora_fsdp.fsdp import DTYPES, PRECISIONS, Precision, wrap_model
from qlora_fsdp.lora import adapter_keys, inject_lora, prepare_full_finetune
from qlora_fsdp.metrics import MetricsLogger, peak_memory_bytes
from qlora_fsdp.model import load_model, load_tokenizer, resolve_model_path
from qlora_fsdp.optim import build_optimizer, build_scheduler
from qlora_fsdp.quant import make_backend

log = logging.getLogger(__name__)
IGNORE_INDEX = -100


@dataclass
class TrainResult:
    output_dir: Path
    steps: int
    losses: list[float]


def run(cfg: TrainConfig) -> TrainResult:
    """Train as configured on this process's rank of the job; returns where the outputs went."""
    model_path = resolve_model_path(cfg.model.model)
    env = init_distributed(device=cfg.dist.device, timeout_s=cfg.dist.dist_timeout_s)
    try:
        return _run(cfg, env, model_path)
    finally:
        teardown()


def _run(cfg: TrainConfig, env: DistEnv, model_path: Path) -> TrainResult:
    precision = PRECISIONS[cfg.fsdp.precision]
    compute_dtype = precision.compute_dtype if cfg.quant.compute_dtype == "auto" else DTYPES[cfg.quant.compute_dtype]
    torch.manual_seed(cfg.optim.seed)

    tokenizer = load_tokenizer(model_path)
    loader = build_dataloader(cfg.data, tokenizer, env, seed=cfg.optim.seed)
    total_steps = _total_steps(cfg.optim, len(loader))

    backend = make_backend(cfg.quant, storage_dtype=precision.param_dtype, compute_dtype=compute_dtype)
    loaded = load_model(cfg.model, backend=backend, env=env, param_dtype=precision.param_dtype, path=model_path)
    # Adapter init must not depend on how much randomness loading used.
    torch.manual_seed(cfg.optim.seed)
    lora = cfg.lora.train_type == "lora"
    if lora:
        trainable = inject_lora(
            loaded.model,
            cfg.lora,
            dtype=precision.param_dtype,
            quantized_classes=backend.module_classes if backend else (),
        )
        leaves = adapter_keys(trainable)
    else:
        trainable = prepare_full_finetune(loaded.model)
    if cfg.fsdp.gradient_checkpointing and cfg.fsdp.reentrant_checkpointing:
        # Reentrant checkpoints only backpropagate into a segment whose inputs require grad.
        trainable.enable_input_require_grads()

    model = wrap_model(
        trainable,
        cfg.fsdp,
        env=env,
        precision=precision,
        layer_classes=loaded.layer_classes,
        ignore=backend.module_classes if backend else (),
        adapters_own_units=lora,
        sync_from_rank0=cfg.model.low_memory,
    )
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps)

    output_dir = Path(cfg.output.output_dir)
    if env.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    logger = MetricsLogger(
        cfg.output, output_dir=output_dir, is_main=env.is_main, total_steps=total_steps, run_config=cfg.to_dict()
    )
    try:
        losses = train_loop(
            model,
            _micro_batches(loader),
            optimizer,
            scheduler,
            env=env,
            precision=precision,
            accumulation=cfg.optim.gradient_accumulation_steps,
            grad_norm=cfg.optim.grad_norm,
            total_steps=total_steps,
            logger=logger,
        )
        if cfg.output.save_model:
            if lora:
                save_adapter(model, trainable, leaves, output_dir, env=env)
                logger.message(f"adapter saved to {output_dir.resolve()}")
            else:
                save_full_model(model, trainable, output_dir, env=env)
                logger.message(f"model saved to {output_dir.resolve()}")
    finally:
        logger.close()
    return TrainResult(output_dir=output_dir, steps=len(losses), losses=losses)


def _total_steps(cfg: OptimConfig, micro_batches_per_epoch: int) -> int:
    if cfg.max_steps:
        return cfg.max_steps
    steps = cfg.num_epochs * (micro_batches_per_epoch // cfg.gradient_accumulation_steps)
    if steps < 1:
        raise UserError(
            f"--gradient_accumulation_steps {cfg.gradient_accumulation_steps} needs more batches per epoch than the "
            f"dataset gives ({micro_batches_per_epoch}); lower it or use a larger dataset"
        )
    return steps


def _micro_batches(loader: torch.utils.data.DataLoader) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """(epoch, batch) forever; each epoch reshuffles through the DistributedSampler."""
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            yield epoch, batch
        epoch += 1


def _autocast(precision: Precision, device: torch.device) -> contextlib.AbstractContextManager:
    if precision.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=precision.autocast_dtype)


def train_loop(
    model: FSDP,
    batches: Iterator[tuple[int, dict[str, torch.Tensor]]],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    env: DistEnv,
    precision: Precision,
    accumulation: int,
    grad_norm: float,
    total_steps: int,
    logger: MetricsLogger,
) -> list[float]:
    """Optimizer steps of `accumulation` micro-batches each; returns the loss of every step.

    The loss is a sum over label tokens divided by the label-token count of the whole step across all ranks, so
    N ranks x batch b and 1 rank x batch N*b compute the same gradient.
    """
    model.train()
    scaler = ShardedGradScaler() if precision.grad_scaler else None
    max_norm = grad_norm if grad_norm > 0 else float("inf")
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(1, total_steps + 1):
        step_start = time.perf_counter()
        micro = [next(batches) for _ in range(accumulation)]
        epoch = micro[-1][0]
        counts = torch.tensor(
            [
                sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for _, b in micro),
                sum(int(b["attention_mask"].sum()) for _, b in micro),
            ],
            dtype=torch.float64,
            device=env.device,
        )
        dist.all_reduce(counts)
        label_tokens, input_tokens = counts.tolist()
        loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
        for _, batch in micro:
            part = _forward_loss_sum(model, batch, env=env, precision=precision)
            # FSDP averages gradients over ranks: scale by world size so the result is sum / global count.
            scaled = part * env.world_size / max(label_tokens, 1.0)
            (scaler.scale(scaled) if scaler else scaled).backward()
            loss_sum += part.detach().double()
        if scaler:
            scaler.unscale_(optimizer)
        norm = model.clip_grad_norm_(max_norm)
        lr = scheduler.get_last_lr()[0]
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        dist.all_reduce(loss_sum)
        loss = loss_sum.item() / max(label_tokens, 1.0)
        losses.append(loss)
        elapsed = time.perf_counter() - step_start
        logger.log(
            {
                "step": step,
                "epoch": epoch,
                "loss": loss,
                "lr": lr,
                "grad_norm": float(norm),
                "tokens": int(input_tokens),
                "tokens_per_s": input_tokens / elapsed,
                "peak_memory_bytes": peak_memory_bytes(env.device),
                "peak_memory_bytes_per_rank": _gather_ints(peak_memory_bytes(env.device), env),
                "elapsed_s": time.perf_counter() - start,
            }
        )
    return losses


def _forward_loss_sum(
    model: nn.Module, batch: dict[str, torch.Tensor], *, env: DistEnv, precision: Precision
) -> torch.Tensor:
    input_ids = batch["input_ids"].to(env.device)
    labels = batch["labels"].to(env.device)
    with _autocast(precision, env.device):
        logits = model(input_ids=input_ids, attention_mask=batch["attention_mask"].to(env.device)).logits
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def _gather_ints(value: int, env: DistEnv) -> list[int]:
    out = [torch.zeros((), dtype=torch.int64, device=env.device) for _ in range(env.world_size)]
    dist.all_gather(out, torch.tensor(value, dtype=torch.int64, device=env.device))
    return [int(t) for t in out]
