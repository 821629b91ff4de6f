"""run(cfg): build everything in a fixed order, train, save, and always tear the process group down."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.utils.data import DataLoader

from qlora_fsdp.checkpoint.artifacts import TRAINED_BLOCKS, save_adapter, save_full_model, save_trained_blocks
from qlora_fsdp.checkpoint.dcp import (
    AdapterExport,
    CheckpointContents,
    Checkpointer,
    SaveOptions,
    TrainState,
    list_checkpoints,
    load_checkpoint,
    read_objective_state,
    read_train_state,
)
from qlora_fsdp.checkpoint.manifest import LayerDigests, Manifest, training_manifest
from qlora_fsdp.checkpoint.resume import check_resume_compatible, output_dir_shared, remove_checkpoints, resolve_resume
from qlora_fsdp.checkpoint.resume_rules import (
    MAY_CHANGE,
    RESHARDED,
    recorded_settings,
    resumed_message,
    unrecorded,
    unrecorded_message,
)
from qlora_fsdp.config.options import OptimConfig, OutputConfig, TrainConfig
from qlora_fsdp.data.images import load_image_inputs
from qlora_fsdp.data.loader import Batching
from qlora_fsdp.errors import TrainingStopped, UserError
from qlora_fsdp.model.attention import FLASH_ATTENTION, attention_implementation
from qlora_fsdp.model.formats import checkpoint_format
from qlora_fsdp.model.hub import load_tokenizer, model_identity, resolve_model_path
from qlora_fsdp.model.lora import (
    adapter_keys,
    adapts_experts,
    init_adapters,
    inject_lora,
    lora_layers,
    prepare_full_finetune,
)
from qlora_fsdp.model.skeleton import Skeleton, build_skeleton, expanded_layer_prefixes
from qlora_fsdp.model.streaming import stream_weights
from qlora_fsdp.objectives.base import Forward
from qlora_fsdp.objectives.loss import CausalLMLoss, RouterLoss, router_loss
from qlora_fsdp.objectives.setup import Setup, Trainee, start
from qlora_fsdp.parallel.distributed import DistEnv, broadcast_object, gather_ints, init_distributed, teardown
from qlora_fsdp.parallel.precision import PRECISIONS, Precision, quant_compute_dtype
from qlora_fsdp.parallel.sequence_parallel import check_heads, enable, sequence_groups, split_rows
from qlora_fsdp.parallel.sharding import PackedLayout, ShardedModel, make_sharder, verify_packed
from qlora_fsdp.parallel.tiled_mlp import tile_mlps
from qlora_fsdp.quant import QuantBackend, make_backend
from qlora_fsdp.quant.base import QuantizedLinear
from qlora_fsdp.train.evaluate import evaluate
from qlora_fsdp.train.loop import Events, Step, TrainResult, make_profiler, preemption_flag, train_loop
from qlora_fsdp.train.metrics import METRICS_FILE, MetricsLogger
from qlora_fsdp.train.optim import build_optimizer, build_scheduler

log = logging.getLogger(__name__)
T = TypeVar("T")
FINISHED_MARKERS = ("adapter_model.safetensors", "model.safetensors", TRAINED_BLOCKS, METRICS_FILE)


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
    if cfg.output.log_to == "wandb":
        import wandb  # noqa: F401 - fail here, on every rank, if it is missing


def run(cfg: TrainConfig) -> TrainResult:
    """Train as configured on this process's rank of the job; returns where the outputs went."""
    check_output_dir(cfg.output)
    model_path = resolve_model_path(cfg.model.model)
    # A pre-quantized checkpoint's own settings are the run's (recorded, resumed and exported as such).
    cfg = dataclasses.replace(cfg, quant=checkpoint_format(model_path).quant_settings(cfg.quant, cfg.given))
    if cfg.dist.sequence_parallel_size > 1:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
        check_heads(config, cfg.dist.sequence_parallel_size)
    # A caller that already joined a process group (a test or benchmark running several trainings) keeps it.
    owns_group = not dist.is_initialized()
    env = init_distributed(device=cfg.dist.device, timeout_s=cfg.dist.dist_timeout_s, fsdp=cfg.fsdp,
                           sequence_parallel=cfg.dist.sequence_parallel_size)
    try:
        _preflight(cfg, env)
        if env.is_main:
            for notice in cfg.notices:
                log.warning(notice)
        output_dir = Path(cfg.output.output_dir)
        shared = output_dir_shared(output_dir, env)
        if not shared and (cfg.output.save_steps or cfg.output.resume_from):
            raise UserError(
                f"--output_dir {output_dir} is not the same directory on every node (rank 0 writes there and some "
                "rank cannot see it), so no checkpoint could be completed or resumed: point --output_dir at a "
                "filesystem all nodes share, or drop --save_steps/--resume_from"
            )
        settings = run_settings(cfg, model_path, env)

        def choose_resume() -> tuple[Path | None, list[str]]:
            """The checkpoint to resume from and the lines the log owes the user about it."""
            resume = resolve_resume(cfg.output.resume_from, output_dir)
            if resume is None:
                return None, []
            changed = check_resume_compatible(
                resume, settings, world_size=env.world_size, may_change=MAY_CHANGE, resharded=RESHARDED
            )
            state = read_train_state(resume)
            lines = [f"resumed from {resume} at step {state.step}"]
            lines += [resumed_message(change, state.step) for change in changed]
            unchecked = unrecorded(state.settings, settings)
            return resume, lines + ([unrecorded_message(resume, unchecked)] if unchecked else [])

        # Decided once, on rank 0: ranks that looked at the files themselves could disagree (a lagging shared
        # filesystem) and one refusing alone would leave the others waiting in a collective.
        resume, resumed = _on_rank0(choose_resume, env)
        result = _run(cfg, env, model_path, resume, resumed=resumed, shared_output=shared, settings=settings)
        dist.barrier()  # every rank is done with the model before any leaves the group
        return result
    finally:
        if owns_group:
            teardown()


