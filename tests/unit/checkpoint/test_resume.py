"""Checkpoint bookkeeping that needs no process group: completeness, resume choice and compatibility."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from qlora_fsdp.checkpoint.dcp import TRAINER_STATE, TrainState, list_checkpoints
from qlora_fsdp.checkpoint.resume import check_resume_compatible, resolve_resume
from qlora_fsdp.errors import UserError


def make_checkpoint(out: Path, step: int, *, complete: bool = True, legacy: bool = False, **settings: object) -> Path:
    """A checkpoint's trainer_state.json as 2 ranks wrote it; `legacy`: as format 1 did (micro-batches per rank)."""
    path = out / f"checkpoint-{step}"
    path.mkdir(parents=True)
    if complete:
        state = asdict(TrainState(step=step, world_size=2, settings=dict(settings)))
        if legacy:
            del state["samples_in_epoch"], state["format"]
            state["batch_in_epoch"] = 5
        (path / TRAINER_STATE).write_text(json.dumps(state))
    return path


def test_only_complete_checkpoints_count_newest_last(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 10)
    make_checkpoint(tmp_path, 9)
    make_checkpoint(tmp_path, 12, complete=False)  # killed before trainer_state.json was written
    (tmp_path / ".checkpoint-15.tmp").mkdir()  # killed mid-write
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-9", "checkpoint-10"]
    assert resolve_resume("auto", tmp_path) == tmp_path / "checkpoint-10"


def test_resume_choice(tmp_path: Path) -> None:
    assert resolve_resume("", tmp_path) is None
    assert resolve_resume("auto", tmp_path) is None  # nothing saved yet: a fresh start
    incomplete = make_checkpoint(tmp_path, 3, complete=False)
    with pytest.raises(UserError, match=r"--resume_from .*not a complete checkpoint"):
        resolve_resume(str(incomplete), tmp_path)


def test_resume_must_match_settings_but_reshards_onto_another_world_size(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path, 3, batch_size=2, lora_rank=8, dataset="a.jsonl")
    assert check_resume_compatible(ckpt, {"batch_size": 2, "lora_rank": 8, "dataset": "a.jsonl"}, world_size=2) == []
    changes = check_resume_compatible(ckpt, {"batch_size": 2}, world_size=4)
    assert len(changes) == 2 and changes[0].startswith("world size 2 -> 4 (trainable weights and optimizer state")
    assert changes[1].startswith("global batch 4 (2 ranks x --batch_size 2 x --gradient_accumulation_steps 1) -> 8")
    # The same global batch on other ranks continues the data exactly: only the world size is reported.
    assert len(check_resume_compatible(ckpt, {"batch_size": 1}, world_size=4, resharded=("batch_size",))) == 2
    with pytest.raises(UserError, match=r"--batch_size 2 -> 4; --lora_rank 8 -> 16"):
        check_resume_compatible(ckpt, {"batch_size": 4, "lora_rank": 16, "dataset": "a.jsonl"}, world_size=2)


def test_a_format_1_checkpoint_resumes_only_at_its_world_size(tmp_path: Path) -> None:
    from qlora_fsdp.checkpoint.dcp import read_train_state

    ckpt = make_checkpoint(tmp_path, 3, legacy=True, batch_size=2)
    state = read_train_state(ckpt)
    assert (state.format, state.samples_in_epoch) == (1, 5 * 2 * 2)  # 5 micro-batches of 2 on each of 2 ranks
    assert check_resume_compatible(ckpt, {"batch_size": 2}, world_size=2, resharded=("batch_size",)) == []
    with pytest.raises(
        UserError, match=r"saved by 2 processes but this job has 4; this checkpoint predates .* giving 2"
    ):
        check_resume_compatible(ckpt, {"batch_size": 2}, world_size=4)
    with pytest.raises(UserError, match=r"--batch_size 2 -> 1"):  # its optimizer shards fix the layout
        check_resume_compatible(ckpt, {"batch_size": 1}, world_size=2, resharded=("batch_size",))


