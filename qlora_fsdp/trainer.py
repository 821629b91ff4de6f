"""run(cfg): build everything in a fixed order, train, save, and always tear the process group down."""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from qlora_fsdp.checkpoint import (
    TRAINED_BLOCKS,
    TrainState,
    check_resume_compatible,
    list_checkpoints,
    load_checkpoint,
    model_identity,
    output_dir_shared,
    remove_checkpoints,
    resolve_resume,
    save_adapter,
    save_checkpoint,
    save_full_model,
    save_trained_blocks,
)
from qlora_fsdp.config import OptimConfig, OutputConfig, TrainConfig, profile_window
from qlora_fsdp.data import IGNORE_INDEX
from qlora_fsdp.data.loader import build_loaders
from qlora_fsdp.data.rows import FLASH_ATTENTION, attention_implementation, model_inputs
from qlora_fsdp.distributed import DistEnv, broadcast_object, gather_ints, init_distributed, teardown
from qlora_fsdp.errors import UserError
from qlora_fsdp.evaluate import evaluate
from qlora_fsdp.fsdp import (
    PRECISIONS,
    PackedLayout,
    Precision,
    ShardedModel,
    make_sharder,
    quant_compute_dtype,
    verify_packed,
)
from qlora_fsdp.lora import (
    adapter_keys,
    adapts_experts,
    init_adapters,
    inject_lora,
    lora_layers,
    prepare_full_finetune,
)
from qlora_fsdp.loss import CausalLMLoss, RouterLoss, router_loss
from qlora_fsdp.manifest import LayerDigests, Manifest, training_manifest
from qlora_fsdp.metrics import METRICS_FILE, MetricsLogger, peak_memory_bytes
from qlora_fsdp.model import (
    build_skeleton,
    expanded_layer_prefixes,
    load_tokenizer,
    resolve_model_path,
    stream_weights,
)
from qlora_fsdp.optim import build_optimizer, build_scheduler
from qlora_fsdp.quant import make_backend
from qlora_fsdp.quant.base import QuantizedLinear

log = logging.getLogger(__name__)
T = TypeVar("T")
FINISHED_MARKERS = ("adapter_model.safetensors", "model.safetensors", TRAINED_BLOCKS, METRICS_FILE)


class TrainingStopped(UserError):
    """Training cannot go on (a non-finite loss, say); the message names the step and what to change."""


@dataclass
class TrainResult:
    state: TrainState
    losses: list[float] = field(default_factory=list)
    preempted_checkpoint: Path | None = None


def check_output_dir(cfg: OutputConfig) -> None:
    """Refuse to mix a new run into the results of a previous one, before anything is written."""
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"--output_dir {out} is a file; choose a directory")
    resuming = cfg.resume_from and (cfg.resume_from != "auto" or list_checkpoints(out))
    if cfg.overwrite or resuming or not out.is_dir():
        return
    found = [m for m in FINISHED_MARKERS if (out / m).exists()] + [p.name for p in out.glob("model-*.safetensors")]
    found += [p.name for p in list_checkpoints(out)]
    if found:
        raise UserError(
            f"--output_dir {out} already holds a run ({found[0]}); pass --overwrite true to replace it, "
            "--resume_from auto to continue it, or choose another --output_dir"
        )


def _preflight(cfg: TrainConfig, env: DistEnv) -> None:
    """Checks that need the job's shape, made before any heavy work."""
    if cfg.dist.world_size and cfg.dist.world_size != env.world_size:
        raise UserError(
            f"--world_size {cfg.dist.world_size} but torchrun started {env.world_size} processes; "
            "make --nproc_per_node x --nnodes match or drop --world_size"
        )
    if cfg.fsdp.cpu_offload and env.device.type == "cpu":
        raise UserError("--cpu_offload moves GPU parameters to host memory; on CPU they are there already: drop it")
    group = cfg.fsdp.shard_group_size or env.local_world_size
    if cfg.fsdp.sharding_strategy.startswith("hybrid") and env.world_size % group:
        raise UserError(
            f"--sharding_strategy {cfg.fsdp.sharding_strategy}: {env.world_size} ranks do not split into shard groups "
            f"of {group}; set --shard_group_size to a divisor of the world size"
        )
    if cfg.output.log_to == "wandb":
        import wandb  # noqa: F401 - fail here, on every rank, if it is missing


