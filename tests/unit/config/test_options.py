"""qlora_fsdp.config.options: validation messages, YAML/flag precedence, coercion, docs, and the --help listing."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

import qlora_fsdp.quant
from qlora_fsdp.config import options as config_module
from qlora_fsdp.config.help import option_docs
from qlora_fsdp.config.options import (
    FLAGS,
    SECTIONS,
    ConfigError,
    TrainConfig,
    build_config,
    check_registry,
    choices,
)
from qlora_fsdp.errors import InternalError, UserError

REPO_ROOT = Path(__file__).resolve().parents[3]


def names_flag(message: str, flag: str) -> bool:
    """True when `--flag` appears as a whole flag name (so --quant is not matched inside --bnb_quant_type)."""
    return re.search(rf"(?<![\w-])--{re.escape(flag)}(?![\w])", message) is not None


def problems_of(**flags: object) -> str:
    """The ConfigError message for a config with `model` set plus `flags`; fails the test when nothing is wrong."""
    cfg = build_config({"model": "some/model", **flags})
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    return str(info.value)


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# --- validation ------------------------------------------------------------------------------------------------


def test_defaults_need_only_a_model() -> None:
    with pytest.raises(ConfigError) as info:
        TrainConfig().validate()
    assert names_flag(str(info.value), "model")
    cfg = build_config({"model": "some/model"})
    assert cfg.validate() is cfg


def test_config_error_is_a_user_error() -> None:
    # The CLI turns UserError into a one-line message; ConfigError must be caught by that handler.
    assert issubclass(ConfigError, UserError)


BAD_CHOICES = [
    ("quant", "gptq"),
    ("bnb_quant_type", "int4"),
    ("hqq_bits", 5),
    ("compute_dtype", "fp8"),
    ("train_type", "prefix"),
    ("precision", "fp64"),
    ("sharding_strategy", "shard_everything"),
    ("optimizer", "lion"),
    ("lr_scheduler", "step"),
    ("log_to", "tensorboard"),
    ("device", "tpu"),
    ("prompt_style", "chatml"),
    ("nan_policy", "ignore"),
]


@pytest.mark.parametrize(("flag", "bad"), BAD_CHOICES, ids=[f for f, _ in BAD_CHOICES])
def test_each_choice_flag_rejects_a_bad_value(flag: str, bad: object) -> None:
    message = problems_of(**{flag: bad})
    assert names_flag(message, flag), message
    assert repr(bad) in message, message
    # Only this one problem: the rest of the defaults are valid.
    assert ";" not in message, message


def test_every_rejected_string_value_names_its_own_flag() -> None:
    """Whatever string flag refuses a nonsense value says which flag it was, and the listed choices are all found."""
    rejecting = set()
    for flag, (_, typ) in FLAGS.items():
        if typ is not str or flag == "model":
            continue
        cfg = build_config({"model": "m", flag: "no-such-value!"})
        try:
            cfg.validate()
        except ConfigError as exc:
            assert names_flag(str(exc), flag), (flag, str(exc))
            rejecting.add(flag)
    assert {flag for flag, _ in BAD_CHOICES if FLAGS[flag][1] is str} <= rejecting


def test_valid_choices_are_accepted() -> None:
    cfg = build_config(
        {
            "model": "m",
            "quant": "hqq",
            "hqq_bits": 2,
            "precision": "bf16_buffers_autocast",
            "lr_scheduler": "cosine",
            "log_to": "stdout",
            "device": "cpu",
            "prompt_style": "qna",
            "sharding_strategy": "hybrid_shard",
            "compute_dtype": "fp16",
            "bnb_quant_type": "fp4",
        }
    )
    assert cfg.validate() is cfg


def test_all_problems_are_reported_at_once() -> None:
    message = problems_of(quant="gptq", precision="fp64", batch_size=0, lora_dropout=1.5, lr=-1.0)
    for flag in ("quant", "precision", "batch_size", "lora_dropout", "lr"):
        assert names_flag(message, flag), (flag, message)
    assert message.count(";") == 4


def test_missing_model_is_reported_with_other_problems() -> None:
    cfg = build_config({"batch_size": 0})
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    assert names_flag(str(info.value), "model")
    assert names_flag(str(info.value), "batch_size")


RANGE_ERRORS = [
    ("batch_size", 0),
    ("gradient_accumulation_steps", 0),
    ("hqq_group_size", 12),
    ("hqq_group_size", 0),
    ("lora_dropout", 1.0),
    ("lora_dropout", -0.1),
    ("warmup_ratio", 1.0),
    ("warmup_ratio", -0.5),
    ("cosine_min_lr_ratio", 1.5),
    ("lora_rank", 0),
    ("lora_target_modules", "  "),
    ("dataset_samples", -1),
    ("context_length", 4),
    ("lr", 0.0),
    ("wd", -0.01),
    ("grad_norm", -1.0),
    ("num_epochs", 0),
    ("max_steps", -1),
    ("dist_timeout_s", 0),
    ("output_dir", ""),
    ("eval_split", 1.0),
    ("eval_split", -0.1),
]


@pytest.mark.parametrize(("flag", "bad"), RANGE_ERRORS, ids=[f"{f}={v!r}" for f, v in RANGE_ERRORS])
def test_range_checks(flag: str, bad: object) -> None:
    message = problems_of(**{flag: bad})
    assert names_flag(message, flag), message
    assert ";" not in message, message


@pytest.mark.parametrize(
    ("flag", "edge"),
    [
        ("batch_size", 1),
        ("gradient_accumulation_steps", 1),
        ("hqq_group_size", 8),
        ("lora_dropout", 0.0),
        ("warmup_ratio", 0.0),
        ("warmup_ratio", 0.99),
        ("cosine_min_lr_ratio", 0.0),
        ("cosine_min_lr_ratio", 1.0),
        ("context_length", 8),
        ("grad_norm", 0.0),
        ("max_steps", 0),
    ],
)
def test_range_edges_are_accepted(flag: str, edge: object) -> None:
    cfg = build_config({"model": "m", flag: edge})
    assert cfg.validate() is cfg


def test_full_finetune_needs_quant_none() -> None:
    message = problems_of(train_type="full", quant="bnb")
    assert names_flag(message, "train_type") and names_flag(message, "quant"), message
    cfg = build_config({"model": "m", "train_type": "full", "quant": "none"})
    assert cfg.validate() is cfg


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ({"packing_split": True}, ("packing_split", "packing")),
        ({"eval_dataset": "e.jsonl", "eval_split": 0.1}, ("eval_dataset", "eval_split")),
        ({"eval_steps": 5}, ("eval_steps", "eval_dataset", "eval_split")),
        ({"eval_samples": 10}, ("eval_samples", "eval_dataset", "eval_split")),
    ],
)
def test_packing_and_eval_flags_that_need_another(flags: dict[str, object], named: tuple[str, ...]) -> None:
    message = problems_of(**flags)
    assert all(names_flag(message, flag) for flag in named), message


def test_packing_and_eval_flags_accepted_together() -> None:
    flags = {"packing": True, "packing_split": True, "eval_split": 0.1, "eval_steps": 5, "eval_samples": 10}
    cfg = build_config({"model": "m", **flags})
    assert cfg.validate() is cfg


# --- build_config: precedence, YAML layouts, unknown keys, coercion ---------------------------------------------


def test_precedence_flat_yaml(tmp_path: Path) -> None:
    path = write(tmp_path / "run.yaml", "model: from/yaml\nlora_rank: 8\nlr: 0.002\nquant: hqq\n")
    cfg = build_config({"lr": 0.5, "quant": "none"}, path)
    assert cfg.model.model == "from/yaml"  # YAML over default
    assert cfg.lora.lora_rank == 8  # YAML over default (64)
    assert cfg.optim.lr == 0.5  # flag over YAML
    assert cfg.quant.quant == "none"  # flag over YAML
    assert cfg.data.batch_size == 1  # untouched default
    assert cfg.lora.lora_alpha == 16.0


def test_precedence_sectioned_yaml(tmp_path: Path) -> None:
    # "model" and "quant" are both section names and flag names: a mapping is a section, a scalar is the flag.
    text = (
        "model:\n  model: sectioned/model\n  trust_remote_code: true\n"
        "quant:\n  quant: hqq\n  hqq_bits: 2\n"
        "lora:\n  lora_rank: 4\n  lora_alpha: 8\n"
        "optim:\n  lr: 0.001\n  lr_scheduler: cosine\n"
    )
    path = write(tmp_path / "run.yaml", text)
    cfg = build_config({"hqq_bits": "8"}, path)
    assert cfg.model.model == "sectioned/model"
    assert cfg.model.trust_remote_code is True
    assert cfg.quant.quant == "hqq"
    assert cfg.quant.hqq_bits == 8  # flag wins, coerced from a string
    assert cfg.lora.lora_rank == 4
    assert cfg.lora.lora_alpha == 8.0 and isinstance(cfg.lora.lora_alpha, float)
    assert cfg.optim.lr == 0.001
    assert cfg.optim.lr_scheduler == "cosine"
    cfg.validate()


def test_mixed_flat_and_sectioned_yaml(tmp_path: Path) -> None:
    path = write(tmp_path / "run.yaml", "model: flat/model\nquant: bnb\ndata:\n  batch_size: 3\n")
    cfg = build_config({}, path)
    assert (cfg.model.model, cfg.quant.quant, cfg.data.batch_size) == ("flat/model", "bnb", 3)


def test_flags_alone_override_defaults() -> None:
    cfg = build_config({"model": "m", "num_epochs": 3})
    assert cfg.optim.num_epochs == 3
    assert cfg.run.seed == 42


def test_unknown_flag_keys_are_named() -> None:
    with pytest.raises(ConfigError) as info:
        build_config({"model": "m", "lora_rnk": 8, "learning_rate": 1.0})
    message = str(info.value)
    assert names_flag(message, "lora_rnk") and names_flag(message, "learning_rate"), message
    assert not names_flag(message, "model")


def test_unknown_yaml_keys_are_named(tmp_path: Path) -> None:
    path = write(tmp_path / "run.yaml", "lora:\n  lora_rnk: 8\nbatchsize: 2\n")
    with pytest.raises(ConfigError) as info:
        build_config({"model": "m"}, path)
    message = str(info.value)
    assert names_flag(message, "lora_rnk") and names_flag(message, "batchsize"), message


@pytest.mark.parametrize(
    ("flag", "raw", "expected"),
    [
        ("save_model", "false", False),
        ("save_model", "False", False),
        ("save_model", "no", False),
        ("save_model", "0", False),
        ("save_model", "true", True),
        ("save_model", "YES", True),
        ("lora_rank", "8", 8),
        ("lora_rank", 8.0, 8),
        ("lr", "3e-4", 3e-4),
        ("lora_alpha", 32, 32.0),
        ("lora_target_modules", ("q_proj", "v_proj"), "q_proj,v_proj"),
        ("lora_target_modules", ["k_proj"], "k_proj"),
        ("model", 123, "123"),
    ],
)
def test_type_coercion(flag: str, raw: object, expected: object) -> None:
    cfg = build_config({flag: raw})
    section, typ = FLAGS[flag]
    value = getattr(getattr(cfg, section), flag)
    assert value == expected
    assert type(value) is typ


@pytest.mark.parametrize(
    ("flag", "raw"),
    [("save_model", "maybe"), ("save_model", 2), ("lora_rank", "eight"), ("lora_rank", 2.5), ("lr", "fast")],
)
def test_uncoercible_values_name_the_flag(flag: str, raw: object) -> None:
    with pytest.raises(ConfigError) as info:
        build_config({flag: raw})
    assert names_flag(str(info.value), flag)
    assert repr(raw) in str(info.value)


@pytest.mark.parametrize("flag", ["lora_rank", "batch_size", "lr", "lora_alpha"])
def test_a_bare_flag_is_not_a_number(flag: str) -> None:
    """fire turns `--lora_rank --lr 1e-4` (value forgotten) into lora_rank=True; that must not become rank 1."""
    with pytest.raises(ConfigError) as info:
        build_config({"model": "m", flag: True})
    assert names_flag(str(info.value), flag)


def test_yaml_strings_are_coerced(tmp_path: Path) -> None:
    path = write(tmp_path / "run.yaml", "save_model: 'false'\nlora_rank: '16'\nlr: '1e-4'\n")
    cfg = build_config({}, path)
    assert cfg.output.save_model is False
    assert cfg.lora.lora_rank == 16
    assert cfg.optim.lr == 1e-4


def test_per_objective_values_apply_to_that_objective_only(tmp_path: Path) -> None:
    """A file's per_objective values win over its others for that objective's runs (named on the command line or
    in the file), and flags win over both."""
    text = "lr: 0.01\nper_objective:\n  kto: {lr: 0.002, shuffle: false}\n  dpo:\n    optim: {lr: 0.003}\n"
    path = write(tmp_path / "run.yaml", text)
    assert (build_config({}, path).optim.lr, build_config({}, path).data.shuffle) == (0.01, True)  # sft
    kto = build_config({"objective": "kto"}, path)
    assert (kto.optim.lr, kto.data.shuffle) == (0.002, False)
    assert build_config({"objective": "dpo"}, path).optim.lr == 0.003  # grouped by section
    assert build_config({"objective": "kto", "lr": 0.5}, path).optim.lr == 0.5
    in_file = write(tmp_path / "kto.yaml", "objective: kto\n" + text)
    assert build_config({}, in_file).optim.lr == 0.002


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("per_objective: [kto]\n", "per_objective must map objectives to their options"),
        ("per_objective:\n  kto: 3\n", "per_objective must map objectives to their options"),
        ("per_objective:\n  ppo: {lr: 0.1}\n", "per_objective: 'ppo' is not one of sft, dpo"),
        ("per_objective:\n  kto: {objective: dpo}\n", "per_objective: kto: sets --objective; set it outside"),
        ("per_objective:\n  kto: {lrr: 0.1}\n", "per_objective: kto: unknown option(s): --lrr"),
        ("per_objective:\n  dpo: {lrr: 0.1}\n", "per_objective: dpo: unknown option(s): --lrr"),  # not the run's
    ],
)
def test_per_objective_mistakes_are_named(tmp_path: Path, text: str, needle: str) -> None:
    path = write(tmp_path / "run.yaml", text)
    with pytest.raises(ConfigError) as info:
        build_config({"objective": "kto"}, path)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_missing_yaml_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        build_config({}, str(missing))
    assert str(missing) in str(info.value)
    assert names_flag(str(info.value), "config")


def test_invalid_yaml_file(tmp_path: Path) -> None:
    path = write(tmp_path / "bad.yaml", "lora_rank: [8\nlr: {\n")
    with pytest.raises(ConfigError) as info:
        build_config({}, path)
    assert "YAML" in str(info.value)
    assert path in str(info.value)


def test_yaml_that_is_not_a_mapping(tmp_path: Path) -> None:
    path = write(tmp_path / "list.yaml", "- lora_rank\n- 8\n")
    with pytest.raises(ConfigError) as info:
        build_config({}, path)
    assert path in str(info.value)


def test_empty_yaml_gives_defaults(tmp_path: Path) -> None:
    path = write(tmp_path / "empty.yaml", "")
    assert build_config({"model": "m"}, path) == build_config({"model": "m"})


def test_a_deprecated_flag_is_accepted_with_a_notice(tmp_path: Path) -> None:
    """--low_memory no longer does anything (loading always streams): old command lines and YAML files still run,
    each with one line saying so, and the flag is in no section (nor in --help)."""
    path = write(tmp_path / "old.yaml", "model:\n  model: m\n  low_memory: true\n")
    for cfg in (build_config({"model": "m", "low_memory": "false"}), build_config({}, path)):
        assert cfg.validate() and cfg.to_dict() == build_config({"model": "m"}).to_dict()
        (notice,) = cfg.notices
        assert notice.startswith("--low_memory is deprecated and does nothing: loading always streams")
    assert "low_memory" not in FLAGS and not build_config({"model": "m"}).notices


def test_replace_copies_and_coerces() -> None:
    base = build_config({"model": "m"})
    changed = config_module.replace(base, lora_rank="4", save_model="false")
    assert changed.lora.lora_rank == 4 and changed.output.save_model is False
    assert base.lora.lora_rank == 64 and base.output.save_model is True  # the original is untouched
    assert changed.lora is not base.lora


def test_to_dict_is_flat_over_every_flag() -> None:
    cfg = build_config({"model": "m", "lora_rank": 4})
    flat = cfg.to_dict()
    assert set(flat) == set(FLAGS)
    assert flat["lora_rank"] == 4 and flat["model"] == "m"


# --- docs and consistency with the rest of the package -------------------------------------------------------


def test_option_docs_cover_every_field() -> None:
    rows = option_docs()
    by_flag = {flag: (section, default, doc) for section, flag, default, doc in rows}
    assert len(rows) == len(by_flag) == len(FLAGS)
    for section_name, cls in SECTIONS.items():
        defaults = cls()
        for f in fields(cls):
            section, default, doc = by_flag[f.name]
            assert section == section_name
            assert default == getattr(defaults, f.name)
            assert doc.strip(), f"--{f.name} has no doc"


def test_flag_names_are_unique_across_sections() -> None:
    names = [f.name for cls in SECTIONS.values() for f in fields(cls)]
    assert len(names) == len(set(names)) == len(FLAGS)


def test_every_quant_backend_module_holds_a_backend() -> None:
    import importlib

    from qlora_fsdp.quant.base import QuantBackend

    for module in qlora_fsdp.quant.BACKENDS.values():
        assert issubclass(importlib.import_module(module).BACKEND, QuantBackend), module


def test_a_registry_that_drifts_from_its_flag_fails_at_import() -> None:
    """The registries (quant backends, precision modes, optimizers, schedules, prompt styles) call check_registry
    when imported; a value the flag allows with no entry, or an entry the flag does not allow, is a bug of ours."""
    check_registry(["adamw", "adam", "sgd", "adadelta"], "optimizer")
    check_registry(["bnb", "hqq"], "quant", besides=("none",))
    with pytest.raises(InternalError, match=r"--optimizer allows .* but its registry implements"):
        check_registry(["adamw", "adam", "sgd"], "optimizer")
    with pytest.raises(InternalError, match="--quant allows"):
        check_registry(["bnb", "hqq", "gptq"], "quant", besides=("none",))


def test_choice_flags_take_their_values_type_and_name_them_when_wrong() -> None:
    assert choices("hqq_bits") == (1, 2, 3, 4, 8) and choices("lora_rank") == ()
    assert build_config({"model": "m", "hqq_bits": "8", "fsdp_version": 1}).validate().quant.hqq_bits == 8
    with pytest.raises(ConfigError, match="--hqq_bits 5 is not one of 1, 2, 3, 4, 8"):
        build_config({"model": "m", "hqq_bits": 5}).validate()


@pytest.mark.distributed
def test_train_py_help_lists_every_flag() -> None:
    result = subprocess.run(
        [sys.executable, "train.py", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    listed = set(re.findall(r"--(\w+)", result.stdout))
    missing = sorted(set(FLAGS) - listed)
    assert not missing, f"--help does not list {missing}"
    assert "--config" in result.stdout


def test_empty_yaml_value_keeps_the_default(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("model: m\nrun_name:\nresume_from:\n")
    cfg = build_config({}, str(path)).validate()
    assert cfg.output.run_name == "" and cfg.output.resume_from == ""


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (
            {"train_type": "full", "quant": "none", "save_steps": 5, "fsdp_version": 1},
            "cannot reload the optimizer state of checkpoint-wrapped layers; use --fsdp_version 2",
        ),
        (
            {"train_type": "llama_pro", "resume_from": "auto", "fsdp_version": 1},
            "cannot reload the optimizer state of checkpoint-wrapped layers; use --fsdp_version 2",
        ),
        (
            {"train_type": "dora", "precision": "mp_bf16", "fsdp_version": 1},
            "--precision mp_bf16 with --train_type dora needs --fsdp_version 2",
        ),
        ({"fsdp_version": 3}, "--fsdp_version 3 is not one of 1, 2"),
        ({"compile": True, "fsdp_version": 1}, "--compile true needs --fsdp_version 2"),
        ({"packed_layout": "int8"}, "--packed_layout 'int8' is not one of auto, uint8, float"),
        ({"packed_layout": "float", "fsdp_version": 1}, "--packed_layout chooses FSDP2's layout"),
        ({"loss_chunk_tokens": -1}, "--loss_chunk_tokens must be >= 0"),
        ({"lora_alpha": 0}, "--lora_alpha must be > 0"),
        ({"profile_steps": "²,3"}, "--profile_steps"),
    ],
)
def test_combinations_rejected_up_front(flags: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle)):
        build_config({"model": "m", **flags}).validate()


@pytest.mark.parametrize(
    "flags",
    [{"train_type": "full", "quant": "none"}, {"train_type": "llama_pro"},
     {"train_type": "full", "quant": "none", "fsdp_version": 1, "gradient_checkpointing": False}],
)  # fmt: skip
def test_every_train_type_keeps_resumable_checkpoints(flags: dict) -> None:
    build_config({"model": "m", "save_steps": 5, "resume_from": "auto", **flags}).validate()


@pytest.mark.parametrize("precision", ["bf16", "bf16_autocast"])
def test_hqq_compute_dtype_independent_of_precision(precision: str) -> None:
    """The quantized layers cast their input to --compute_dtype and back, so any precision mode accepts it."""
    build_config({"model": "m", "quant": "hqq", "compute_dtype": "fp32", "precision": precision}).validate()
