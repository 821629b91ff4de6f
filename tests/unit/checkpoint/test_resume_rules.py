"""Resume rules that cannot go stale: every flag is in exactly one class, and each class behaves on a change."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any, get_args

import pytest

from qlora_fsdp.checkpoint.dcp import TRAINER_STATE, TrainState
from qlora_fsdp.checkpoint.resume import check_resume_compatible
from qlora_fsdp.checkpoint.resume_rules import (
    MAY_CHANGE,
    MUST_MATCH,
    NOT_IDENTITY,
    RECORDED,
    RESHARDED,
    as_argument,
    recorded_settings,
    resumed_message,
    unrecorded,
    unrecorded_message,
)
from qlora_fsdp.config.options import FLAGS, TrainConfig, build_config, replace
from qlora_fsdp.errors import UserError

CLASSES = {"MUST_MATCH": MUST_MATCH, "RESHARDED": RESHARDED, "MAY_CHANGE": MAY_CHANGE, "NOT_IDENTITY": NOT_IDENTITY}
RULES: dict[str, Any] = {"world_size": 2, "may_change": MAY_CHANGE, "resharded": RESHARDED}
# What checkpoints written before every flag was classified recorded (trainer.py's three lists and --model).
OLD_RECORDED = (
    "model", "dataset", "dataset_samples", "context_length", "seed", "prompt_style", "train_on_inputs", "packing",
    "packing_split", "eval_split", "group_by_length", "dataset_streaming", "train_type", "quant", "bnb_quant_type",
    "bnb_double_quant", "hqq_bits", "hqq_group_size", "compute_dtype", "lora_rank", "lora_alpha", "lora_dropout",
    "lora_target_modules", "precision", "optimizer", "chat_template", "objective", "max_prompt_length",
    "batch_size", "gradient_accumulation_steps", "sharding_strategy", "shard_group_size", "fsdp_version",
    "lr", "wd", "lr_scheduler", "warmup_ratio", "cosine_min_lr_ratio", "max_steps", "num_epochs", "grad_norm",
    "beta", "label_smoothing", "simpo_gamma", "orpo_lambda",
)  # fmt: skip


def test_every_flag_is_in_exactly_one_class() -> None:
    listed = [flag for flags in CLASSES.values() for flag in flags]
    twice = {flag: [name for name, flags in CLASSES.items() if flag in flags] for flag, n in Counter(listed).items()}
    assert {flag: where for flag, where in twice.items() if len(where) > 1} == {}, "a flag in two classes"
    assert sorted(set(FLAGS) - set(listed)) == [], "a flag in no class: add it to one in checkpoint/resume_rules.py"
    assert sorted(set(listed) - set(FLAGS)) == [], "a class names a flag TrainConfig does not have"
    assert set(TrainConfig().to_dict()) == set(FLAGS)  # FLAGS covers every section of TrainConfig


def test_a_checkpoint_records_exactly_the_compared_flags(tiny_model: Path) -> None:
    import torch

    from qlora_fsdp.parallel.distributed import DistEnv
    from qlora_fsdp.train.trainer import run_settings

    cfg = build_config({"model": str(tiny_model)}).validate()
    settings = run_settings(cfg, tiny_model, DistEnv(0, 0, 2, 2, torch.device("cpu"), "gloo"))
    assert sorted(settings) == sorted(RECORDED)
    assert str(settings["model"]).startswith("config and weights ")  # the fingerprint, not the path
    json.dumps(settings)  # trainer_state.json holds them


def _config() -> TrainConfig:
    return build_config({"model": "base-model"})


def _other(value: Any, flag: str = "") -> Any:
    """Another value of the same type (validity is not the comparison's business); an unset objective setting
    gets a value of its flag's type."""
    if value is None:
        kind = next(t for t in get_args(FLAGS[flag][1]) if t is not type(None))
        return {int: 3, float: 0.25, str: "x"}[kind]
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    return f"{value}x"


def _checkpoint(out: Path, settings: dict[str, Any], *, legacy: bool = False) -> Path:
    """trainer_state.json of a checkpoint 2 ranks wrote at step 4 (`legacy`: format 1)."""
    path = out / "checkpoint-4"
    path.mkdir(parents=True)
    state = asdict(TrainState(step=4, world_size=2, settings=settings))
    if legacy:
        del state["samples_in_epoch"], state["format"]
        state["batch_in_epoch"] = 0
    (path / TRAINER_STATE).write_text(json.dumps(state))
    return path


def _change(flag: str) -> tuple[Any, Any, dict[str, Any]]:
    """The old value, the new one, and the settings a run with the new one records."""
    cfg = _config()
    old = cfg.to_dict()[flag]
    new = _other(old, flag)
    return old, new, recorded_settings(replace(cfg, **{flag: new}))


@pytest.mark.parametrize("flag", MUST_MATCH)
def test_a_must_match_change_is_refused_in_one_line_naming_flag_values_and_fix(tmp_path: Path, flag: str) -> None:
    ckpt = _checkpoint(tmp_path, recorded_settings(_config()))
    old, new, settings = _change(flag)
    with pytest.raises(UserError) as refused:
        check_resume_compatible(ckpt, settings, **RULES)
    message = str(refused.value)
    assert "\n" not in message
    assert f"the checkpoint was made with other settings (--{flag} {old!r} -> {new!r})" in message
    fix = f"to continue it, resume with {as_argument(flag, old)}, or start a new run in another --output_dir"
    assert message.endswith(fix)


@pytest.mark.parametrize("flag", MAY_CHANGE)
def test_a_may_change_change_is_named_in_the_log(tmp_path: Path, flag: str) -> None:
    ckpt = _checkpoint(tmp_path, recorded_settings(_config()))
    old, new, settings = _change(flag)
    changes = check_resume_compatible(ckpt, settings, **RULES)
    assert changes == [f"--{flag} {old!r} -> {new!r}"]
    assert resumed_message(changes[0], 4) == f"resumed with --{flag} {old!r} -> {new!r}: applied from step 5 on"


@pytest.mark.parametrize("flag", RESHARDED)
def test_a_resharded_change_is_named_but_refused_by_a_format_1_checkpoint(tmp_path: Path, flag: str) -> None:
    old, new, settings = _change(flag)
    changes = check_resume_compatible(_checkpoint(tmp_path / "2", recorded_settings(_config())), settings, **RULES)
    assert changes[0] == f"--{flag} {old!r} -> {new!r}"
    legacy = _checkpoint(tmp_path / "1", recorded_settings(_config()), legacy=True)
    fix = re.escape(f"(--{flag} {old!r} -> {new!r}); to continue it, resume with {as_argument(flag, old)}")
    with pytest.raises(UserError, match=fix):
        check_resume_compatible(legacy, settings, **RULES)


@pytest.mark.parametrize("flag", NOT_IDENTITY)
def test_a_flag_outside_the_runs_identity_is_neither_recorded_nor_reported(tmp_path: Path, flag: str) -> None:
    ckpt = _checkpoint(tmp_path, recorded_settings(_config()))
    _, _, settings = _change(flag)
    assert settings == recorded_settings(_config())
    assert check_resume_compatible(ckpt, settings, **RULES) == []


def test_an_older_checkpoint_resumes_its_unrecorded_flags_taken_as_unchanged(tmp_path: Path) -> None:
    """Flags a checkpoint did not record are unknown, not changed: neither refused nor reported, and the log names
    the must-match ones it could not check."""
    base = recorded_settings(_config())
    stored = {k: v for k, v in base.items() if k in OLD_RECORDED}
    ckpt = _checkpoint(tmp_path, stored)
    new = recorded_settings(replace(_config(), pad_to_context=True, loss_chunk_tokens=0, eval_steps=5, compile=True))
    assert check_resume_compatible(ckpt, new, **RULES) == []
    # Today every must-match flag was recorded already; one classified later would be named here.
    assert unrecorded(stored, new) == [f for f in RECORDED if f not in OLD_RECORDED and f not in MAY_CHANGE]
    # Flags it did record are still checked.
    with pytest.raises(UserError, match=r"--lora_rank 64 -> 8"):
        check_resume_compatible(ckpt, recorded_settings(replace(_config(), lora_rank=8)), **RULES)
    older = {k: v for k, v in stored.items() if k not in ("objective", "max_prompt_length", "lr")}
    changed = recorded_settings(replace(_config(), max_prompt_length=32, lr=0.5))
    assert check_resume_compatible(_checkpoint(tmp_path / "older", older), changed, **RULES) == []
    # Not --lr: it may change anyway. --mxfp4, --quantize_vision, --shuffle, --num_iterations,
    # --sequence_parallel_size and --num_generations came after OLD_RECORDED's checkpoints.
    assert unrecorded(older, changed) == ["mxfp4", "quantize_vision", "objective", "max_prompt_length", "shuffle",
                                          "num_iterations", "sequence_parallel_size", "num_generations"]  # fmt: skip
    assert unrecorded_message("ckpt", ["objective", "max_prompt_length"]) == (
        "ckpt predates recording --objective, --max_prompt_length: not checked, taken as unchanged"
    )


@pytest.mark.parametrize(
    ("flag", "value", "argument"),
    [("lora_rank", 64, "--lora_rank 64"), ("packing", False, "--packing false"),
     ("chat_template", "", "--chat_template ''"), ("dataset", "a b.jsonl", "--dataset 'a b.jsonl'"),
     ("beta", None, "no --beta"),
     ("model", "config and weights 0a", "--model with the base model it was trained on (config and weights 0a)")],
)  # fmt: skip
def test_the_fix_reads_as_a_command_line(flag: str, value: Any, argument: str) -> None:
    assert as_argument(flag, value) == argument


def test_grpo_settings_left_at_their_defaults_equal_the_same_values_given(tmp_path: Path) -> None:
    grpo = {"objective": "grpo", "reward_funcs": "m:f", "batch_size": 4}
    ckpt = _checkpoint(tmp_path, recorded_settings(replace(_config(), **grpo)))
    given = recorded_settings(replace(_config(), **grpo, num_iterations=1, num_generations=8, beta=0.0))
    assert check_resume_compatible(ckpt, given, **RULES) == []


@pytest.mark.parametrize(
    ("saved", "resumed", "world_size", "needle"),
    [
        # Step 4 of --num_iterations 3 is between a generation's steps: only the layout that saved it resumes there.
        ({"num_iterations": 3}, {"num_iterations": 3}, 2, ""),
        ({"num_iterations": 3}, {"num_iterations": 3, "batch_size": 8, "gradient_accumulation_steps": 2}, 1,
         "step 4 falls between"),
        ({"num_iterations": 3}, {"num_iterations": 3}, 1, "step 4 falls between the --num_iterations 3 steps"),
        ({"num_iterations": 3}, {"num_iterations": 3, "num_generations": 2}, 2, "step 4 falls between"),
        # At a multiple of --num_iterations another world size resumes, with the same prompts a step only.
        ({"num_iterations": 2}, {"num_iterations": 2, "batch_size": 8}, 1, ""),
        ({"num_iterations": 2}, {"num_iterations": 2}, 1, "continues only with 2 prompts a step"),
        ({}, {}, 1, ""),  # --num_iterations 1: any layout
    ],
)  # fmt: skip
def test_grpo_resumes_where_its_prompts_and_generation_fit(tmp_path: Path, saved: dict, resumed: dict,
                                                           world_size: int, needle: str) -> None:  # fmt: skip
    grpo = {"objective": "grpo", "reward_funcs": "m:f", "batch_size": 4, "num_generations": 4}
    ckpt = _checkpoint(tmp_path, recorded_settings(replace(_config(), **grpo, **saved)))
    settings = recorded_settings(replace(_config(), **{**grpo, **resumed}))
    rules = {**RULES, "world_size": world_size}
    if not needle:
        check_resume_compatible(ckpt, settings, **rules)
    else:
        with pytest.raises(UserError, match=re.escape(needle)):
            check_resume_compatible(ckpt, settings, **rules)
