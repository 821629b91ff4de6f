"""Reference log-probs computed once, before training (--precompute_reference), instead of in every step.

Every training pair's chosen and rejected reply log-probs under the reference (the model with its adapters off)
are computed with each rank taking every world_size-th pair, summed over ranks into one table indexed by the
pair's row in the tokenized cache, and written to --output_dir. A resumed run reads the table back instead of
computing it again: resuming requires the data, model and quantization flags the table was made with.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from qlora_fsdp.distributed import DistEnv
from qlora_fsdp.objectives.base import Forward

REFERENCE_FILE = "reference_logps.safetensors"


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
    from safetensors.torch import load_file, save_file

    size = len(rows.pairs)  # type: ignore[attr-defined]
    if reuse and path.is_file():
        table = load_file(str(path))["logps"]
        if table.shape == (size, 2):
            return table, True
    from qlora_fsdp.data.loader import EvalShard

    table = torch.zeros(size, 2, dtype=torch.float64, device=env.device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in make_loader(EvalShard(rows, env, 1)):
                logps = -forward(model, batch, per_row=True, adapters=False).double()
                # A shard's padding pair has no labels: its log-probs are 0 and add nothing.
                table.index_add_(0, batch["pair_index"].to(env.device), torch.stack(logps.chunk(2), dim=1))
    finally:
        model.train(was_training)
    dist.all_reduce(table)
    table = table.cpu()
    if env.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({"logps": table}, str(path))
    return table, False
