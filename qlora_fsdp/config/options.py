"""Every option of a run, as typed dataclasses: the single source of truth for flags, YAML files and `--help`.

Each section is a dataclass whose field names are the flag names (`--lora_rank` is `LoraConfig.lora_rank`), so
flag names are unique across sections. `TrainConfig.validate()` runs once, before any heavy work, and reports
every problem at once, each with the flag that fixes it.
"""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml

from qlora_fsdp.config.objectives import (
    ObjectiveConfig,
    choice_problems,
    chosen_spec,
    objective_problems,
    objective_ranges,
)
from qlora_fsdp.errors import InternalError, UserError
from qlora_fsdp.objectives.specs import OBJECTIVES


class ConfigError(UserError):
    """One or more invalid options; the message lists each with the flag that fixes it."""


# The values of the choices that a registry elsewhere implements, each listed here once; the registry checks at
# import that it implements exactly these (check_registry). The other choices are Literal types on their field.
QuantName = Literal["bnb", "hqq", "none"]
"""qlora_fsdp.quant.BACKENDS, and none."""
PrecisionName = Literal["bf16", "fp32", "fp16_autocast", "bf16_autocast", "bf16_buffers_autocast", "mp_bf16"]
"""qlora_fsdp.parallel.precision.PRECISIONS."""
OptimizerName = Literal["adamw", "adam", "sgd", "adadelta"]
"""qlora_fsdp.train.optim.OPTIMIZERS."""
SchedulerName = Literal["constant", "linear", "cosine"]
"""qlora_fsdp.train.optim.DECAYS."""
PromptStyle = Literal["alpaca", "guanaco", "qna", "raw", "chat"]
"""qlora_fsdp.data.formats.PROMPT_STYLES."""


@dataclass
class ModelConfig:
    model: str = ""
    """Local model directory (config.json + safetensors shards) or a Hugging Face hub id."""
    trust_remote_code: bool = False
    """Allow model code from the hub repository (off: only architectures transformers ships)."""
    allow_pickle: bool = False
    """Also load pickle (.bin) checkpoints, with torch.load(weights_only=True); off: safetensors only."""
    quantize_vision: bool = False
    """Image-text models: quantize the vision tower's linears too (off: full precision, like the projector)."""
    router_aux_loss_coef: float | None = None
    """Mixture-of-experts models: weight of the router's load-balancing loss added to the training loss (0: none).
    Unset: the model config's own (`router_aux_loss_coef`, when its `output_router_logits` is true)."""


@dataclass
class QuantConfig:
    quant: QuantName = "bnb"
    """Quantization backend for the base linear layers: bnb (bitsandbytes 4-bit), hqq, or none."""
    bnb_quant_type: Literal["nf4", "fp4"] = "nf4"
    """bitsandbytes 4-bit data type: nf4 or fp4."""
    bnb_double_quant: bool = True
    """bitsandbytes: quantize the per-block scales too (saves about 0.4 bits per parameter)."""
    mxfp4: Literal["keep", "dequantize"] = "keep"
    """A checkpoint whose experts are MXFP4 (gpt-oss), or FP4 with E8M0 scales in an FP8 checkpoint (DeepSeek-V4's
    expert_dtype fp4): keep them as released, the frozen base bit for bit at 4.25 bits a weight; or dequantize them
    and quantize with --quant."""
    hqq_bits: Literal[1, 2, 3, 4, 8] = 4
    """HQQ bits per weight: 1, 2, 3, 4 or 8."""
    hqq_group_size: int = 64
    """HQQ weights per scale/zero group (a multiple of 8)."""
    compute_dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """Dtype the weights are dequantized to for the matmul: auto (follows --precision), bf16, fp16, fp32."""


@dataclass
class LoraConfig:
    train_type: Literal["lora", "dora", "full", "llama_pro"] = "lora"
    """lora: adapters on the frozen (quantized) base; dora: weight-decomposed LoRA (every rank loads the weights);
    full: every weight (needs --quant none); llama_pro: only blocks added by scripts/block_expansion.py."""
    lora_rank: int = 64
    """LoRA rank r."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator: the update is scaled by alpha / rank."""
    lora_dropout: float = 0.1
    """Dropout on the LoRA input."""
    lora_target_modules: str = "all"
    """Comma-separated linear layer names to adapt (q_proj,v_proj,...; `experts` adds a mixture-of-experts model's
    routed experts) or 'all': every linear but lm_head and the routing gates, and the routed experts."""