@pytest.mark.parametrize(
    ("flags", "refused"),
    [({"dataset_streaming": True}, "--dataset_streaming deals rows to ranks by position"),
     ({"group_by_length": True}, "--group_by_length orders rows in global batches of 4")],
)  # fmt: skip
def test_orders_tied_to_the_ranks_refuse_another_layout(tmp_path: Path, flags: dict, refused: str) -> None:
    ckpt = make_checkpoint(tmp_path, 3, batch_size=2, **flags)
    with pytest.raises(UserError, match=refused):
        check_resume_compatible(ckpt, {"batch_size": 2, **flags}, world_size=1, resharded=("batch_size",))
    if "group_by_length" in flags:  # the same global micro-batch keeps the grouped order
        assert check_resume_compatible(ckpt, {"batch_size": 4, **flags}, world_size=1, resharded=("batch_size",))


def test_changes_that_may_happen_on_resume_are_returned_not_refused(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path, 3, lr=0.01, max_steps=10, lora_rank=8)
    changes = check_resume_compatible(
        ckpt, {"lr": 0.005, "max_steps": 10, "lora_rank": 8}, world_size=2, may_change=("lr", "max_steps")
    )
    assert changes == ["--lr 0.01 -> 0.005"]
    with pytest.raises(UserError, match=r"--lora_rank 8 -> 4"):
        check_resume_compatible(ckpt, {"lr": 0.005, "lora_rank": 4}, world_size=2, may_change=("lr",))


def recorded(model: Path, **flags: object) -> dict[str, object]:
    """What the trainer records in a checkpoint for these flags."""
    import torch

    from qlora_fsdp.config.options import build_config
    from qlora_fsdp.parallel.distributed import DistEnv
    from qlora_fsdp.train.trainer import run_settings

    env = DistEnv(0, 0, 8, 4, torch.device("cpu"), "gloo")  # 2 nodes x 4
    return run_settings(build_config({"model": str(model), **flags}).validate(), model, env)


@pytest.mark.parametrize(
    ("flag", "value"),
    [("quant", "hqq"), ("hqq_bits", 3), ("hqq_group_size", 32), ("bnb_quant_type", "fp4"), ("bnb_double_quant", False),
     ("lora_alpha", 8.0), ("lora_dropout", 0.0), ("lora_target_modules", "q_proj"), ("lora_rank", 4),
     ("train_type", "dora"), ("optimizer", "sgd"), ("precision", "fp32"),
     ("compute_dtype", "fp32"), ("chat_template", "chatml.jinja"), ("packing", True), ("eval_split", 0.1)],
)  # fmt: skip
def test_a_resume_that_changes_the_base_adapters_or_shards_is_refused_naming_the_flag(
    tiny_model: Path, tmp_path: Path, flag: str, value: object
) -> None:
    from qlora_fsdp.checkpoint.resume_rules import MAY_CHANGE, RESHARDED

    ckpt = make_checkpoint(tmp_path, 3, **recorded(tiny_model))
    with pytest.raises(UserError, match=rf"--{flag} \S+ -> "):
        check_resume_compatible(
            ckpt, recorded(tiny_model, **{flag: value}), world_size=2, may_change=MAY_CHANGE, resharded=RESHARDED
        )


@pytest.mark.parametrize(
    ("flag", "value"),
    [("fsdp_version", 1), ("sharding_strategy", "shard_grad_op"), ("batch_size", 2),
     ("gradient_accumulation_steps", 4)],
)  # fmt: skip
def test_layout_flags_reshard_a_format_2_checkpoint_but_not_a_format_1_one(
    tiny_model: Path, tmp_path: Path, flag: str, value: object
) -> None:
    from qlora_fsdp.checkpoint.resume_rules import MAY_CHANGE, RESHARDED

    rules = {"world_size": 2, "may_change": MAY_CHANGE, "resharded": RESHARDED}
    new = recorded(tiny_model, **{flag: value})
    changes = check_resume_compatible(make_checkpoint(tmp_path / "2", 3, **recorded(tiny_model)), new, **rules)
    assert changes and changes[0].startswith(f"--{flag} ")
    with pytest.raises(UserError, match=rf"--{flag} \S+ -> "):
        check_resume_compatible(make_checkpoint(tmp_path / "1", 3, legacy=True, **recorded(tiny_model)), new, **rules)