def run(cfg: TrainConfig) -> TrainResult:
    """Train as configured on this process's rank of the job; returns where the outputs went."""
    check_output_dir(cfg.output)
    model_path = resolve_model_path(cfg.model.model)
    # A caller that already joined a process group (a test or benchmark running several trainings) keeps it.
    owns_group = not dist.is_initialized()
    env = init_distributed(device=cfg.dist.device, timeout_s=cfg.dist.dist_timeout_s)
    try:
        _preflight(cfg, env)
        if not cfg.model.low_memory and env.is_main:
            log.warning("--low_memory false is ignored: every rank streams each layer into its shards")
        output_dir = Path(cfg.output.output_dir)
        shared = output_dir_shared(output_dir, env)
        if not shared and (cfg.output.save_steps or cfg.output.resume_from):
            raise UserError(
                f"--output_dir {output_dir} is not the same directory on every node (rank 0 writes there and some "
                "rank cannot see it), so no checkpoint could be completed or resumed: point --output_dir at a "
                "filesystem all nodes share, or drop --save_steps/--resume_from"
            )
        settings = _settings(cfg, model_path, env)

        def choose_resume() -> tuple[Path | None, list[str]]:
            resume = resolve_resume(cfg.output.resume_from, output_dir)
            if resume is None:
                return None, []
            changed = check_resume_compatible(
                resume, settings, world_size=env.world_size, may_change=MAY_CHANGE_ON_RESUME
            )
            return resume, changed

        # Decided once, on rank 0: ranks that looked at the files themselves could disagree (a lagging shared
        # filesystem) and one refusing alone would leave the others waiting in a collective.
        resume, changed = _on_rank0(choose_resume, env)
        result = _run(cfg, env, model_path, resume, changed=changed, shared_output=shared, settings=settings)
        dist.barrier()  # every rank is done with the model before any leaves the group
        return result
    finally:
        if owns_group:
            teardown()


# A resumed run must share these with its checkpoint: they fix the data order, the base weights and the layout and
# meaning of the saved adapter and optimizer shards. Refused with the flag's name if they differ.
MUST_MATCH_ON_RESUME = (
    "dataset", "dataset_samples", "context_length", "batch_size", "gradient_accumulation_steps", "seed",
    "prompt_style", "train_on_inputs", "packing", "packing_split", "eval_split", "group_by_length",
    "dataset_streaming",
    "train_type", "quant", "bnb_quant_type", "bnb_double_quant", "hqq_bits",
    "hqq_group_size", "compute_dtype", "lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules", "precision",
    "fsdp_version", "sharding_strategy", "shard_group_size", "optimizer", "chat_template",
)  # fmt: skip
# These may change on resume (a lower learning rate, a longer run): the new values apply from the resumed step on,
# as if the schedule had always been the new one, and the log names each change.
MAY_CHANGE_ON_RESUME = (
    "lr", "wd", "lr_scheduler", "warmup_ratio", "cosine_min_lr_ratio", "max_steps", "num_epochs", "grad_norm",
)  # fmt: skip


def _settings(cfg: TrainConfig, model_path: Path, env: DistEnv) -> dict[str, object]:
    """What a checkpoint records of its run, for check_resume_compatible."""
    flags = cfg.to_dict()
    settings = {k: flags[k] for k in MUST_MATCH_ON_RESUME + MAY_CHANGE_ON_RESUME}
    settings["model"] = model_identity(model_path)
    if cfg.fsdp.sharding_strategy.startswith("hybrid"):
        # 0 means "a node": the shards' shapes follow the node size, which another job layout may change.
        settings["shard_group_size"] = cfg.fsdp.shard_group_size or env.local_world_size
    return settings