@dataclass
class FSDPConfig:
    fsdp_version: Literal[1, 2] = 2
    """2: torch's fully_shard, one unit per decoder layer, packed weights and their state sharded with it;
    1: FullyShardedDataParallel with the packed weights viewed as the parameter dtype."""
    packed_layout: Literal["auto", "uint8", "float"] = "auto"
    """FSDP2: packed weights and their state as uint8 parameters (torch 2.12+) or float (viewed as the dtype FSDP2
    gathers in, never cast); auto picks uint8 where this torch can shard it, else float."""
    precision: PrecisionName = "bf16"
    """bf16 / fp32: parameters in that dtype; *_autocast: fp32 (or bf16) parameters under autocast;
    mp_bf16: fp32 parameters that FSDP casts to bf16 for compute, gradients reduced in fp32."""
    sharding_strategy: Literal["full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2"] = (
        "full_shard"
    )
    """FSDP sharding: full_shard, shard_grad_op, no_shard, hybrid_shard or hybrid_shard_zero2."""
    shard_group_size: int = 0
    """hybrid_*: ranks per shard group, replicated across groups (0: the ranks of one node)."""
    cpu_offload: bool = False
    """Keep sharded parameters on CPU between uses (FSDP CPUOffload)."""
    gradient_checkpointing: bool = True
    """Recompute decoder-layer activations in backward to save memory."""
    reentrant_checkpointing: bool = False
    """Use the reentrant checkpoint implementation (some older stacks need it)."""
    activation_offload: bool = False
    """Keep activations saved for backward in host memory (GPU memory for PCIe traffic)."""


@dataclass
class ComputeConfig:
    """How each step computes: speed or memory traded, the function trained the same."""

    compile: bool = False
    """torch.compile each decoder layer (with --fsdp_version 2) after the first step: fused kernels for the
    dequantization, LoRA and attention glue. The second step pays the compilation."""
    tiled_mlp: str = "0"
    """Run each decoder layer's MLP (an MoE block's experts) over N tiles of tokens, recomputed tile by tile in
    backward: the layer's peak holds one tile's activations (0: off; auto: a tile per hidden-size tokens)."""
    loss_chunk_tokens: int = 512
    """Label tokens per chunk of the output head and cross-entropy: peak memory grows with the chunk, not with
    batch x sequence x vocabulary (0: whole logits at once)."""


@dataclass
class RunConfig:
    """What every stage of a run derives from."""

    seed: int = 42
    """Seed for LoRA's initial weights, the data order, dropout and GRPO's sampling: same seed, same losses."""


