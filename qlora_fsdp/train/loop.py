"""The training loop: optimizer steps of micro-batches, each step's record, evaluation and checkpoints on their
steps, preemption at a step boundary. What a step's loss is belongs to the objective (qlora_fsdp/objectives)."""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from qlora_fsdp.checkpoint.dcp import TrainState
from qlora_fsdp.compat import dump_cuda_memory_snapshot, start_cuda_memory_history
from qlora_fsdp.config.options import OptimConfig, OutputConfig, profile_window
from qlora_fsdp.data import target_mask
from qlora_fsdp.errors import TrainingStopped
from qlora_fsdp.objectives.base import Objective, combined_loss
from qlora_fsdp.objectives.loss import RouterLoss
from qlora_fsdp.parallel.distributed import DistEnv, gather_ints
from qlora_fsdp.parallel.sharding import ShardedModel
from qlora_fsdp.train.metrics import MetricsLogger, peak_memory_bytes

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    state: TrainState
    losses: list[float] = field(default_factory=list)
    preempted_checkpoint: Path | None = None


@dataclass
class Step:
    """What one optimizer step is made of: the sharded model, the objective its loss comes from, the optimizer
    with its schedule and (fp16) scaler, and the step's settings."""

    model: ShardedModel
    objective: Objective
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: ShardedGradScaler | None
    optim: OptimConfig
    env: DistEnv
    activation_offload: bool = False
    router: RouterLoss | None = None
    """A mixture-of-experts model's load-balancing loss, whose per-step figures the record adds."""


@dataclass
class Events:
    """What happens between steps, and when: evaluation, checkpoints, the end, a preemption, the profiler."""

    total_steps: int
    checkpoint: Callable[[TrainState, bool], Path]
    """Save a checkpoint of this state; True: whole before it returns (a preemption), else maybe in the background."""
    save_steps: int = 0
    run_eval: Callable[[int], None] | None = None
    eval_steps: int = 0
    preempted: _Flag | None = None
    profiler: _StepProfiler | None = None
    between_steps: Callable[[], None] | None = None
    """Called after every step (completes background checkpoints that have finished writing)."""


def train_loop(
    step: Step,
    loader: torch.utils.data.DataLoader,
    *,
    state: TrainState,
    events: Events,
    logger: MetricsLogger,
    static_fields: dict[str, object] | None = None,
) -> TrainResult:
    """Optimizer steps of `gradient_accumulation_steps` micro-batches each, from `state` to `events.total_steps`.

    The loss is the objective's sum over the step's micro-batches on every rank divided by their summed weight
    (label tokens for SFT, pairs for DPO; see Objective), so N ranks x batch b and 1 rank x batch N*b compute the
    same gradient.
    `events.run_eval(step)` runs after every `eval_steps`-th step (the caller evaluates at the end).
    """
    step.model.module.train()
    batches = _micro_batches(
        loader, epoch=state.epoch, start=state.samples_in_epoch, world_size=step.env.data_world_size
    )
    result = TrainResult(state=state)
    start = time.perf_counter()
    while state.step < events.total_steps:
        step_start = time.perf_counter()
        micro = [next(batches) for _ in range(step.optim.gradient_accumulation_steps)]
        if events.profiler is not None:
            events.profiler.before_step(state.step + 1)
        record, stop = _optimizer_step(
            step, [b for _, _, b in micro], number=state.step + 1, preempted=events.preempted
        )
        last_epoch, consumed, _ = micro[-1]
        state.step += 1
        state.epoch, state.samples_in_epoch = last_epoch, consumed
        result.losses.append(record["loss"])
        peak = peak_memory_bytes(step.env.device)
        elapsed = time.perf_counter() - step_start
        logger.log(
            {
                "step": state.step,
                "epoch": last_epoch,
                **record,
                "tokens_per_s": record["tokens"] / elapsed,
                "peak_memory_bytes": peak,
                "peak_memory_bytes_per_rank": gather_ints(peak, step.env),
                "elapsed_s": time.perf_counter() - start,
                **(static_fields or {}),
            }
        )
        if events.profiler is not None:
            events.profiler.after_step(state.step)
        step.model.compile_units()  # --compile: from the second step on
        if stop:
            result.preempted_checkpoint = events.checkpoint(state, True)  # or TrainingStopped where none can be made
            break
        if events.between_steps is not None:
            events.between_steps()
        if events.run_eval is not None and events.eval_steps and state.step % events.eval_steps == 0:
            events.run_eval(state.step)
        if events.save_steps and state.step % events.save_steps == 0:
            events.checkpoint(state, False)
    result.state = state
    return result