def _on_rank0(decide: Callable[[], T], env: DistEnv) -> T:
    """`decide()` run on rank 0; its result, or the UserError it raised, on every rank."""
    outcome: tuple[bool, object] = (True, None)
    if env.is_main:
        try:
            outcome = (True, decide())
        except UserError as exc:
            outcome = (False, str(exc))
    ok, value = broadcast_object(outcome, env)
    if not ok:
        raise UserError(str(value))
    return value  # type: ignore[return-value]


@dataclass
class _Built:
    """The sharded model and what saving needs to know about it."""

    model: ShardedModel
    unwrapped: nn.Module
    """The PeftModel (adapters) or HF model that was sharded: saving takes its config and names."""
    keys: dict[nn.Module, dict[str, str]]
    """Adapter leaf -> {parameter: PEFT key}; empty without adapters."""
    blocks: dict[nn.Module, str]
    """Llama-Pro block -> its name prefix; empty otherwise."""
    trainable: int
    """Parameters that train (counted before sharding, tied ones once)."""
    layout: PackedLayout | None
    """How the quantized layers store their packed bytes (None: nothing is quantized)."""
    manifest: Manifest | None = None
    """What rank 0 writes beside each adapter it saves; None elsewhere and without adapters."""
    router: RouterLoss | None = None
    """A mixture-of-experts model's load-balancing loss, when it has one."""


