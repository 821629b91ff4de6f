"""--generation_mode gathered on 2 real gloo ranks (FSDP2, a unit per decoder layer and the root): inside
`Fsdp2Model.gathered` a forward runs no collective, so ranks decode different numbers of tokens (rank 0 two, rank 1
six; a sharded forward would wait for the other rank's all-gather until the timeout) and sample what the unsharded
model samples with the same seeds; on leaving, the decoder layers reshard after forward again (a training forward
leaves their parameters sharded, as before)."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from qlora_fsdp.objectives.loss import CausalLMLoss
from qlora_fsdp.objectives.sampling import SamplingParams, sample
from qlora_fsdp.parallel.distributed import DistEnv
from qlora_fsdp.parallel.fsdp2 import Fsdp2Model

pytestmark = pytest.mark.distributed

PROMPTS = ([[5, 9, 33, 71]], [[17], [400, 401, 402], [88, 89, 90, 91, 92]])
"""Each rank's prompts."""
NEW_TOKENS = (2, 6)
"""Each rank's --max_completion_length: unequal, so the ranks run unequal numbers of forwards."""
CPU = torch.device("cpu")


def _sample(root: CausalLMLoss, rank: int, *, lockstep: bool) -> dict[str, list]:
    prompts = PROMPTS[rank]
    params = SamplingParams(max_new_tokens=NEW_TOKENS[rank], end_ids=frozenset({2}), pad_id=0)
    drawn = sample(root, prompts, params=params, device=CPU, seeds=[100 * rank + i for i in range(len(prompts))],
                   lockstep=lockstep)  # fmt: skip
    return {"completions": drawn.completions, "logps": drawn.logps}


def _sharded_layers(root: CausalLMLoss) -> list[bool]:
    """Whether each decoder layer's parameters are its shards (DTensors) rather than the gathered tensors."""
    return [all(isinstance(p, DTensor) for p in layer.parameters()) for layer in root.lm.model.layers]


def _rank(rank: int, init: str, model: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    root = CausalLMLoss(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), chunk_tokens=16)
    alone = _sample(root, rank, lockstep=False)  # before sharding: the whole model on this rank
    for layer in root.lm.model.layers:
        fully_shard(layer, reshard_after_forward=True)
    env = DistEnv(rank, rank, 2, 2, CPU, "gloo")
    sharded = Fsdp2Model(fully_shard(root, reshard_after_forward=False), reshard_after_forward=True, env=env)
    with sharded.gathered():
        inside = _sample(root, rank, lockstep=False)
        held = _sharded_layers(root)
    ids = torch.tensor([[5, 9, 33, 71, 7, 8]])
    root(ids, attention_mask=torch.ones_like(ids), labels=ids)  # a training forward, no backward yet
    record = {"alone": alone, "inside": inside, "held": held, "after": _sharded_layers(root)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def test_gathered_weights_let_ranks_decode_on_their_own(tiny_model: Path, tmp_path: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank, args=(f"file://{tmp_path / 'rendezvous'}", str(tiny_model), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["inside"]["completions"] == record["alone"]["completions"], rank
        assert max(map(len, record["inside"]["completions"])) == NEW_TOKENS[rank]  # no end token drawn early
        for ours, whole in zip(record["inside"]["logps"], record["alone"]["logps"], strict=True):
            assert ours == pytest.approx(whole, abs=1e-5)
        assert not any(record["held"]), "the layers were not gathered inside the context"
        assert all(record["after"]), "a training forward after the context left layers gathered"