def run_settings(cfg: TrainConfig, model_path: Path, env: DistEnv) -> dict[str, object]:
    """What a checkpoint records of its run, for check_resume_compatible."""
    settings = recorded_settings(cfg)
    settings["model"] = model_identity(model_path)  # the base itself, whatever its directory is called now
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
    resumed: list[str],
    shared_output: bool,
    settings: dict[str, object],
) -> TrainResult:
    precision = PRECISIONS[cfg.fsdp.precision]
    torch.manual_seed(cfg.run.seed)
    tokenizer = load_tokenizer(model_path)
    images = load_image_inputs(model_path, trust_remote_code=cfg.model.trust_remote_code)
    sequence = sequence_groups(env)
    batching = Batching(
        seed=cfg.run.seed, accumulation=cfg.optim.gradient_accumulation_steps, fixed_shapes=cfg.compute.compile,
        split=None if sequence is None else functools.partial(split_rows, size=sequence.size, index=sequence.index),
        images=images,
    )  # fmt: skip
    run_objective = start(Setup(objective=cfg.objective, data=cfg.data, eval=cfg.eval, tokenizer=tokenizer, env=env,
                                batching=batching, model_path=model_path, output_dir=Path(cfg.output.output_dir)))
    loader, eval_loader = run_objective.loaders()
    attention = attention_implementation(packing=cfg.data.packing, device=env.device, dtype=precision.compute_dtype)
    varlen = attention == FLASH_ATTENTION and sequence is None
    built = _build_model(cfg, env, model_path, precision, attention=attention)
    if sequence is not None:
        enable(built.unwrapped, sequence)
        if built.router is not None:
            built.router.gather = sequence.gather_tokens
        if env.is_main and cfg.data.context_length % sequence.size:
            log.info(
                "--context_length %d is not a multiple of --sequence_parallel_size %d: rows are padded to one",
                cfg.data.context_length, sequence.size,
            )  # fmt: skip
    adapters = bool(built.keys)

    optimizer = build_optimizer(built.model.module.parameters(), cfg.optim)
    scaler = ShardedGradScaler(device=env.device.type) if precision.grad_scaler else None
    output_dir = Path(cfg.output.output_dir)
    state = TrainState(world_size=env.world_size, seed=cfg.run.seed, settings=settings)
    if resume is not None:
        state = load_checkpoint(resume, model=built.model, keys=built.keys, optimizer=optimizer, scaler=scaler, env=env)
        state.settings = settings
    total_steps = planned_steps(cfg.optim, loader, state)
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
    profiler = make_profiler(cfg.output, output_dir, env) if cfg.output.profile else None
    for line in resumed:
        logger.message(line)
    logger.message(f"trainable parameters: {built.trainable:,}")
    if built.layout is not None:
        logger.message(built.layout.describe())
    param_bytes = gather_ints(built.model.local_parameter_bytes(), env)
    logger.message(f"resident parameter bytes per rank after sharding: {param_bytes}")

    forward = Forward(env.device, precision, varlen=varlen, sequence=sequence)
    trainee = Trainee(model=built.model, forward=forward, loader=loader,
                      resume_step=state.step if resume is not None else None, report=logger.message)  # fmt: skip
    objective = run_objective.objective(trainee, training=True)
    if resume is not None:
        objective.load_state_dict(read_objective_state(resume, env), step=state.step)
    eval_objective = run_objective.objective(trainee, training=False)
    unit = run_objective.spec.unit

    contents = CheckpointContents(
        model=built.model, optimizer=optimizer, scaler=scaler,
        adapter=AdapterExport(built.unwrapped, built.keys, built.manifest) if adapters else None,
        objective_state=objective.state_dict,
    )  # fmt: skip
    options = SaveOptions(output_dir=output_dir, total_limit=cfg.output.save_total_limit, keep=resume,
                          async_save=cfg.output.async_save, timeout_s=cfg.dist.dist_timeout_s)  # fmt: skip
    checkpointer = Checkpointer(contents, options, env=env, report=logger.message)

    def checkpoint(at: TrainState, wait: bool) -> Path:
        if not shared_output or not cfg.resumable:
            why = "this --train_type with --fsdp_version 1 keeps no resumable checkpoints" if shared_output else (
                f"--output_dir {output_dir} is not shared by every node, so no checkpoint could be completed"
            )  # fmt: skip
            raise TrainingStopped(f"stopped by a signal after step {at.step}; {why}")
        return checkpointer.save(at, wait=wait)

    def run_eval(step: int) -> None:
        started = time.perf_counter()
        result = evaluate(built.model.module, eval_loader, objective=eval_objective, device=env.device)
        record: dict[str, object] = {"step": step, "eval_loss": result.loss}
        if objective.reports_perplexity:
            record |= {"eval_ppl": result.perplexity, "eval_tokens": result.tokens}
        else:
            record[f"eval_{unit}"] = result.tokens
        record |= {f"eval_{name}": value for name, value in result.metrics.items()}
        logger.log_eval({**record, "eval_s": time.perf_counter() - started})

    step = Step(
        model=built.model,
        objective=objective,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        optim=cfg.optim,
        env=env,
        activation_offload=cfg.fsdp.activation_offload,
        router=built.router,
    )
    logger.start_progress()  # the bar starts below the start-up lines
    try:
        with preemption_flag() as preempted:
            events = Events(
                total_steps=total_steps,
                checkpoint=checkpoint,
                save_steps=cfg.output.save_steps,
                run_eval=run_eval if eval_loader is not None else None,
                eval_steps=cfg.eval.eval_steps,
                preempted=preempted,
                profiler=profiler,
                between_steps=checkpointer.poll,
            )
            static = {"param_bytes_per_rank": param_bytes, "trainable_parameters": built.trainable}
            result = train_loop(step, loader, state=state, events=events, logger=logger, static_fields=static)
            checkpointer.close()  # a background save still in flight completes, SIGTERM or not
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
    adapters = cfg.lora.train_type in ("lora", "dora")
    sharder = make_sharder(cfg.fsdp, env=env, precision=precision, **unit_options(cfg, model_path))
    # Only quantized layers have a packed layout to decide.
    layout = sharder.layout if quantizes(cfg, model_path) else None
    backend, skeleton, new_blocks = make_skeleton(cfg, model_path, precision, layout, attention=attention)
    # Rank 0 digests each quantized layer while it is still whole, under its base-model name (before adapters).
    digests = LayerDigests(skeleton.model, skeleton.quantized) if adapters and env.is_main else None
    unwrapped = add_trainables(cfg, skeleton, precision, new_blocks)
    keys: dict[nn.Module, dict[str, str]] = {}
    if adapters:
        keys = adapter_keys(unwrapped)
        if any("" in names.values() for names in keys.values()):
            raise RuntimeError("an adapter parameter has no PEFT key: PEFT's state dict and the model disagree")
    blocks = {m: f"{n}." for n, m in skeleton.model.named_modules() if new_blocks and f"{n}." in new_blocks}
    if cfg.fsdp.gradient_checkpointing and cfg.fsdp.reentrant_checkpointing:
        # Reentrant checkpoints only backpropagate into a segment whose inputs require grad.
        unwrapped.enable_input_require_grads()
    if cfg.compute.tiled_mlp != "0":
        tiled = tile_mlps(skeleton.units, cfg.compute.tiled_mlp)
        if env.is_main:
            log.info("--tiled_mlp %s: %d modules run over tiles of tokens", cfg.compute.tiled_mlp, len(tiled))
    in_layers = {id(m) for layer in skeleton.units.values() for m in lora_layers(layer)}
    trainable = sum(p.numel() for p in unwrapped.parameters() if p.requires_grad)

    def shard_layer(name: str, layer: nn.Module) -> None:
        init_adapters(lora_layers(layer), seed=cfg.run.seed, name=name)
        if digests is not None:
            digests.add(layer)
        sharder.shard_unit(name, layer, root=skeleton.model)

    # A preference loss goes without the load-balancing loss, even where the model config asks for it.
    router = router_loss(unwrapped, 0.0 if cfg.objective.pairs else cfg.model.router_aux_loss_coef)
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
    init_adapters(outside, seed=cfg.run.seed, name="")
    sharded = sharder.finish(CausalLMLoss(unwrapped, chunk_tokens=cfg.compute.loss_chunk_tokens, router=router))
    if cfg.compute.compile:
        sharded.uncompiled = list(sharder.units)
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