def _run(
    cfg: TrainConfig,
    env: DistEnv,
    model_path: Path,
    resume: Path | None,
    *,
    changed: list[str],
    shared_output: bool,
    settings: dict[str, object],
) -> TrainResult:
    precision = PRECISIONS[cfg.fsdp.precision]
    torch.manual_seed(cfg.optim.seed)
    tokenizer = load_tokenizer(model_path)
    loader, eval_loader = build_loaders(
        cfg.data, cfg.eval, tokenizer, env, seed=cfg.optim.seed, fixed_shapes=cfg.fsdp.compile
    )
    total_steps = cfg.optim.max_steps or _epoch_steps(cfg.optim, len(loader))  # a stream has no length
    attention = attention_implementation(packing=cfg.data.packing, device=env.device, dtype=precision.compute_dtype)
    varlen = attention == FLASH_ATTENTION
    built = _build_model(cfg, env, model_path, precision, attention=attention)
    adapters = bool(built.keys)

    optimizer = build_optimizer(built.model.module.parameters(), cfg.optim)
    scaler = ShardedGradScaler(device=env.device.type) if precision.grad_scaler else None
    output_dir = Path(cfg.output.output_dir)
    state = TrainState(world_size=env.world_size, seed=cfg.optim.seed, settings=settings)
    if resume is not None:
        state = load_checkpoint(resume, model=built.model, keys=built.keys, optimizer=optimizer, scaler=scaler, env=env)
        state.settings = settings
    # The schedule is a function of the flags and the step: rebuilt, not restored, so changed flags take effect.
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps, start_step=state.step)
    if env.is_main:
        if resume is None and cfg.output.overwrite:
            remove_checkpoints(output_dir)  # or pruning and --resume_from auto would mix in the old run's
        output_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    logger = MetricsLogger(
        cfg.output,
        output_dir=output_dir,
        is_main=env.is_main,
        total_steps=total_steps,
        run_config=cfg.to_dict(),
        resume_step=state.step if resume is not None else None,
    )
    profiler = _profiler(cfg.output, output_dir, env) if cfg.output.profile else None
    if resume is not None:
        logger.message(f"resumed from {resume} at step {state.step}")
        for change in changed:
            logger.message(f"resumed with {change}: applied from step {state.step + 1} on")
    logger.message(f"trainable parameters: {built.trainable:,}")
    if built.layout is not None:
        logger.message(built.layout.describe())
    param_bytes = gather_ints(built.model.local_parameter_bytes(), env)
    logger.message(f"resident parameter bytes per rank after sharding: {param_bytes}")

    def checkpoint(at: TrainState) -> Path:
        if not adapters or not shared_output:
            why = "this --train_type keeps no resumable checkpoints" if not adapters else (
                f"--output_dir {output_dir} is not shared by every node, so no checkpoint could be completed"
            )  # fmt: skip
            raise TrainingStopped(f"stopped by a signal after step {at.step}; {why}")
        return save_checkpoint(
            model=built.model,
            peft_model=built.unwrapped,
            keys=built.keys,
            optimizer=optimizer,
            scaler=scaler,
            state=at,
            output_dir=output_dir,
            total_limit=cfg.output.save_total_limit,
            env=env,
            manifest=built.manifest,
        )

    def run_eval(step: int) -> None:
        started = time.perf_counter()
        result = evaluate(
            built.model.module,
            eval_loader,
            loss_sum=lambda batch: _forward_loss_sum(
                built.model.module, batch, env=env, precision=precision, varlen=varlen
            ),
            device=env.device,
        )
        logger.log_eval(
            {"step": step, "eval_loss": result.loss, "eval_ppl": result.perplexity, "eval_tokens": result.tokens,
             "eval_s": time.perf_counter() - started}
        )  # fmt: skip

    try:
        with _preemption_flag() as preempted:
            result = train_loop(
                built.model,
                loader,
                optimizer,
                scheduler,
                scaler=scaler,
                state=state,
                env=env,
                precision=precision,
                optim=cfg.optim,
                total_steps=total_steps,
                logger=logger,
                save_steps=cfg.output.save_steps,
                checkpoint=checkpoint,
                preempted=preempted,
                activation_offload=cfg.fsdp.activation_offload,
                profiler=profiler,
                static_fields={"param_bytes_per_rank": param_bytes, "trainable_parameters": built.trainable},
                varlen=varlen,
                run_eval=run_eval if eval_loader is not None else None,
                eval_steps=cfg.eval.eval_steps,
                router=built.router,
            )
        # --eval_steps 0, or a last step off its grid: evaluate the final weights.
        off_grid = not cfg.eval.eval_steps or result.state.step % cfg.eval.eval_steps
        if result.preempted_checkpoint is None and eval_loader is not None and off_grid:
            run_eval(result.state.step)
        if result.preempted_checkpoint is not None:
            logger.message(
                f"preempted: saved checkpoint {result.preempted_checkpoint.resolve()} at step {result.state.step}; "
                "rerun with --resume_from auto to continue"
            )
        elif cfg.output.save_model:
            logger.message(_save_final(built, output_dir, env=env))
    finally:
        if profiler is not None:
            profiler.close()
        logger.close()
    return result