@dataclass
class DataConfig:
    dataset: str = "alpaca_sample"
    """alpaca, alpaca_sample, guanaco, sql, orca_math, dummy, or a local .json/.jsonl/.parquet file of alpaca,
    chat (OpenAI 'messages' or ShareGPT 'conversations'), 'text' or 'prompt'/'completion' rows; several,
    comma-separated, are concatenated."""
    dataset_samples: int = 0
    """Use only the first N rows of each dataset (0: all)."""
    dataset_cache_dir: str = ""
    """Where tokenized datasets are cached, shared by later runs and jobs (default: inside the Hugging Face datasets
    cache, HF_DATASETS_CACHE/qlora-fsdp-tokenized)."""
    dataset_num_proc: int = 0
    """Processes that tokenize a dataset the first time (0: one per 5,000 rows, at most the CPUs and 16)."""
    dataset_in_memory: bool = False
    """Tokenize on every rank into memory and write no cache (needs no `datasets`; the synthetic dummy dataset
    always is): for small datasets, or machines without `datasets`."""
    context_length: int = 512
    """Tokens per sample at most: longer samples are truncated (or split, with --packing_split)."""
    pad_to_context: bool = False
    """Pad every batch to --context_length (fixed shapes), not to its longest row rounded up to a multiple of 8
    (--compile always pads to the context)."""
    dataset_streaming: bool = False
    """Read and tokenize rows as training goes (hub datasets too), row i on rank i % ranks, in the sources' order:
    training starts at once, nothing is cached. Needs --max_steps; a resume re-reads the stream up to its step."""
    shuffle: bool = True
    """Read the training rows in a seeded order, reshuffled every epoch; false: in the file's order every epoch, as
    TRL's KTOTrainer does (a run fed a given order, to compare with another trainer's)."""
    group_by_length: bool = False
    """Batch rows of similar length together (less padding); the order is still seeded and the same at every world
    size for the same global batch."""
    batch_size: int = 1
    """Samples per rank per micro-step."""
    train_on_inputs: bool = False
    """Also compute the loss on the prompt tokens (default: only on the response, or on assistant turns in chat)."""
    prompt_style: PromptStyle = "alpaca"
    """Prompt template for alpaca-format data (local files, alpaca*) and the string prompts of preference, KTO and
    GRPO rows: alpaca, guanaco, qna, raw (the text as it is, as TRL reads a string prompt), or chat (a user and an
    assistant turn in the tokenizer's chat template). Chat rows always use the chat template."""
    chat_template: str = ""
    """Jinja chat template file for chat data, replacing the tokenizer's own (needed when it has none)."""
    packing: bool = False
    """Concatenate samples into rows of up to --context_length (position ids restart and attention stops at every
    sample), instead of one sample per row."""
    packing_split: bool = False
    """With --packing: split samples longer than --context_length into several instead of truncating them."""
    max_prompt_length: int = 0
    """Preference objectives: cut a pair's prompt from the left to at most N tokens (0: only as far as the context
    needs; the replies are always kept)."""


@dataclass
class EvalConfig:
    eval_dataset: str = ""
    """A dataset (name or local file, as --dataset) to compute the evaluation loss on."""
    eval_split: float = 0.0
    """Hold this fraction of --dataset out of training, chosen by --seed, and evaluate on it (0: none)."""
    eval_steps: int = 0
    """Evaluate every N optimizer steps and at the end (0: only at the end)."""
    eval_samples: int = 0
    """Evaluate on at most N rows of the evaluation set (0: all)."""


@dataclass
class OptimConfig:
    optimizer: OptimizerName = "adamw"
    """Optimizer: adamw, adam, sgd or adadelta (fused kernels on CUDA where torch has them)."""
    lr: float = 1e-5
    """Peak learning rate."""
    wd: float = 0.0
    """Weight decay."""
    grad_norm: float = 0.3
    """Clip the global gradient norm to this (0: no clipping); 0.3 is fsdp_qlora's, TRL and transformers use 1.0."""
    gradient_accumulation_steps: int = 1
    """Micro-steps per optimizer step."""
    lr_scheduler: SchedulerName = "constant"
    """Learning-rate schedule after warmup: constant, linear or cosine."""
    warmup_ratio: float = 0.0
    """Fraction of the optimizer steps spent warming up linearly from 0."""
    cosine_min_lr_ratio: float = 0.1
    """Cosine schedule floor, as a fraction of --lr."""
    num_epochs: int = 1
    """Passes over the dataset (ignored when --max_steps is set)."""
    max_steps: int = 0
    """Stop after this many optimizer steps (0: run --num_epochs)."""
    nan_policy: Literal["stop", "skip"] = "stop"
    """On a non-finite loss or gradient norm: stop (exit naming the step) or skip (leave the weights untouched)."""


@dataclass
class OutputConfig:
    output_dir: str = "output"
    """Where the adapter, metrics.jsonl and checkpoints go."""
    save_model: bool = True
    """Write the trained adapter (LoRA) or model (full) at the end."""
    save_steps: int = 0
    """Write a resumable checkpoint every N optimizer steps to OUTPUT_DIR/checkpoint-N (0: never)."""
    save_total_limit: int = 0
    """Keep only the newest K complete checkpoints (0: keep all); the one resumed from is never deleted."""
    async_save: bool = False
    """Write checkpoints in the background (DCP's async save): training stalls only to copy the state to host."""
    resume_from: str = ""
    """Resume from a checkpoint directory, or 'auto' for the newest complete one in --output_dir."""
    overwrite: bool = False
    """Allow --output_dir to hold a previous run, whose results are replaced."""
    log_to: Literal["tqdm", "stdout", "wandb"] = "tqdm"
    """Progress output: tqdm (bar on rank 0), stdout (a line per step) or wandb (tqdm + Weights & Biases)."""
    project_name: str = "qlora-fsdp"
    """Weights & Biases project."""
    run_name: str = ""
    """Weights & Biases run name (default: W&B picks one)."""
    wandb_entity: str = ""
    """Weights & Biases entity (team or user)."""
    group: str = ""
    """Weights & Biases run group, to show related runs (say bnb vs HQQ) together."""
    profile: bool = False
    """Write a torch.profiler Chrome trace (and a CUDA memory snapshot on GPU) to OUTPUT_DIR/profile."""
    profile_steps: str = "2,3"
    """With --profile: the steps to record, as FIRST,LAST (1-based, inclusive)."""