def kept_experts(cfg: TrainConfig, model_path: Path) -> Callable[..., QuantizedLinear] | None:
    """The layer the checkpoint keeps its routed experts in whatever --quant says (MXFP4 with --mxfp4 keep), as
    its format's `kept_experts`; refuses training those frozen experts' weights."""
    keeps = checkpoint_format(model_path).kept_experts(cfg.quant)
    if keeps is not None and cfg.lora.train_type in ("full", "llama_pro"):
        raise UserError(
            f"--train_type {cfg.lora.train_type} trains the base weights, but --mxfp4 keep holds the routed experts "
            "frozen in the checkpoint's MXFP4: pass --mxfp4 dequantize"
        )
    return keeps


def quantizes(cfg: TrainConfig, model_path: Path) -> bool:
    """Whether the run holds quantized layers: --quant's, or experts the checkpoint keeps quantized."""
    return cfg.quant.quant != "none" or kept_experts(cfg, model_path) is not None


def unit_options(cfg: TrainConfig, model_path: Path) -> dict[str, Any]:
    """make_sharder's `ignore` and `adapters_own_units` for this run (they shape FSDP1's units)."""
    # FSDP1 only: DoRA's forward dequantizes the base layer from its LoRA layer, so the base layer must share its
    # decoder layer's unit instead of a (mixed-precision-ignored) unit of its own.
    ignore_quantized = quantizes(cfg, model_path) and cfg.lora.train_type != "dora"
    return {
        "ignore": (QuantizedLinear,) if ignore_quantized else (),
        "adapters_own_units": cfg.lora.train_type in ("lora", "dora"),
    }