def _build_model(cfg: TrainConfig, env: DistEnv, model_path: Path, precision: Precision, *, attention: str) -> _Built:
    """Skeleton on meta, adapters, then stream the checkpoint in, sharding each decoder layer as it completes."""
    compute_dtype = quant_compute_dtype(precision, cfg.quant.compute_dtype)
    adapters = cfg.lora.train_type in ("lora", "dora")
    # FSDP1 only: DoRA's forward dequantizes the base layer from its LoRA layer, so the base layer must share its
    # decoder layer's unit instead of a (mixed-precision-ignored) unit of its own.
    ignore_quantized = cfg.quant.quant != "none" and cfg.lora.train_type != "dora"
    sharder = make_sharder(
        cfg.fsdp,
        env=env,
        precision=precision,
        ignore=(QuantizedLinear,) if ignore_quantized else (),
        adapters_own_units=adapters,
    )
    backend, layout = None, None
    if cfg.quant.quant != "none":  # only quantized layers have a packed layout to decide
        layout = sharder.layout
        backend = make_backend(
            cfg.quant, storage_dtype=layout.storage_dtype, compute_dtype=compute_dtype, shard_state=layout.state_sharded
        )
    new_blocks = expanded_layer_prefixes(model_path) if cfg.lora.train_type == "llama_pro" else ()
    skeleton = build_skeleton(
        cfg.model,
        backend=backend,
        param_dtype=precision.param_dtype,
        path=model_path,
        full_precision_prefixes=new_blocks,
        attention=attention,
        adapt_experts=adapters and adapts_experts(cfg.lora.lora_target_modules),
    )
    # Rank 0 digests each quantized layer while it is still whole, under its base-model name (before adapters).
    digests = LayerDigests(skeleton.model, skeleton.quantized) if adapters and env.is_main else None
    keys: dict[nn.Module, dict[str, str]] = {}
    if adapters:
        unwrapped = inject_lora(skeleton.model, cfg.lora, dtype=precision.param_dtype)
        keys = adapter_keys(unwrapped)
        if any("" in names.values() for names in keys.values()):
            raise RuntimeError("an adapter parameter has no PEFT key: PEFT's state dict and the model disagree")
    else:
        unwrapped = prepare_full_finetune(skeleton.model, only_prefixes=new_blocks)
    blocks = {m: f"{n}." for n, m in skeleton.model.named_modules() if new_blocks and f"{n}." in new_blocks}
    if cfg.fsdp.gradient_checkpointing and cfg.fsdp.reentrant_checkpointing:
        # Reentrant checkpoints only backpropagate into a segment whose inputs require grad.
        unwrapped.enable_input_require_grads()
    in_layers = {id(m) for layer in skeleton.units.values() for m in lora_layers(layer)}
    trainable = sum(p.numel() for p in unwrapped.parameters() if p.requires_grad)

    def shard_layer(name: str, layer: nn.Module) -> None:
        init_adapters(lora_layers(layer), seed=cfg.optim.seed, name=name)
        if digests is not None:
            digests.add(layer)
        sharder.shard_unit(name, layer, root=skeleton.model)

    router = router_loss(unwrapped, cfg.model.router_aux_loss_coef)
    if router is not None and cfg.fsdp.gradient_checkpointing and cfg.fsdp.reentrant_checkpointing:
        raise UserError(
            "--reentrant_checkpointing true: the router's load-balancing loss would get no gradient through "
            "reentrant checkpoints; use --reentrant_checkpointing false or --router_aux_loss_coef 0"
        )
    stream_weights(skeleton, backend=backend, device=env.device, on_unit_ready=shard_layer, env=env)
    manifest = None
    if digests is not None:
        digests.add(skeleton.model)  # quantized layers outside the decoder layers, if any
        manifest = training_manifest(cfg, model_path=model_path, device=env.device, backend=backend, digests=digests)
    outside = [m for m in lora_layers(unwrapped) if id(m) not in in_layers]
    init_adapters(outside, seed=cfg.optim.seed, name="")
    sharded = sharder.finish(CausalLMLoss(unwrapped, chunk_tokens=cfg.fsdp.loss_chunk_tokens, router=router))
    verify_packed(sharded.module, sharder.reference)
    return _Built(
        model=sharded,
        unwrapped=unwrapped,
        keys=keys,
        blocks=blocks,
        trainable=trainable,
        layout=layout,
        manifest=manifest,
        router=router,
    )


def _save_final(built: _Built, output_dir: Path, *, env: DistEnv) -> str:
    """Write what was trained; returns the line telling the user where it went."""
    if built.keys:
        save_adapter(built.model, built.unwrapped, built.keys, output_dir, env=env, manifest=built.manifest)
        return f"adapter saved to {output_dir.resolve()}"
    if built.blocks:
        path = save_trained_blocks(built.model, built.blocks, output_dir, env=env)
        return f"trained blocks saved to {path.resolve()}"
    save_full_model(built.model, built.unwrapped, output_dir, env=env)
    return f"model saved to {output_dir.resolve()}"


