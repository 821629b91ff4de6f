"""What a resume may change: every flag of TrainConfig sits in exactly one class, so none goes unchecked.

- MUST_MATCH: the data order, the base weights or the meaning of the saved trainable state; a change is refused.
- RESHARDED: how the state is laid out over ranks and steps, like the world size: a checkpoint of format 2 is
  resharded onto the new values (a format-1 checkpoint must match them). See checkpoint.check_resume_compatible.
- MAY_CHANGE: the new value applies from the resumed step on and the log names it (`resumed with --lr a -> b`).
- NOT_IDENTITY: where results go, how progress is shown, the job's environment: not recorded, never compared.

A unit test (tests/unit/checkpoint/test_resume_rules.py) fails when a flag is in no class or in two, so a new flag
cannot silently escape the check. A checkpoint records the first three classes; one written before a flag was recorded
does not know it, and the flag is then taken as unchanged (the log lists such must-match flags as unchecked).
"""

from __future__ import annotations

from typing import Any

from qlora_fsdp.config.options import TrainConfig

MUST_MATCH: tuple[str, ...] = (
    # The base model (recorded as a fingerprint of its config and weights) and how it is quantized.
    "model", "quant", "bnb_quant_type", "bnb_double_quant", "mxfp4", "hqq_bits", "hqq_group_size", "compute_dtype",
    "precision", "quantize_vision",
    # The trained state's shapes and meaning: another scaling or dropout trains another function of the weights.
    "train_type", "lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules", "optimizer", "objective",
    # The rows and their order: another value trains on other tokens or in another order.
    "dataset", "dataset_samples", "context_length", "seed", "prompt_style", "chat_template", "train_on_inputs",
    "packing", "packing_split", "max_prompt_length", "group_by_length", "shuffle", "dataset_streaming",
    "eval_split",  # it holds rows out of --dataset: another split trains on other rows
    "num_iterations",  # GRPO's prompts repeat this many steps in the data position: another value reads others
)  # fmt: skip

RESHARDED: tuple[str, ...] = (
    "batch_size", "gradient_accumulation_steps", "sharding_strategy", "shard_group_size", "fsdp_version",
    "sequence_parallel_size",  # how rows split over ranks, as the world size is how data does
    "num_generations",  # GRPO's prompts per batch are --batch_size / it, as the batch size sets rows per batch
)  # fmt: skip

MAY_CHANGE: tuple[str, ...] = (
    # The schedule and the loss weights: rebuilt from the flags at the resumed step, not restored.
    "lr", "wd", "lr_scheduler", "warmup_ratio", "cosine_min_lr_ratio", "max_steps", "num_epochs", "grad_norm",
    "beta", "label_smoothing", "simpo_gamma", "orpo_lambda", "orpo_nll", "desirable_weight", "undesirable_weight",
    "router_aux_loss_coef",  # a loss weight like --beta: the saved state means the same under another one
    # GRPO's rewards, sampling and loss: the next generation is sampled, scored and weighted under the new values.
    "reward_funcs", "reward_weights", "max_completion_length", "temperature", "top_p", "epsilon", "epsilon_high",
    "loss_type", "scale_rewards",
    "nan_policy",  # acts only on a non-finite step
    # Memory and speed: the same tokens train in the same order; named because rounding may differ.
    "loss_chunk_tokens",  # chunked cross-entropy is exact: only peak memory changes
    "pad_to_context",  # padding is masked out of attention and loss: only batch shapes change
    "compile",  # pads to the context like --pad_to_context, and fuses kernels
    "generation_mode",  # GRPO samples the same completions with the weights sharded or gathered
    "gradient_checkpointing", "reentrant_checkpointing",  # state dict names are free of checkpoint wrappers
    "activation_offload", "cpu_offload",  # where tensors wait, not what they hold
    "tiled_mlp",  # the same MLP over tiles of tokens: only peak memory changes
    "packed_layout",  # the frozen quantized base is rebuilt from the model, never loaded from the checkpoint
    "precompute_reference",  # the same reference log-probs, computed once instead of in every step
    # Evaluation and what the run writes: the training itself is untouched.
    "eval_dataset", "eval_steps", "eval_samples", "save_model", "save_steps", "save_total_limit",
)  # fmt: skip

NOT_IDENTITY: tuple[str, ...] = (
    "output_dir", "resume_from", "overwrite",  # where the run is and how it starts (a checkpoint may be moved)
    "async_save",  # how checkpoints are written, not what they hold
    "log_to", "project_name", "run_name", "wandb_entity", "group", "profile", "profile_steps",
    "dataset_cache_dir", "dataset_num_proc",  # the cache's key fingerprints the rows, wherever and however built
    "dataset_in_memory",  # the same rows, tokenized in memory instead of through the cache
    "trust_remote_code", "allow_pickle",  # permissions to load; the --model fingerprint pins what was loaded
    "device",  # the environment, like the number of ranks ('auto' would record nothing of it anyway)
    "dist_timeout_s",
    "world_size",  # only checks torchrun's count; the real world size is compared on its own
)  # fmt: skip

RECORDED: tuple[str, ...] = MUST_MATCH + RESHARDED + MAY_CHANGE
"""The flags a checkpoint records (trainer.run_settings), compared by check_resume_compatible on resume."""


def recorded_settings(cfg: TrainConfig) -> dict[str, Any]:
    """The recorded flags' values as given (the trainer replaces --model by its fingerprint)."""
    flags = cfg.to_dict()
    return {flag: flags[flag] for flag in RECORDED}


def resumed_message(change: str, step: int) -> str:
    """The log line for one change a resume made, `change` as check_resume_compatible returns it."""
    return f"resumed with {change}: applied from step {step + 1} on"


def unrecorded(stored: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """Flags whose change a resume would refuse but that a checkpoint written before they were recorded lacks."""
    return [flag for flag in settings if flag not in stored and flag not in MAY_CHANGE]


def unrecorded_message(path: object, flags: list[str]) -> str:
    """The log line for flags an older checkpoint could not be checked against: better said than skipped quietly."""
    names = ", ".join(f"--{flag}" for flag in flags)
    return f"{path} predates recording {names}: not checked, taken as unchanged"


def as_argument(flag: str, value: Any) -> str:
    """`--flag value` as a command line takes it, for the fix a refusal suggests."""
    if flag == "model":
        return f"--model with the base model it was trained on ({value})"
    if value is None:
        return f"no --{flag}"
    if isinstance(value, bool):
        return f"--{flag} {str(value).lower()}"
    text = str(value)
    return f"--{flag} {text}" if text and not any(c.isspace() or c in "'\"" for c in text) else f"--{flag} {value!r}"