def _optimizer_step(
    step: Step, micro: list[dict[str, torch.Tensor]], *, number: int, preempted: _Flag | None
) -> tuple[dict[str, object], bool]:
    """Forward and backward over the micro-batches, then one optimizer step (or a skipped one); returns the step's
    record (loss, lr, grad_norm, tokens, the objective's and the router's figures) and whether to stop."""
    env, objective, scaler = step.env, step.objective, step.scaler
    micro = [objective.prepare(step.model.module, batch, step=number, index=i) for i, batch in enumerate(micro)]
    weights = [sum(parts) for parts in zip(*(objective.weights(b) for b in micro), strict=True)]
    counts = torch.tensor(
        [
            *weights,
            sum(int(target_mask(b["labels"]).sum()) for b in micro),
            sum(int(b["attention_mask"].sum()) for b in micro),
            sum(b["input_ids"].numel() for b in micro),  # each rank pads its batches to their own width
        ],
        dtype=torch.float64,
        device=env.device,
    )
    dist.all_reduce(counts)
    weight = counts[: len(weights)]
    label_tokens, input_tokens, row_tokens = counts[len(weights) :].tolist()
    loss_sum = torch.zeros(len(weights), dtype=torch.float64, device=env.device)
    metric_sums = torch.zeros(len(objective.metric_names), dtype=torch.float64, device=env.device)
    for i, batch in enumerate(micro):
        # Accumulate locally and reduce gradients once per optimizer step, not once per micro-batch.
        last = i == len(micro) - 1
        with contextlib.nullcontext() if last else step.model.no_sync():
            with _activation_offload(step.activation_offload, env.device):
                part, metrics = objective.loss_sum(step.model.module, batch)
            # FSDP averages gradients over ranks: scale by world size so the result is sum / global weight.
            scaled = (part * env.world_size / weight.to(part.dtype).clamp(min=1.0)).sum()
            (scaler.scale(scaled) if scaler else scaled).backward()
        loss_sum += part.detach().double()
        metric_sums += metrics
    if scaler:
        scaler.unscale_(step.optimizer)
    norm = step.model.clip_grad_norm(step.optim.grad_norm if step.optim.grad_norm > 0 else float("inf"))
    # One collective gives every rank the same loss, metrics and preemption decision.
    stop_requested = float(preempted.raised) if preempted is not None else 0.0
    flag = torch.tensor([stop_requested], dtype=torch.float64, device=env.device)
    totals = torch.cat([flag, loss_sum, metric_sums])
    dist.all_reduce(totals)
    loss = combined_loss(totals[1 : 1 + len(weights)], weight).item()
    extra = objective.logged(totals[1 + len(weights) :].tolist(), weight.tolist())
    if step.router is not None:
        extra |= _router_fields(step.router, label_tokens, env)
    # fp16's scaler skips overflowing steps itself; a non-finite norm is then routine, not an error.
    bad = not math.isfinite(loss) or (scaler is None and not math.isfinite(norm))
    lr = step.scheduler.get_last_lr()[0]
    skipped = bad and _handle_non_finite(step.optim.nan_policy, number, loss, norm, is_main=env.is_main)
    if skipped:
        if scaler:
            scaler.update()  # closes the unscale_ of this step; the next step may unscale again
    elif scaler:
        scale = scaler.get_scale()
        scaler.step(step.optimizer)
        scaler.update()
        # The scaler skips a step whose gradients overflowed, and says so only by lowering its scale.
        skipped = scaler.get_scale() < scale
    else:
        step.optimizer.step()
    # The learning rate is a function of the step count, skipped steps included, so a resume can rebuild it.
    step.scheduler.step()
    step.optimizer.zero_grad(set_to_none=True)
    record = {
        "loss": loss,
        "lr": lr,
        "grad_norm": norm,
        "tokens": int(input_tokens),
        "label_tokens": int(label_tokens),
        "packing_efficiency": input_tokens / row_tokens,
        "skipped": skipped,
        **extra,
    }
    return record, totals[0].item() > 0