def _epoch_steps(cfg: OptimConfig, micro_batches_per_epoch: int) -> int:
    steps = cfg.num_epochs * (micro_batches_per_epoch // cfg.gradient_accumulation_steps)
    if steps < 1:
        raise UserError(
            f"--gradient_accumulation_steps {cfg.gradient_accumulation_steps} needs more batches per epoch than the "
            f"dataset gives ({micro_batches_per_epoch}); lower it or use a larger dataset"
        )
    return steps


def _micro_batches(
    loader: torch.utils.data.DataLoader, *, epoch: int, skip: int
) -> Iterator[tuple[int, int, dict[str, torch.Tensor]]]:
    """(epoch, index in epoch, batch) forever from a data position; each epoch reshuffles via the sampler (a stream,
    which has none, is one endless epoch)."""
    while True:
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        for index, batch in enumerate(loader):
            if index >= skip:
                yield epoch, index, batch
        epoch, skip = epoch + 1, 0


class _Flag:
    """Set by a signal handler, read at step boundaries."""

    def __init__(self) -> None:
        self.raised = False


@contextlib.contextmanager
def _preemption_flag() -> Iterator[_Flag]:
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


def _autocast(precision: Precision, device: torch.device) -> contextlib.AbstractContextManager:
    if precision.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=precision.autocast_dtype)


