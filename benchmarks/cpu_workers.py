"""CPU measurements, each run in a fresh process: `python -m benchmarks.cpu_workers NAME JSON_ARGS`.

A worker imports only what it measures, times only the measured work (not interpreter start or imports), and
writes one JSON file (per rank, for jobs) that the orchestrator reads. Multi-rank workers join the job through
the torchrun variables the orchestrator sets (RANK, WORLD_SIZE, MASTER_ADDR, ...).
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import current_rss_bytes, maxrss_bytes, peak_rss_bytes, write_json


def _dtype(precision: str) -> Any:
    """The peer's dtype for our --precision (bf16 or fp32: parameters, storage and compute alike)."""
    import torch

    return {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]


def _quiet() -> None:
    """bitsandbytes logs an irrelevant optional-kernel miss at import; transformers warns about PEFT's attribute."""
    import logging
    import warnings

    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def load_ours(args: dict[str, Any]) -> None:
    """One rank of our loading path: skeleton on meta, stream the checkpoint, quantize (bnb: each rank half of every
    weight's blocks), shard each decoder layer as it completes (--fsdp_version), then the root. No adapters.

    `split` false (default true) streams without the job's DistEnv, so every rank quantizes every weight alone:
    loading as it was before the ranks shared quantization out (for HQQ, the comparison of `_hqq_split`).

    Reports load wall time, peak RSS and RSS after imports, this rank's resident bytes (its parameter shards, the
    quantization state FSDP1 replicates, buffers) and the whole quantized model's bytes (added up layer by layer
    before sharding, so every rank knows it without holding it).
    """
    _quiet()
    import torch.distributed as dist

    from benchmarks.measure import model_bytes, preimport
    from qlora_fsdp.config.options import FSDPConfig, ModelConfig, QuantConfig
    from qlora_fsdp.model.skeleton import build_skeleton
    from qlora_fsdp.model.streaming import stream_weights
    from qlora_fsdp.parallel.distributed import init_distributed
    from qlora_fsdp.parallel.precision import PRECISIONS
    from qlora_fsdp.parallel.sharding import make_sharder
    from qlora_fsdp.quant import make_backend
    from qlora_fsdp.quant.base import QuantizedLinear

    env = init_distributed(device="cpu")
    preimport(args["model"])
    importlib.import_module(f"qlora_fsdp.quant.{args['quant']}")  # not inside the timed region

    baseline = current_rss_bytes()
    precision = PRECISIONS[args["precision"]]
    dist.barrier()
    start = time.perf_counter()
    sharder = make_sharder(
        FSDPConfig(fsdp_version=args["fsdp_version"], sharding_strategy="full_shard", gradient_checkpointing=False),
        env=env,
        precision=precision,
        ignore=(QuantizedLinear,),
        adapters_own_units=False,
    )
    layout = sharder.layout
    backend = make_backend(
        QuantConfig(quant=args["quant"]),
        storage_dtype=layout.storage_dtype,
        compute_dtype=precision.compute_dtype,
        shard_state=layout.state_sharded,
    )
    skeleton = build_skeleton(ModelConfig(model=args["model"]), backend=backend, param_dtype=precision.param_dtype)
    for param in skeleton.model.parameters():
        param.requires_grad_(False)  # as under LoRA: the base is frozen
    layers_bytes = [0]

    def shard_layer(name: str, layer: Any) -> None:
        layers_bytes[0] += model_bytes(layer)["total"]
        sharder.shard_unit(name, layer, root=skeleton.model)

    shared = env if args.get("split", True) else None
    stream_weights(skeleton, backend=backend, device=env.device, on_unit_ready=shard_layer, env=shared)
    # What is left unsharded: embeddings, norm, head, buffers.
    root_bytes = model_bytes(skeleton.model, exclude=tuple(f"{name}." for name in skeleton.units))["total"]
    sharded = sharder.finish(skeleton.model)
    total_s = time.perf_counter() - start
    params = sharded.local_parameter_bytes()
    held = model_bytes(sharded.module)
    record = {
        "rank": env.rank,
        "world_size": env.world_size,
        "total_s": total_s,
        "peak_rss_bytes": peak_rss_bytes(),
        "ru_maxrss_bytes": maxrss_bytes(),
        "rss_after_imports_bytes": baseline,
        "param_shard_bytes": params,
        "replicated_state_bytes": held["quant_state"],
        "buffer_bytes": held["buffers"],
        "resident_bytes": params + held["quant_state"] + held["buffers"],
        "quantized_model_bytes": layers_bytes[0] + root_bytes,
    }
    write_json(f"{args['result']}.rank{env.rank}.json", record)
    dist.barrier()
    dist.destroy_process_group()


def load_peer(args: dict[str, Any]) -> None:
    """The peer's loading: HF from_pretrained 4-bit onto the CPU in this one process."""
    from benchmarks.measure import model_bytes

    model, record = measured_peer_load(args)
    write_json(args["result"], {**record, "quantized_model_bytes": model_bytes(model)})