def make_skeleton(
    cfg: TrainConfig,
    model_path: Path,
    precision: Precision,
    layout: PackedLayout | None,
    *,
    attention: str = "sdpa",
    weights: bool = True,
) -> tuple[QuantBackend | None, Skeleton, tuple[str, ...]]:
    """The run's backend for `layout` (None: --quant none), the skeleton it builds and the Llama-Pro blocks kept in
    full precision: what training builds before adapters, and what scripts/plan.py sizes (`weights` False: from
    config.json alone)."""
    backend, kept = None, None
    if layout is not None:
        packing = {"storage_dtype": layout.storage_dtype, "shard_state": layout.state_sharded,
                   "compute_dtype": quant_compute_dtype(precision, cfg.quant.compute_dtype)}  # fmt: skip
        backend = make_backend(cfg.quant, **packing)
        keeps = kept_experts(cfg, model_path)
        kept = None if keeps is None else functools.partial(keeps, **packing)
    new_blocks = expanded_layer_prefixes(model_path) if cfg.lora.train_type == "llama_pro" else ()
    skeleton = build_skeleton(
        cfg.model,
        backend=backend,
        param_dtype=precision.param_dtype,
        path=model_path,
        full_precision_prefixes=new_blocks,
        attention=attention,
        adapt_experts=cfg.lora.train_type in ("lora", "dora") and adapts_experts(cfg.lora.lora_target_modules),
        kept_experts=kept,
        weights=weights,
    )
    return backend, skeleton, new_blocks


def add_trainables(
    cfg: TrainConfig, skeleton: Skeleton, precision: Precision, new_blocks: tuple[str, ...]
) -> nn.Module:
    """The model that trains: the skeleton with PEFT's adapters (lora, dora), or with the weights that train marked
    so (full, llama_pro: only `new_blocks`)."""
    if cfg.lora.train_type in ("lora", "dora"):
        return inject_lora(skeleton.model, cfg.lora, dtype=precision.param_dtype, reference=skeleton.reference)
    return prepare_full_finetune(skeleton.model, only_prefixes=new_blocks)


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


def planned_steps(cfg: OptimConfig, loader: DataLoader, state: TrainState) -> int:
    """--max_steps, else --num_epochs of whole steps. A resumed run adds to the steps done those left at its own
    global batch, which may not be the checkpoint's: the rest of the current epoch, then whole epochs."""
    if cfg.max_steps:
        return cfg.max_steps
    sampler = loader.sampler  # a GlobalOrderSampler: a stream needs --max_steps
    per_epoch = sampler.steps_from(0)
    if not state.step:
        return cfg.num_epochs * per_epoch
    return state.step + sampler.steps_from(state.samples_in_epoch) + (cfg.num_epochs - 1 - state.epoch) * per_epoch