def train_loop(
    model: ShardedModel,
    loader: torch.utils.data.DataLoader,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    scaler: ShardedGradScaler | None,
    state: TrainState,
    env: DistEnv,
    precision: Precision,
    optim: OptimConfig,
    total_steps: int,
    logger: MetricsLogger,
    checkpoint: Callable[[TrainState], Path],
    save_steps: int = 0,
    preempted: _Flag | None = None,
    activation_offload: bool = False,
    profiler: _StepProfiler | None = None,
    static_fields: dict[str, object] | None = None,
    varlen: bool = False,
    run_eval: Callable[[int], None] | None = None,
    eval_steps: int = 0,
    router: RouterLoss | None = None,
) -> TrainResult:
    """Optimizer steps of `gradient_accumulation_steps` micro-batches each, from `state` to `total_steps`.

    The loss is a sum over label tokens divided by the label-token count of the whole step across all ranks, so
    N ranks x batch b and 1 rank x batch N*b compute the same gradient. `run_eval(step)` runs after every
    `eval_steps`-th step (the caller evaluates at the end).
    """
    model.module.train()
    max_norm = optim.grad_norm if optim.grad_norm > 0 else float("inf")
    batches = _micro_batches(loader, epoch=state.epoch, skip=state.batch_in_epoch)
    result = TrainResult(state=state)
    start = time.perf_counter()
    while state.step < total_steps:
        step_start = time.perf_counter()
        micro = [next(batches) for _ in range(optim.gradient_accumulation_steps)]
        counts = torch.tensor(
            [
                sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for _, _, b in micro),
                sum(int(b["attention_mask"].sum()) for _, _, b in micro),
                sum(b["input_ids"].numel() for _, _, b in micro),  # each rank pads its batches to their own width
            ],
            dtype=torch.float64,
            device=env.device,
        )
        dist.all_reduce(counts)
        label_tokens, input_tokens, row_tokens = counts.tolist()
        loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
        if profiler is not None:
            profiler.before_step(state.step + 1)
        for i, (_, _, batch) in enumerate(micro):
            # Accumulate locally and reduce gradients once per optimizer step, not once per micro-batch.
            last = i == len(micro) - 1
            with contextlib.nullcontext() if last else model.no_sync():
                with _activation_offload(activation_offload, env.device):
                    part = _forward_loss_sum(model.module, batch, env=env, precision=precision, varlen=varlen)
                # FSDP averages gradients over ranks: scale by world size so the result is sum / global count.
                scaled = part * env.world_size / max(label_tokens, 1.0)
                (scaler.scale(scaled) if scaler else scaled).backward()
            loss_sum += part.detach().double()
        if scaler:
            scaler.unscale_(optimizer)
        norm = model.clip_grad_norm(max_norm)
        # One collective gives every rank the same loss and the same preemption decision.
        stop_requested = float(preempted.raised) if preempted is not None else 0.0
        totals = torch.stack([loss_sum, torch.tensor(stop_requested, dtype=torch.float64, device=env.device)])
        dist.all_reduce(totals)
        loss = totals[0].item() / max(label_tokens, 1.0)
        moe = _router_fields(router, label_tokens, env) if router is not None else {}
        # fp16's scaler skips overflowing steps itself; a non-finite norm is then routine, not an error.
        bad = not math.isfinite(loss) or (scaler is None and not math.isfinite(norm))
        lr = scheduler.get_last_lr()[0]
        skipped = bad and _handle_non_finite(optim.nan_policy, state.step + 1, loss, norm, is_main=env.is_main)
        if skipped:
            if scaler:
                scaler.update()  # closes the unscale_ of this step; the next step may unscale again
        elif scaler:
            scale = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            # The scaler skips a step whose gradients overflowed, and says so only by lowering its scale.
            skipped = scaler.get_scale() < scale
        else:
            optimizer.step()
        # The learning rate is a function of the step count, skipped steps included, so a resume can rebuild it.
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        last_epoch, last_index, _ = micro[-1]
        state.step += 1
        state.epoch, state.batch_in_epoch = last_epoch, last_index + 1
        result.losses.append(loss)
        elapsed = time.perf_counter() - step_start
        peak = peak_memory_bytes(env.device)
        logger.log(
            {
                "step": state.step,
                "epoch": last_epoch,
                "loss": loss,
                "lr": lr,
                "grad_norm": norm,
                "tokens": int(input_tokens),
                "label_tokens": int(label_tokens),
                "tokens_per_s": input_tokens / elapsed,
                "packing_efficiency": input_tokens / row_tokens,
                "peak_memory_bytes": peak,
                "peak_memory_bytes_per_rank": gather_ints(peak, env),
                "elapsed_s": time.perf_counter() - start,
                "skipped": skipped,
                **moe,
                **(static_fields or {}),
            }
        )
        if profiler is not None:
            profiler.after_step(state.step)
        model.compile_units()  # --compile: from the second step on
        if totals[1].item() > 0:
            result.preempted_checkpoint = checkpoint(state)  # or TrainingStopped where no checkpoint can be made
            break
        if run_eval is not None and eval_steps and state.step % eval_steps == 0:
            run_eval(state.step)
        if save_steps and state.step % save_steps == 0:
            started = time.perf_counter()
            path = checkpoint(state)
            logger.message(f"checkpoint saved to {path} in {time.perf_counter() - started:.2f}s")
    result.state = state
    return result


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
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._prof = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
        self._prof.__enter__()

    def after_step(self, step: int) -> None:
        if self._prof is None or step != self.last:
            return
        self._prof.__exit__(None, None, None)
        self.out.mkdir(parents=True, exist_ok=True)
        self._prof.export_chrome_trace(str(self.out / f"trace-rank{self.rank}.json"))
        if self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(self.out / f"memory-rank{self.rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        self._prof = None

    def close(self) -> None:
        """Stop a window the run did not reach the end of (preemption, an error, too few steps)."""
        if self._prof is not None:
            self.after_step(self.last)


def _profiler(cfg: OutputConfig, output_dir: Path, env: DistEnv) -> _StepProfiler:
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


def _forward_loss_sum(
    model: nn.Module, batch: dict[str, torch.Tensor], *, env: DistEnv, precision: Precision, varlen: bool = False
) -> torch.Tensor:
    """The batch's summed loss over its label tokens, from the root (CausalLMLoss) that FSDP wraps; a packed batch
    goes with position_ids and no attention mask (see qlora_fsdp/data/rows.py)."""
    inputs = model_inputs(batch, env.device, varlen=varlen)
    if inputs["attention_mask"] is None:  # packed: which positions are padding, for the router's loss alone
        inputs["token_mask"] = batch["attention_mask"].to(env.device).reshape(inputs["input_ids"].shape)
    with _autocast(precision, env.device):
        return model(**inputs)
