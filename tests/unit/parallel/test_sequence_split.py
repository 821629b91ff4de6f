"""Sequence parallelism's parts that need no second rank: how rows split into slices, which models and flags are
refused (in one line, exit 2, before the model loads), and the loss of a slice whose labels run one past it."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qlora_fsdp.config.options import build_config
from qlora_fsdp.data import IGNORE_INDEX
from qlora_fsdp.data.rows import collate
from qlora_fsdp.errors import UserError
from qlora_fsdp.objectives.loss import full_loss_sum
from qlora_fsdp.parallel.sequence_parallel import POSITIONS, ROW_LABEL_TOKENS, check_heads, split_rows
from tests.cli.test_bad_input import assert_one_line_error, run_cli
from tests.conftest import DATASET, without_weights


def batch(packed: bool) -> dict[str, torch.Tensor]:
    """Two rows of 11 and 7 tokens (the second packed from samples of 4 and 3), padded to 16."""
    rows = [
        {"input_ids": list(range(100, 111)), "labels": [IGNORE_INDEX] * 3 + list(range(103, 111))},
        {"input_ids": list(range(200, 207)), "labels": [IGNORE_INDEX, *range(201, 207)]},
    ]
    if packed:
        rows[0]["position_ids"] = list(range(11))
        rows[1]["position_ids"] = [0, 1, 2, 3, 0, 1, 2]
    return collate(rows, pad_id=0, context_length=64, pad_to_context=False)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("size", [2, 3])
def test_slices_put_together_are_the_rows_and_each_position_keeps_its_target(packed: bool, size: int) -> None:
    whole = batch(packed)
    slices = [split_rows(whole, size=size, index=i) for i in range(size)]
    width = whole["input_ids"].shape[1]
    padded = -(-width // size) * size
    ids = torch.cat([s["input_ids"] for s in slices], dim=1)
    assert ids.shape[1] == padded and torch.equal(ids[:, :width], whole["input_ids"])
    assert torch.equal(torch.cat([s["attention_mask"] for s in slices], 1)[:, :width], whole["attention_mask"])
    # Every position's target is the next token's label, across slice boundaries, as the whole row's shift gives.
    targets = torch.cat([s["labels"][:, 1:] for s in slices], dim=1)
    assert torch.equal(targets[:, : width - 1], whole["labels"][:, 1:])
    assert (targets[:, width - 1 :] == IGNORE_INDEX).all()
    positions = torch.cat([s["position_ids"] for s in slices], dim=1)
    assert all(torch.equal(s[POSITIONS], positions) for s in slices)
    if packed:
        assert torch.equal(positions[:, :width], whole["position_ids"])
        # Padding stays one segment after the last sample (starting at 0 where the row was full).
        assert positions[1, 7:].tolist() == list(range(padded - 7))
    else:
        assert torch.equal(positions, torch.arange(padded).expand(2, padded))
    assert slices[0][ROW_LABEL_TOKENS].tolist() == [8, 6]


def test_the_slices_losses_add_up_to_the_rows_loss() -> None:
    """A slice's labels run one past its inputs: its last position's target is the next slice's first label."""
    whole = batch(packed=False)
    logits = torch.randn(*whole["input_ids"].shape, 50, generator=torch.Generator().manual_seed(0))
    labels = whole["labels"].clamp(max=49).masked_fill(whole["labels"] == IGNORE_INDEX, IGNORE_INDEX)
    whole["labels"] = labels
    total = 0.0
    for i in range(2):
        part = split_rows(whole, size=2, index=i)
        n = part["input_ids"].shape[1]
        total += full_loss_sum(logits[:, i * n : (i + 1) * n], part["labels"]).item()
    assert total == pytest.approx(full_loss_sum(logits, labels).item(), rel=1e-6)


@pytest.mark.parametrize(
    ("heads", "kv", "size", "message"),
    [
        (4, 2, 3, "Llama has 4 attention heads, which do not split over 3 ranks"),
        (6, 4, 3, "has 4 key-value heads, which neither split over 3 ranks nor repeat to 3"),
    ],
)
def test_heads_that_cannot_split_are_refused(heads: int, kv: int, size: int, message: str) -> None:
    config = type("LlamaConfig", (), {})()
    config.num_attention_heads, config.num_key_value_heads = heads, kv
    with pytest.raises(UserError, match=message):
        check_heads(config, size)


@pytest.mark.parametrize(("heads", "kv", "size"), [(4, 2, 2), (4, 2, 4), (8, 8, 4), (4, 1, 4)])
def test_heads_that_split_or_repeat_are_accepted(heads: int, kv: int, size: int) -> None:
    check_heads(SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv), size)


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        ({"compile": True}, "--sequence_parallel_size 2 does not combine with --compile"),
        ({"dataset_streaming": True, "max_steps": 2}, "does not combine with --dataset_streaming"),
        ({"objective": "dpo", "precompute_reference": True}, "does not combine with --precompute_reference"),
        ({"sequence_parallel_size": 0}, "--sequence_parallel_size must be >= 1"),
    ],
)
def test_flags_that_do_not_combine_are_refused(flags: dict, needle: str) -> None:
    cfg = build_config({"model": "some/model", "sequence_parallel_size": 2, **flags})
    with pytest.raises(UserError, match=re.escape(needle)):
        cfg.validate()


@pytest.mark.parametrize(
    ("size", "needles"),
    [
        ("2", ["--sequence_parallel_size 2 does not divide the 1 ranks"]),
        ("3", ["--sequence_parallel_size 3", "4 attention heads", "do not split over 3 ranks"]),
    ],
)
def test_cli_refuses_before_the_model_loads(tiny_model: Path, tmp_path: Path, size: str, needles: list[str]) -> None:
    """The heads are checked from config.json, the world size from the launcher: both before any weight is read
    (the weights are not even there) and before the output directory exists."""
    model = without_weights(tiny_model, tmp_path / "no-weights")
    out = tmp_path / "out"
    args = ["--model", str(model), "--dataset", str(DATASET), "--device", "cpu", "--output_dir", str(out)]
    code, errors, output = run_cli([*args, "--sequence_parallel_size", size])
    assert code == 2
    assert_one_line_error(code, errors, output, *needles)
    assert not out.exists()