def test_a_resume_on_another_base_model_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    import shutil

    from qlora_fsdp.model.hub import model_identity

    # The same model under another name is the same model; other weights under the same name are not.
    renamed = tmp_path / "renamed"
    shutil.copytree(tiny_model, renamed)
    assert model_identity(renamed) == model_identity(tiny_model)
    other = tmp_path / "other"
    shutil.copytree(tiny_model, other)
    shard = sorted(other.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[8 + int.from_bytes(data[:8], "little") + 10] ^= 0xFF  # one byte of the first tensor's weights
    shard.write_bytes(bytes(data))
    assert model_identity(other) != model_identity(tiny_model)
    ckpt = make_checkpoint(tmp_path / "run", 3, model=model_identity(tiny_model))
    with pytest.raises(UserError, match=r"--model 'config and weights \w+' -> 'config and weights \w+'"):
        check_resume_compatible(ckpt, {"model": model_identity(other)}, world_size=2)


@pytest.mark.parametrize(
    ("flag", "value"),
    [("lr", 0.001), ("max_steps", 99), ("lr_scheduler", "cosine"), ("wd", 0.1), ("loss_chunk_tokens", 0),
     ("pad_to_context", True), ("save_steps", 5)],
)  # fmt: skip
def test_schedule_and_speed_flags_may_change(tiny_model: Path, tmp_path: Path, flag: str, value: object) -> None:
    from qlora_fsdp.checkpoint.resume_rules import MAY_CHANGE

    ckpt = make_checkpoint(tmp_path, 3, **recorded(tiny_model))
    changes = check_resume_compatible(ckpt, recorded(tiny_model, **{flag: value}), world_size=2, may_change=MAY_CHANGE)
    assert len(changes) == 1 and changes[0].startswith(f"--{flag} ")


def test_remove_checkpoints_takes_complete_and_unfinished_ones_only(tmp_path: Path) -> None:
    from qlora_fsdp.checkpoint.resume import remove_checkpoints

    make_checkpoint(tmp_path, 3)
    make_checkpoint(tmp_path, 6, complete=False)
    (tmp_path / ".checkpoint-9.tmp").mkdir()
    (tmp_path / "adapter_model.safetensors").write_text("x")
    (tmp_path / "notes").mkdir()
    remove_checkpoints(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_model.safetensors", "notes"]


def test_hybrid_sharding_records_the_shard_group_it_really_used(tiny_model: Path, tmp_path: Path) -> None:
    """--shard_group_size 0 means one node: 2 nodes x 4 and 1 node x 8 shard differently under the same flags."""
    import torch

    from qlora_fsdp.checkpoint.resume_rules import MAY_CHANGE
    from qlora_fsdp.config.options import build_config
    from qlora_fsdp.parallel.distributed import DistEnv
    from qlora_fsdp.train.trainer import run_settings

    cfg = build_config({"model": str(tiny_model), "sharding_strategy": "hybrid_shard"}).validate()
    two_nodes = run_settings(cfg, tiny_model, DistEnv(0, 0, 8, 4, torch.device("cpu"), "gloo"))
    one_node = run_settings(cfg, tiny_model, DistEnv(0, 0, 8, 8, torch.device("cpu"), "gloo"))
    assert (two_nodes["shard_group_size"], one_node["shard_group_size"]) == (4, 8)
    ckpt = make_checkpoint(tmp_path, 3, legacy=True, **two_nodes)
    with pytest.raises(UserError, match="--shard_group_size 4 -> 8"):
        check_resume_compatible(ckpt, one_node, world_size=2, may_change=MAY_CHANGE)