def _micro_batches(
    loader: torch.utils.data.DataLoader, *, epoch: int, start: int, world_size: int
) -> Iterator[tuple[int, int, dict[str, torch.Tensor]]]:
    """(epoch, global samples of that epoch consumed with this batch, batch) forever from a data position;
    `world_size` is the number of ranks the data is dealt to (groups, with sequence parallelism).

    The sampler starts each epoch's shuffle at the position itself, so a resume reads nothing twice. A stream has
    no sampler: it is one endless epoch whose first `start` samples are re-read and skipped.
    """
    per_batch = world_size * loader.batch_size
    while True:
        sampler = loader.sampler
        skip = 0
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch, start)
        else:
            skip = start // per_batch
        for index, batch in enumerate(loader):
            if index >= skip:
                start += per_batch
                yield epoch, start, batch
        epoch, start = epoch + 1, 0


class _Flag:
    """Set by a signal handler, read at step boundaries."""

    def __init__(self) -> None:
        self.raised = False


@contextlib.contextmanager
def preemption_flag() -> Iterator[_Flag]:
    """SIGTERM/SIGINT (what SLURM and Ctrl-C send) ask for a checkpoint at the next step boundary."""
    flag = _Flag()

    def handler(signum: int, frame: object) -> None:
        flag.raised = True

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield flag
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _router_fields(router: RouterLoss, label_tokens: float, env: DistEnv) -> dict[str, float]:
    """The step's load-balancing loss (label-token weighted, as the loss) and the tokens each expert received
    per layer (max and mean over layers and experts), over every rank."""
    stats = router.take(env.device)
    dist.all_reduce(stats)
    load = stats[1:]
    return {
        "aux_loss": stats[0].item() / max(label_tokens, 1.0),
        "expert_load_max": load.max().item(),
        "expert_load_mean": load.mean().item(),
    }


def _activation_offload(enabled: bool, device: torch.device) -> contextlib.AbstractContextManager:
    """Tensors saved for backward go to (pinned) host memory and come back for the backward pass."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")


class _StepProfiler:
    """torch.profiler over a window of optimizer steps; a Chrome trace (and a CUDA memory snapshot) at its end."""

    def __init__(self, first: int, last: int, out: Path, device: torch.device, rank: int) -> None:
        self.first, self.last, self.out, self.device, self.rank = first, last, out, device, rank
        self._prof: torch.profiler.profile | None = None

    def before_step(self, step: int) -> None:
        if step != self.first:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            start_cuda_memory_history(max_entries=100_000)
        self._prof = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
        self._prof.__enter__()

    def after_step(self, step: int) -> None:
        if self._prof is None or step != self.last:
            return
        self._prof.__exit__(None, None, None)
        self.out.mkdir(parents=True, exist_ok=True)
        self._prof.export_chrome_trace(str(self.out / f"trace-rank{self.rank}.json"))
        if self.device.type == "cuda":
            dump_cuda_memory_snapshot(self.out / f"memory-rank{self.rank}.pickle")
        self._prof = None

    def close(self) -> None:
        """Stop a window the run did not reach the end of (preemption, an error, too few steps)."""
        if self._prof is not None:
            self.after_step(self.last)


def make_profiler(cfg: OutputConfig, output_dir: Path, env: DistEnv) -> _StepProfiler:
    first, last = profile_window(cfg.profile_steps)
    return _StepProfiler(first, last, output_dir / "profile", env.device, env.rank)


def _handle_non_finite(policy: str, step: int, loss: float, norm: float, *, is_main: bool) -> bool:
    """True to skip the step (weights untouched); raises for --nan_policy stop."""
    if policy == "skip":
        if is_main:
            log.warning(
                "step %d: non-finite loss %s or gradient norm %s; step skipped, weights untouched", step, loss, norm
            )
        return True
    raise TrainingStopped(
        f"step {step}: non-finite loss ({loss}) or gradient norm ({norm}); lower --lr, check the data, "
        "use --precision bf16/fp32, or pass --nan_policy skip to skip such steps"
    )