@dataclass
class DistConfig:
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA + NCCL when a GPU is visible, else CPU + gloo; or force cpu / cuda."""
    dist_timeout_s: int = 600
    """Seconds a collective may wait before the job fails instead of hanging."""
    world_size: int = 0
    """Expected number of processes; the run refuses to start if torchrun launched another number (0: any)."""
    sequence_parallel_size: int = 1
    """Ulysses sequence parallelism: groups of S consecutive ranks split each row along the sequence (all-to-all
    around attention), so a row S times longer fits; the data goes to world / S groups (1: off)."""


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "quant": QuantConfig,
    "lora": LoraConfig,
    "fsdp": FSDPConfig,
    "compute": ComputeConfig,
    "data": DataConfig,
    "objective": ObjectiveConfig,
    "eval": EvalConfig,
    "optim": OptimConfig,
    "output": OutputConfig,
    "dist": DistConfig,
    "run": RunConfig,
}


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    data: DataConfig = field(default_factory=DataConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    run: RunConfig = field(default_factory=RunConfig)
    notices: list[str] = field(default_factory=list)
    """One line for each deprecated flag given (DEPRECATED), for the run to print."""
    given: frozenset[str] = frozenset()
    """The flags set on the command line or in the YAML file, as against left at their defaults: a checkpoint
    that decides a setting itself (a pre-quantized one) refuses only a given flag that contradicts it."""

    @property
    def resumable(self) -> bool:
        """Whether this run's checkpoints can be resumed. Not FSDP1 with whole checkpoint-wrapped layers trained:
        torch's FSDP.optim_state_dict_to_load misses the names inside such a flattened unit."""
        whole_layers = self.lora.train_type in ("full", "llama_pro") and self.fsdp.gradient_checkpointing
        return not (whole_layers and self.fsdp.fsdp_version == 1)

    def problems(self) -> list[str]:
        """Every bad option and combination, each with the flag that fixes it."""
        return [*check_choices(self), *check_ranges(self), *_check_combinations(self)]

    def validate(self) -> TrainConfig:
        """Check every option; raise one ConfigError listing all problems, each with its flag."""
        problems = self.problems()
        if problems:
            raise ConfigError("; ".join(problems))
        return self

    def to_dict(self) -> dict[str, Any]:
        """Flat {flag: value}, for logging the run's settings."""
        return {f.name: getattr(section, f.name) for section in self._sections() for f in fields(section)}

    def _sections(self) -> list[Any]:
        return [getattr(self, name) for name in SECTIONS]


DEPRECATED = {
    "low_memory": "loading always streams each decoder layer into its shards on every rank (no rank holds the whole "
    "model)",
}
"""Flags that no longer do anything, and why: still accepted, so old scripts and YAML files run, each given one
printing a notice."""


def _flag_types() -> dict[str, tuple[str, type]]:
    """{flag: (section name, python type)} for every option."""
    out: dict[str, tuple[str, type]] = {}
    for section_name, cls in SECTIONS.items():
        hints = get_type_hints(cls)
        for f in fields(cls):
            out[f.name] = (section_name, hints[f.name])
    return out


FLAGS = _flag_types()
PER_OBJECTIVE = "per_objective"
"""A config file's key for values that apply to one objective's runs."""


