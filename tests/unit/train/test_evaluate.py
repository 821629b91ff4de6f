"""qlora_fsdp.train.evaluate on one gloo rank: token weighting, dropout off, the model's mode restored, no gradients.

Agreement across ranks is tested on real 2-rank jobs (tests/distributed/test_packing_eval.py).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from qlora_fsdp.data import IGNORE_INDEX
from qlora_fsdp.data.loader import EvalShard
from qlora_fsdp.data.rows import collate
from qlora_fsdp.objectives.base import Objective
from qlora_fsdp.parallel.distributed import DistEnv
from qlora_fsdp.train.evaluate import evaluate

VOCAB = 11


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.embed(input_ids)))


def loss_sum(model: Toy, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["input_ids"])
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def rows(labelled: list[int], length: int = 9) -> list[dict[str, list[int]]]:
    """Rows as the data path stores them (unpadded lists) with the given numbers of label tokens (the rest -100)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for n in labelled:
        ids = torch.randint(0, VOCAB, (length,), generator=gen).tolist()
        out.append({"input_ids": ids, "labels": [IGNORE_INDEX] * (length - n) + ids[length - n :]})
    return out


class ToyObjective(Objective):
    """SFT's weight (label tokens) around the toy model's summed loss."""

    def weights(self, batch: dict[str, torch.Tensor]) -> tuple[int, ...]:
        return (int((batch["labels"][:, 1:] != IGNORE_INDEX).sum()),)

    def loss_sum(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return loss_sum(model, batch).reshape(1), torch.zeros(0, dtype=torch.float64)


def loader(items, batch_size: int = 2) -> torch.utils.data.DataLoader:
    """Batches padded as the training loaders pad them."""
    pad = functools.partial(collate, pad_id=0, context_length=16, pad_to_context=False)
    return torch.utils.data.DataLoader(items, batch_size, collate_fn=pad)


def test_loss_is_token_weighted_with_dropout_off_and_the_mode_restored(group: None) -> None:
    model = Toy()
    items = rows([8, 1, 1, 2, 8])  # batches of very different label counts: a mean of batch means would differ
    shard = EvalShard(items, DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo"), 2)
    assert len(shard) == 6 and set(shard[5]["labels"]) == {IGNORE_INDEX}  # filled to whole batches, with a blank row
    batches = loader(shard)

    model.train()
    result = evaluate(model, batches, objective=ToyObjective(), device=torch.device("cpu"))

    assert model.training, "evaluate must hand the model back in training mode"
    assert all(p.grad is None for p in model.parameters())
    model.eval()
    tensors = [{k: torch.tensor(v) for k, v in r.items()} for r in items]
    with torch.no_grad():
        per_token = [
            F.cross_entropy(model(r["input_ids"][None])[0, :-1], r["labels"][1:], reduction="none") for r in tensors
        ]
    expected = torch.cat([t[r["labels"][1:] != IGNORE_INDEX] for t, r in zip(per_token, tensors, strict=True)])
    assert result.tokens == expected.numel() == 20
    assert result.loss == pytest.approx(expected.double().mean().item(), rel=1e-6)
    assert result.perplexity == pytest.approx(torch.exp(expected.double().mean()).item(), rel=1e-6)
    batch_means = [loss_sum(model, b).item() / int((b["labels"][:, 1:] != -100).sum()) for b in batches]
    assert abs(sum(batch_means) / len(batch_means) - result.loss) > 1e-3, "the data should tell the two means apart"


def test_blank_rows_add_nothing(group: None, tmp_path: Path) -> None:
    model = Toy()
    items = rows([3, 5, 2])
    blank = {**items[0], "labels": [IGNORE_INDEX] * len(items[0]["labels"])}
    results = [
        evaluate(model, loader(data), objective=ToyObjective(), device=torch.device("cpu"))
        for data in (items, [*items, blank, blank, blank])
    ]
    assert results[0] == results[1]
