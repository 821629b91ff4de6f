"""Worker for test_options: many short trainings in one torchrun job (imports and process group paid once).

python options_worker.py SCENARIOS_JSON OUT_DIR. SCENARIOS_JSON holds {name: {"flags": ..., "measure": bool,
"reference": bool}}, written by test_options.py, which defines each scenario beside the tests that read its result;
the scenarios run in its order, each in OUT_DIR/NAME. Rank 0 writes OUT_DIR/results.json: {scenario: {"losses",
"grad_norms", ..., "error"}}.

For a scenario with "reference", rank 0 computes a reference for its first step: the same first global batch through
the same model built without any sharding, in this one process, with PyTorch's own cross entropy and gradient norm.
A sharded run must match it: that is what catches a wrong gradient normalisation, a broken tie or a misplaced shard,
which a falling loss on memorised rows would not. With "measure", the bytes its forward passes save for backward are
counted (gradient checkpointing and activation offload must show).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from qlora_fsdp.config.options import TrainConfig, build_config
from qlora_fsdp.data.loader import Batching, build_loaders
from qlora_fsdp.model.hub import load_tokenizer
from qlora_fsdp.model.lora import init_adapters, inject_lora, lora_layers, prepare_full_finetune
from qlora_fsdp.model.skeleton import build_skeleton, expanded_layer_prefixes
from qlora_fsdp.model.streaming import stream_weights
from qlora_fsdp.parallel.distributed import DistEnv, init_distributed
from qlora_fsdp.parallel.precision import PRECISIONS as MODES
from qlora_fsdp.parallel.precision import quant_compute_dtype
from qlora_fsdp.quant import make_backend
from qlora_fsdp.train.metrics import read_metrics
from qlora_fsdp.train.trainer import run
from tests.distributed.scenarios import run_scenarios


class SavedBytes:
    """Bytes of tensors the forward pass saves for backward outside any inner saved-tensor hooks: a checkpointed
    layer's activations are saved by the checkpoint's own hooks (or not at all), offloaded ones by save_on_cpu's.
    Saves during backward (a reentrant checkpoint's recompute) are not kept from forward to backward: not counted."""

    def __init__(self) -> None:
        self.total = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if torch._C._current_graph_task_id() == -1:  # not inside a backward pass
            self.total += tensor.numel() * tensor.element_size()
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def first_global_batch(cfg: TrainConfig, world_size: int) -> dict[str, torch.Tensor]:
    """The rows of step 1: what one rank with batch world x batch x accumulation draws first (the data design every
    rank relies on). Padded to the longest of them, not to each rank's own longest: right padding under the
    attention mask changes nothing the loss sees."""
    env = DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo")
    data = dict(vars(cfg.data), batch_size=cfg.data.batch_size * world_size * cfg.optim.gradient_accumulation_steps)
    tokenizer = load_tokenizer(Path(cfg.model.model))
    loader, _ = build_loaders(
        type(cfg.data)(**data), cfg.eval, tokenizer, env, Batching(seed=cfg.run.seed, fixed_shapes=cfg.compute.compile)
    )
    return next(iter(loader))


def unsharded_model(cfg: TrainConfig) -> torch.nn.Module:
    """The model a run trains, with its initial adapters, built in this one process without any sharding."""
    path = Path(cfg.model.model)
    mode = MODES[cfg.fsdp.precision]
    compute = quant_compute_dtype(mode, cfg.quant.compute_dtype)
    backend = make_backend(cfg.quant, storage_dtype=torch.uint8, compute_dtype=compute)
    new_blocks = expanded_layer_prefixes(path) if cfg.lora.train_type == "llama_pro" else ()
    skeleton = build_skeleton(
        cfg.model, backend=backend, param_dtype=mode.param_dtype, full_precision_prefixes=new_blocks
    )
    if cfg.lora.train_type in ("lora", "dora"):
        model = inject_lora(skeleton.model, cfg.lora, dtype=mode.param_dtype)
    else:
        model = prepare_full_finetune(skeleton.model, only_prefixes=new_blocks)
    in_layers = {id(m) for layer in skeleton.units.values() for m in lora_layers(layer)}
    stream_weights(
        skeleton,
        backend=backend,
        device=torch.device("cpu"),
        on_unit_ready=lambda name, layer: init_adapters(lora_layers(layer), seed=cfg.run.seed, name=name),
    )
    init_adapters([m for m in lora_layers(model) if id(m) not in in_layers], seed=cfg.run.seed, name="")
    return model


def reference_first_step(cfg: TrainConfig, world_size: int) -> dict[str, float]:
    """Loss and gradient norm of step 1 computed in this one process, with nothing sharded; the loss is the mean
    over all the step's label tokens."""
    batch = first_global_batch(cfg, world_size)
    model = unsharded_model(cfg)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(), ignore_index=-100)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return {"loss": loss.item(), "grad_norm": torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()}


def main() -> None:
    scenarios, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    env = init_distributed(device="cpu", timeout_s=120)  # a scenario failing on one rank must not hang the rest

    def one(name: str) -> dict:
        scenario, run_dir = scenarios[name], out / name
        cfg = build_config({**scenario["flags"], "output_dir": str(run_dir)}).validate()
        saved = SavedBytes()
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            run(cfg)
        records = read_metrics(run_dir) if env.rank == 0 else []
        result = {
            "losses": [r["loss"] for r in records],
            "grad_norms": [r["grad_norm"] for r in records],
            "lrs": [r["lr"] for r in records],
            "skipped": [r["skipped"] for r in records],
            "label_tokens": [r["label_tokens"] for r in records],
            "tokens": [r["tokens"] for r in records],
            "param_bytes": records[0]["param_bytes_per_rank"] if records else [],
            "trainable_parameters": records[0]["trainable_parameters"] if records else 0,
            "saved_bytes_per_step": saved.total / cfg.optim.max_steps if scenario["measure"] else None,
            "files": sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())
            if env.rank == 0
            else [],
            "output_dir": str(run_dir),
            "compiled_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs,
        }
        if env.rank == 0 and scenario["reference"]:
            result["reference"] = reference_first_step(cfg, env.world_size)
        return result

    run_scenarios(scenarios, one, out, env, failed={"param_bytes": [], "files": []})


if __name__ == "__main__":
    main()