def coerce(flag: str, value: Any, typ: type) -> Any:
    """Turn a YAML or command-line value into the field's type, or explain which flag is wrong."""
    if isinstance(typ, types.UnionType):  # `float | None`: unset unless given
        (typ,) = (t for t in typ.__args__ if t is not type(None))
    if get_origin(typ) is Literal:  # a choice: its values' type; check_choices says whether it is one of them
        typ = type(get_args(typ)[0])
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"--{flag} must be true or false, got {value!r}")
    if typ is str:
        # fire parses "q_proj,v_proj" as a tuple; join it back.
        if isinstance(value, (list, tuple)):
            return ",".join(str(v) for v in value)
        return str(value)
    if isinstance(value, bool):
        # fire turns a flag given without its value (`--lora_rank --lr 1e-4`) into True; int(True) would be 1.
        raise ConfigError(f"--{flag} must be a number ({typ.__name__}), got {value!r}; did you forget its value?")
    try:
        if typ is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if typ is float:
            return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"--{flag} must be a number ({typ.__name__}), got {value!r}") from None
    return value


def build_config(overrides: dict[str, Any], config_file: str | None = None) -> TrainConfig:
    """Defaults, then the YAML file's values, then command-line overrides; unknown keys are errors.

    The YAML file may be flat ({lora_rank: 8}) or grouped by section ({lora: {lora_rank: 8}}); its `per_objective`
    mapping holds values for one objective's runs only ({per_objective: {kto: {shuffle: false}}}), which win over
    the file's others, as a tool's defaults differ by trainer.
    """
    values: dict[str, Any] = {}
    if config_file:
        common, per_objective = _read_yaml(config_file)
        values.update(common)
        objective = overrides.get("objective") or values.get("objective") or ObjectiveConfig.objective
        values.update(per_objective.get(objective, {}))
    values.update(overrides)
    # An empty YAML value (`run_name:`) means "not set", not the string "None".
    values = {k: v for k, v in values.items() if v is not None}
    retired = sorted(k for k in values if k in DEPRECATED)
    unknown = sorted(k for k in values if k not in FLAGS and k not in DEPRECATED)
    if unknown:
        raise ConfigError(
            "unknown option(s): " + ", ".join(f"--{k}" for k in unknown) + " (python train.py --help lists them)"
        )
    cfg = TrainConfig(
        notices=[f"--{flag} is deprecated and does nothing: {DEPRECATED[flag]}" for flag in retired],
        given=frozenset(values) - DEPRECATED.keys(),
    )
    for flag, value in values.items():
        if flag in DEPRECATED:
            continue
        section_name, typ = FLAGS[flag]
        setattr(getattr(cfg, section_name), flag, coerce(flag, value, typ))
    return cfg


