"""The reference's log-probs: the model's with its adapters off, in each step, or computed once before training
(--precompute_reference) and looked up.

Every training pair's chosen and rejected reply log-probs under the reference (the model with its adapters off)
are computed with each rank taking every world_size-th pair, summed over ranks into one table indexed by the
pair's row in the tokenized cache, and written to --output_dir. A resumed run reads the table back instead of
computing it again: resuming requires the data, model and quantization flags the table was made with.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from qlora_fsdp.objectives.base import Forward
from qlora_fsdp.objectives.loss import PER_ROW, LossRequest
from qlora_fsdp.parallel.distributed import DistEnv

REFERENCE_FILE = "reference_logps.safetensors"
ReferenceLookup = Callable[[torch.Tensor], torch.Tensor]
"""Row indices -> their precomputed reference log-probs [rows, 2] (a pair's chosen and rejected sides; a KTO row's
completion and KL sequence)."""


def reference_logps(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    forward: Forward,
    table: ReferenceLookup | None = None,
    request: LossRequest = PER_ROW,
) -> torch.Tensor:
    """The reference's summed reply log-probs of a batch's 2B sequences (first sides first; or what `request` asks
    for, with the adapters off whatever it says): looked up in the precomputed `table`, or the model's with its
    adapters off, in eval mode (the reference has no dropout: the base model's own, where its config has some)."""
    if table is not None:
        return table(batch["pair_index"]).T.reshape(-1).to(forward.device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return -forward(model, batch, replace(request, adapters=False))
    finally:
        model.train(was_training)


def reference_table(
    model: nn.Module,
    rows: Dataset,
    *,
    forward: Forward,
    env: DistEnv,
    make_loader: Callable[[Dataset], DataLoader],
    path: Path,
    reuse: bool,
) -> tuple[torch.Tensor, bool]:
    """([cache rows, 2] float64 reference log-probs (chosen, rejected), whether read back from `path`)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    size = len(rows.pairs)  # type: ignore[attr-defined]
    fingerprint = _fingerprint(rows)
    if reuse and path.is_file():
        with safe_open(str(path), "pt") as stored:
            same = (stored.metadata() or {}).get("pairs") == fingerprint
        if same:
            return load_file(str(path))["logps"], True
    from qlora_fsdp.data.loader import EvalShard

    table = torch.zeros(size, 2, dtype=torch.float64, device=env.device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in make_loader(EvalShard(rows, env, 1)):
                logps = -forward(model, batch, replace(PER_ROW, adapters=False)).double()
                # A shard's padding pair has no labels: its log-probs are 0 and add nothing.
                table.index_add_(0, batch["pair_index"].to(env.device), torch.stack(logps.chunk(2), dim=1))
    finally:
        model.train(was_training)
    dist.all_reduce(table)
    table = table.cpu()
    if env.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".tmp")
        save_file({"logps": table}, str(partial), metadata={"pairs": fingerprint})
        os.replace(partial, path)  # whole or absent: a run killed while writing leaves the previous file
    return table, False


def _fingerprint(rows: Dataset) -> str:
    """Which pairs the table is for: the cache's size and the training pairs' rows and lengths (another dataset,
    tokenizer or context gives others; the flags that decide them must match to resume at all)."""
    digest = hashlib.sha256(str(len(rows.pairs)).encode())  # type: ignore[attr-defined]
    for values in (rows.indices, rows.lengths):  # type: ignore[attr-defined]
        digest.update(np.ascontiguousarray(values, dtype=np.int64).tobytes())
    return digest.hexdigest()