def measured_peer_load(args: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """HF from_pretrained 4-bit of args["model"] onto the CPU in this process, and what the loading cost: seconds,
    peak RSS and the RSS the imports alone took."""
    _quiet()
    from benchmarks.measure import preimport
    from benchmarks.peer import load_peer as hf_load

    preimport(args["model"])
    baseline = current_rss_bytes()
    start = time.perf_counter()
    model = hf_load(args["model"], device="cpu", dtype=_dtype(args["precision"]))
    load_s = time.perf_counter() - start
    record = {
        "load_s": load_s,
        "peak_rss_bytes": peak_rss_bytes(),
        "ru_maxrss_bytes": maxrss_bytes(),
        "rss_after_imports_bytes": baseline,
    }
    return model, record


def train_peer(args: dict[str, Any]) -> None:
    """The peer's training throughput: HF 4-bit + PEFT LoRA + AdamW, one process, same rows as our CLI run."""
    _quiet()
    import torch

    from benchmarks.peer import add_lora, dummy_batches, load_peer, train_steps

    model = load_peer(args["model"], device="cpu", dtype=_dtype(args["precision"]))
    model = add_lora(
        model, rank=args["lora_rank"], alpha=args["lora_alpha"], dropout=0.0, checkpointing=args["checkpointing"]
    )
    batches = dummy_batches(
        args["model"], batch_size=args["batch_size"], context_length=args["context_length"], count=args["steps"]
    )
    steps = list(train_steps(model, batches, device=torch.device("cpu")))
    write_json(
        args["result"],
        {
            "steps": [{"tokens": n, "seconds": s, "tokens_per_s": n / s} for n, s in steps],
            "peak_rss_bytes": peak_rss_bytes(),
        },
    )


def quant_quality(args: dict[str, Any]) -> None:
    """Stored bits per parameter and dequantization error of each format, ours against the library called directly.

    Ours: `make_backend` + `load_weight` into the module our loader builds, uint8 storage, bf16 compute (as in
    training). Reference: bitsandbytes' `quantize_4bit` / HQQ's `HQQLinear` with their default integer storage.
    Both quantize the same real weight matrices of the model; error is |dequantized - original fp32|.
    """
    _quiet()
    import torch
    from safetensors import safe_open
    from torch import nn

    from benchmarks.measure import tensor_bytes
    from qlora_fsdp.config.options import QuantConfig
    from qlora_fsdp.model.hub import shard_files
    from qlora_fsdp.quant import make_backend

    layers = {f"model.layers.{i}." for i in args["layers"]}
    weights: dict[str, torch.Tensor] = {}
    for file in shard_files(Path(args["model"])):
        with safe_open(file, framework="pt", device="cpu") as shard:
            for name in shard.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name.endswith("proj.weight") and any(name.startswith(p) for p in layers):
                    weights[name] = shard.get_tensor(name).float()
    cpu = torch.device("cpu")
    results = {}
    for fmt in args["formats"]:
        cfg = QuantConfig(**fmt["config"])
        backend = make_backend(cfg, storage_dtype=torch.uint8, compute_dtype=torch.bfloat16)
        sides: dict[str, dict[str, float]] = {}
        for side in ("ours", "reference"):
            stored = err_sum = 0.0
            err_max = 0.0
            count = 0
            start = time.perf_counter()
            for w in weights.values():
                if side == "ours":
                    module = backend.make_module(nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta"))
                    backend.load_weight(module, w, device=cpu)
                    deq = module.dequantize().float()
                    stored += tensor_bytes(module.packed_bytes())
                    stored += sum(tensor_bytes(t) for t in module.state_bytes().values())
                else:
                    deq, nbytes = _reference_quantize(cfg, w)
                    stored += nbytes
                diff = (deq - w).abs()
                err_sum += float(diff.double().sum())
                err_max = max(err_max, float(diff.max()))
                count += w.numel()
            sides[side] = {
                "bits_per_param": 8 * stored / count,
                "mean_abs_error": err_sum / count,
                "max_abs_error": err_max,
                "seconds": time.perf_counter() - start,
            }
        results[fmt["name"]] = sides
    write_json(
        args["result"],
        {"formats": results, "matrices": len(weights), "params": sum(w.numel() for w in weights.values())},
    )


def _reference_quantize(cfg: Any, w: Any) -> tuple[Any, int]:
    """The library's own path with its default storage: returns (dequantized fp32 weight, stored bytes)."""
    import torch
    from torch import nn

    from benchmarks.measure import quant_state_tensors, tensor_bytes

    if cfg.quant == "bnb":
        import bitsandbytes.functional as bnbf

        # What HF's 4-bit loading does: cast to the compute dtype, quantize in 64-element blocks, uint8 storage.
        packed, state = bnbf.quantize_4bit(
            w.to(torch.bfloat16), blocksize=64, compress_statistics=cfg.bnb_double_quant, quant_type=cfg.bnb_quant_type
        )
        deq = bnbf.dequantize_4bit(packed, state).float()
        states = [t for t in state.as_dict(packed=True).values() if isinstance(t, torch.Tensor)]
        return deq, tensor_bytes(packed) + sum(tensor_bytes(t) for t in states)
    from hqq.core.quantize import BaseQuantizeConfig, HQQLinear

    linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
    linear.weight.data = w.clone()
    module = HQQLinear(
        linear,
        BaseQuantizeConfig(nbits=cfg.hqq_bits, group_size=cfg.hqq_group_size),
        compute_dtype=torch.bfloat16,
        device="cpu",
    )
    deq = module.dequantize().float()
    return deq, tensor_bytes(module.W_q) + sum(tensor_bytes(t) for t in quant_state_tensors(module))


WORKERS: dict[str, Callable[[dict[str, Any]], None]] = {
    "load_ours": load_ours,
    "load_peer": load_peer,
    "train_peer": train_peer,
    "quant_quality": quant_quality,
}

if __name__ == "__main__":
    WORKERS[sys.argv[1]](json.loads(sys.argv[2]))