def _read_yaml(path: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The file's values, and its `per_objective` ones by objective."""
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: no such file")
    try:
        with open(path) as fh:
            raw = yaml.safe_load(fh) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: expected a mapping of option: value")
    per_objective = raw.pop(PER_OBJECTIVE, None) or {}
    if not isinstance(per_objective, dict) or not all(isinstance(v, dict) for v in per_objective.values()):
        raise ConfigError(f"--config {path}: {PER_OBJECTIVE} must map objectives to their options (NAME: {{...}})")
    for name, options in per_objective.items():
        if name not in OBJECTIVES and ":" not in str(name):
            raise ConfigError(f"--config {path}: {PER_OBJECTIVE}: {name!r} is not one of {', '.join(OBJECTIVES)}")
        if "objective" in _flat(options):
            raise ConfigError(f"--config {path}: {PER_OBJECTIVE}: {name}: sets --objective; set it outside")
        if unknown := sorted(k for k in _flat(options) if k not in FLAGS and k not in DEPRECATED):
            raise ConfigError(f"--config {path}: {PER_OBJECTIVE}: {name}: unknown option(s): "
                              + ", ".join(f"--{k}" for k in unknown))  # fmt: skip
    return _flat(raw), {name: _flat(options) for name, options in per_objective.items()}


def _flat(raw: dict[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if key in SECTIONS and isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat


def choice(flag: str, value: Any, allowed: tuple) -> list[str]:
    if value in allowed:
        return []
    return [f"--{flag} {value!r} is not one of {', '.join(str(a) for a in allowed)}"]


def choices(flag: str) -> tuple:
    """The values a choice flag may take (its field's Literal type), in the order --help and errors list them."""
    typ = FLAGS[flag][1]
    return get_args(typ) if get_origin(typ) is Literal else ()


def check_registry(registry: Iterable[str], flag: str, *, besides: tuple[str, ...] = ()) -> None:
    """Called by a registry at import: it must implement exactly the values --flag allows (`besides`: those that
    need no entry, such as --quant none), so the flag and the code cannot drift apart."""
    implemented, allowed = {*registry, *besides}, set(choices(flag))
    if implemented != allowed:
        raise InternalError(f"--{flag} allows {sorted(allowed)} but its registry implements {sorted(implemented)}")


def check_choices(cfg: TrainConfig) -> list[str]:
    problems = [
        problem
        for flag, (section, _) in FLAGS.items()
        if choices(flag)
        for problem in choice(flag, getattr(getattr(cfg, section), flag), choices(flag))
    ]
    return problems + choice_problems(cfg.objective)


def check_ranges(cfg: TrainConfig) -> list[str]:
    tiles = cfg.compute.tiled_mlp
    checks = [
        (not cfg.model.model, "--model is required (a local model directory or a hub id)"),
        (cfg.quant.hqq_group_size < 8 or cfg.quant.hqq_group_size % 8, "--hqq_group_size must be a multiple of 8"),
        (cfg.lora.lora_rank < 1, "--lora_rank must be >= 1"),
        (cfg.lora.lora_alpha <= 0, "--lora_alpha must be > 0"),
        (not 0 <= cfg.lora.lora_dropout < 1, "--lora_dropout must be in [0, 1)"),
        (not (cfg.model.router_aux_loss_coef or 0) >= 0, "--router_aux_loss_coef must be >= 0"),
        (not cfg.lora.lora_target_modules.strip(), "--lora_target_modules must be 'all' or layer names"),
        (cfg.data.dataset_samples < 0, "--dataset_samples must be >= 0"),
        (cfg.data.dataset_num_proc < 0, "--dataset_num_proc must be >= 0 (0: automatic)"),
        (cfg.data.context_length < 8, "--context_length must be >= 8"),
        (cfg.data.batch_size < 1, "--batch_size must be >= 1"),
        (not 0 <= cfg.eval.eval_split < 1, "--eval_split must be in [0, 1)"),
        (cfg.eval.eval_steps < 0, "--eval_steps must be >= 0 (0: only at the end)"),
        (cfg.eval.eval_samples < 0, "--eval_samples must be >= 0 (0: all)"),
        (cfg.optim.gradient_accumulation_steps < 1, "--gradient_accumulation_steps must be >= 1"),
        (cfg.optim.lr <= 0, "--lr must be > 0"),
        (cfg.optim.wd < 0, "--wd must be >= 0"),
        (cfg.optim.grad_norm < 0, "--grad_norm must be >= 0 (0 disables clipping)"),
        (not 0 <= cfg.optim.warmup_ratio < 1, "--warmup_ratio must be in [0, 1)"),
        (not 0 <= cfg.optim.cosine_min_lr_ratio <= 1, "--cosine_min_lr_ratio must be in [0, 1]"),
        (cfg.optim.num_epochs < 1, "--num_epochs must be >= 1"),
        (cfg.optim.max_steps < 0, "--max_steps must be >= 0 (0: run --num_epochs)"),
        (cfg.dist.dist_timeout_s < 1, "--dist_timeout_s must be >= 1"),
        (cfg.dist.world_size < 0, "--world_size must be >= 0 (0: whatever torchrun launched)"),
        (cfg.output.save_steps < 0, "--save_steps must be >= 0 (0: no checkpoints)"),
        (cfg.output.save_total_limit < 0, "--save_total_limit must be >= 0 (0: keep all)"),
        (cfg.compute.loss_chunk_tokens < 0, "--loss_chunk_tokens must be >= 0 (0: whole logits)"),
        (cfg.fsdp.shard_group_size < 0, "--shard_group_size must be >= 0 (0: ranks per node)"),
        (cfg.dist.sequence_parallel_size < 1, "--sequence_parallel_size must be >= 1 (1: off)"),
        (not _is_step_window(cfg.output.profile_steps), "--profile_steps must be FIRST,LAST with 1 <= FIRST <= LAST"),
        (not (tiles == "auto" or tiles.isdigit()), "--tiled_mlp must be N tiles or auto"),
        (not cfg.output.output_dir, "--output_dir must not be empty"),
        (cfg.data.max_prompt_length < 0, "--max_prompt_length must be >= 0 (0: no limit of its own)"),
    ]
    known = chosen_spec(cfg.objective) is not None
    return [message for bad, message in checks if bad] + (objective_ranges(cfg.objective) if known else [])


def _is_step_window(spec: str) -> bool:
    parts = spec.split(",")
    digits = len(parts) == 2 and all(p.strip().isascii() and p.strip().isdigit() for p in parts)
    return digits and 1 <= int(parts[0]) <= int(parts[1])


def profile_window(spec: str) -> tuple[int, int]:
    """--profile_steps as (first, last), 1-based inclusive."""
    first, last = (int(p) for p in spec.split(","))
    return first, last


def _check_combinations(cfg: TrainConfig) -> list[str]:
    problems = []
    if cfg.lora.train_type == "full" and cfg.quant.quant != "none":
        problems.append("--train_type full trains every weight and needs --quant none")
    if not cfg.resumable and (cfg.output.save_steps or cfg.output.resume_from):
        problems.append(
            f"--save_steps/--resume_from with --train_type {cfg.lora.train_type} and --fsdp_version 1 cannot reload "
            "the optimizer state of checkpoint-wrapped layers; use --fsdp_version 2 or --gradient_checkpointing false"
        )
    if cfg.fsdp.packed_layout != "auto" and cfg.fsdp.fsdp_version == 1:
        problems.append("--packed_layout chooses FSDP2's layout; FSDP1 always views packed weights as float")
    if cfg.compute.compile and cfg.fsdp.fsdp_version == 1:
        # FSDP1's flat parameters swap module attributes in hooks that compiled code does not see.
        problems.append("--compile true needs --fsdp_version 2")
    if cfg.fsdp.fsdp_version == 1 and cfg.lora.train_type == "dora" and cfg.fsdp.precision == "mp_bf16":
        # FSDP1 keeps DoRA's quantized layers in their decoder layer's unit, whose parameters mp_bf16 casts.
        problems.append("--precision mp_bf16 with --train_type dora needs --fsdp_version 2")
    if cfg.data.dataset_streaming:
        for bad, flag in (
            (not cfg.optim.max_steps, "--max_steps N (a stream has no length to count epochs by)"),
            (cfg.eval.eval_split, "--eval_dataset instead of --eval_split (holding rows out needs the whole dataset)"),
            (cfg.data.group_by_length, "no --group_by_length (grouping needs every row's length)"),
            (cfg.data.dataset_in_memory, "no --dataset_in_memory (a stream is tokenized as it is read)"),
        ):
            if bad:
                problems.append(f"--dataset_streaming true needs {flag}")
    sp = cfg.dist.sequence_parallel_size
    for bad, flag in ((cfg.compute.compile, "compile"), (cfg.data.dataset_streaming, "dataset_streaming"),
                      (cfg.objective.precompute_reference, "precompute_reference")):  # fmt: skip
        if sp > 1 and bad:
            problems.append(f"--sequence_parallel_size {sp} does not combine with --{flag} (not yet); drop one")
    if cfg.data.group_by_length and not cfg.data.shuffle:
        problems.append("--group_by_length true orders rows by a seeded shuffle; drop it for --shuffle false")
    if cfg.data.packing_split and not cfg.data.packing:
        problems.append("--packing_split splits samples into packed rows and needs --packing true")
    if cfg.eval.eval_dataset and cfg.eval.eval_split:
        problems.append("--eval_dataset and --eval_split both name an evaluation set; pass one of them")
    evaluates = cfg.eval.eval_dataset or cfg.eval.eval_split
    if not evaluates and (cfg.eval.eval_steps or cfg.eval.eval_samples):
        problems.append("--eval_steps/--eval_samples need an evaluation set: --eval_dataset FILE or --eval_split 0.1")
    return problems + objective_problems(cfg)


def replace(cfg: TrainConfig, **flags: Any) -> TrainConfig:
    """A copy of cfg with some flags changed (tests and benchmarks build variants this way)."""
    out = dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name)) for name in SECTIONS})
    for flag, value in flags.items():
        section_name, typ = FLAGS[flag]
        setattr(getattr(out, section_name), flag, coerce(flag, value, typ))
    return out
