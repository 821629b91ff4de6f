"""CPU measurements, each in a fresh process that imports and times only what it measures, writing one JSON file (per
rank, for jobs): `python -m benchmarks.cpu_workers NAME JSON_ARGS`."""

from __future__ import annotations

import functools
import importlib
import logging
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.harness import current_rss_bytes, maxrss_bytes, peak_rss_bytes, worker_main, write_json

COMPARE_CHUNK_BYTES = 256 << 20
"""Tensor bytes read from each checkpoint at a time when comparing two."""
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""The peer's dtype for our --precision (parameters, storage and compute alike)."""


def quant_state_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Quantization state outside parameters (bnb's, HQQ's meta, ours under FSDP1, which replicates it)."""
    from qlora_fsdp.quant.base import QuantizedLinear

    if isinstance(module, QuantizedLinear):
        return [] if module.state_as_parameters else list(module.state_bytes().values())
    state = getattr(module, "quant_state", None)
    if state is None:
        state = getattr(module._parameters.get("weight"), "quant_state", None)
    found = (getattr(module, "meta", None) or {}) if state is None else state.as_dict(packed=True)
    return [t for t in found.values() if isinstance(t, torch.Tensor)]  # HQQ's meta holds sizes and flags too


def model_bytes(model: nn.Module, *, exclude: tuple[str, ...] = ()) -> dict[str, int]:
    """Bytes of parameters, buffers and quant state from the tensors themselves (a cast or padding shows)."""
    seen: set[int] = set()
    out = {"params": 0, "buffers": 0, "quant_state": 0}
    for kind, tensors in (("params", model.named_parameters()), ("buffers", model.named_buffers())):
        for name, t in tensors:
            if not (t.is_meta or t.data_ptr() in seen or name.startswith(exclude)):
                seen.add(t.data_ptr())
                out[kind] += t.nbytes
    out["quant_state"] = sum(t.nbytes for name, module in model.named_modules() if not name.startswith(exclude)
                             for t in quant_state_tensors(module) if not t.is_meta)  # fmt: skip
    return {**out, "total": sum(out.values())}


def preimport(model_dir: str | Path) -> None:
    """Import bitsandbytes and the architecture first, so neither side times these imports."""
    import bitsandbytes  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(model_dir))]


def load_ours(args: dict[str, Any]) -> None:
    """One rank of our loading path, no adapters: skeleton on meta, stream, quantize, shard each layer as it is whole,
    then the root. `split` false streams without the job's DistEnv, so every rank quantizes every weight."""
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
    read_before, start = read_bytes(), time.perf_counter()
    fsdp = FSDPConfig(fsdp_version=args["fsdp_version"], sharding_strategy="full_shard", gradient_checkpointing=False)
    sharder = make_sharder(fsdp, env=env, precision=precision, ignore=(QuantizedLinear,), adapters_own_units=False)
    backend = make_backend(QuantConfig(quant=args["quant"]), storage_dtype=sharder.layout.storage_dtype,
                           compute_dtype=precision.compute_dtype, shard_state=sharder.layout.state_sharded)  # fmt: skip
    skeleton = build_skeleton(ModelConfig(model=args["model"]), backend=backend, param_dtype=precision.param_dtype)
    skeleton.model.requires_grad_(False)  # as under LoRA: the base is frozen
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
    params, held = sharded.local_parameter_bytes(), model_bytes(sharded.module)
    write_json(f"{args['result']}.rank{env.rank}.json", {
        "rank": env.rank, "world_size": env.world_size, "total_s": total_s, "peak_rss_bytes": peak_rss_bytes(),
        "ru_maxrss_bytes": maxrss_bytes(), "rss_after_imports_bytes": baseline, "param_shard_bytes": params,
        "replicated_state_bytes": held["quant_state"], "buffer_bytes": held["buffers"],
        "resident_bytes": params + held["quant_state"] + held["buffers"],
        "quantized_model_bytes": layers_bytes[0] + root_bytes, "read_bytes": read_bytes() - read_before,
    })  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def read_bytes() -> int:
    """Bytes read through read(2) and its kin (/proc/self/io rchar), whether the page cache or the disk served them."""
    return int(Path("/proc/self/io").read_text().split("rchar:")[1].split()[0])


def write_formats(args: dict[str, Any]) -> None:
    """The dense fp32 model at `model` as the releases ship it: bf16, pre-quantized bnb NF4 (transformers' own
    4-bit save) and FP8 with 128 x 128 block scales, under `out`."""
    from transformers import AutoModelForCausalLM

    from tests.quantized_checkpoints import bnb_4bit_checkpoint, fp8_checkpoint

    dense, out = Path(args["model"]), Path(args["out"])
    shutil.rmtree(out, ignore_errors=True)  # a launch measured again writes them again
    bf16 = out / "bf16"
    AutoModelForCausalLM.from_pretrained(dense, dtype=torch.bfloat16).save_pretrained(bf16)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (dense / name).is_file():
            shutil.copy(dense / name, bf16 / name)
    bnb_4bit_checkpoint(bf16, out / "bnb-4bit", dtype=torch.bfloat16)
    fp8_checkpoint(bf16, out / "fp8", block=(128, 128))
    write_json(args["result"], {"written": ["bf16", "bnb-4bit", "fp8"]})


def load_peer(args: dict[str, Any]) -> None:
    """The peer's loading: HF from_pretrained 4-bit onto the CPU in this one process."""
    model, record = _peer_load(args)
    write_json(args["result"], {**record, "quantized_model_bytes": model_bytes(model)})


def _peer_load(args: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """HF's 4-bit load onto the CPU in this process: the model, seconds, peak RSS, RSS after imports."""
    from benchmarks.peer import load_peer as hf_load

    preimport(args["model"])
    baseline, start = current_rss_bytes(), time.perf_counter()
    model = hf_load(args["model"], device="cpu", dtype=DTYPES[args["precision"]])
    return model, {"load_s": time.perf_counter() - start, "peak_rss_bytes": peak_rss_bytes(),
                   "ru_maxrss_bytes": maxrss_bytes(), "rss_after_imports_bytes": baseline}  # fmt: skip


def train_peer(args: dict[str, Any]) -> None:
    """The peer's training throughput: HF 4-bit + PEFT LoRA + AdamW, one process, same rows as our CLI run."""
    from benchmarks.peer import add_lora, dummy_batches, load_peer, train_steps

    model = add_lora(load_peer(args["model"], device="cpu", dtype=DTYPES[args["precision"]]), rank=args["lora_rank"],
                     alpha=args["lora_alpha"], dropout=0.0, checkpointing=args["checkpointing"])  # fmt: skip
    batches = dummy_batches(args["model"], batch_size=args["batch_size"], context_length=args["context_length"],
                            count=args["steps"])  # fmt: skip
    steps = list(train_steps(model, batches, device=torch.device("cpu")))
    write_json(args["result"], {"steps": [{"tokens": n, "seconds": s, "tokens_per_s": n / s} for n, s in steps],
                                "peak_rss_bytes": peak_rss_bytes()})  # fmt: skip


def quant_quality(args: dict[str, Any]) -> None:
    """Stored bits per parameter and |dequantized - fp32| of each format on the model's real weights: our backend (uint8
    storage, bf16 compute, as in training) against the library called directly (bnb's quantize_4bit, HQQLinear)."""
    from safetensors import safe_open

    from qlora_fsdp.config.options import QuantConfig
    from qlora_fsdp.model.hub import shard_files
    from qlora_fsdp.quant import make_backend

    layers = tuple(f"model.layers.{i}." for i in args["layers"])
    weights: list[torch.Tensor] = []
    for file in shard_files(Path(args["model"])):
        with safe_open(file, framework="pt", device="cpu") as shard:
            weights += [shard.get_tensor(name).float() for name in shard.keys()  # noqa: SIM118 - not a mapping
                        if name.endswith("proj.weight") and name.startswith(layers)]  # fmt: skip
    results = {}
    for fmt in args["formats"]:
        cfg = QuantConfig(**fmt["config"])
        backend = make_backend(cfg, storage_dtype=torch.uint8, compute_dtype=torch.bfloat16)
        ours, reference = functools.partial(_our_quantize, backend), functools.partial(_reference_quantize, cfg)
        results[fmt["name"]] = {"ours": _errors(weights, ours), "reference": _errors(weights, reference)}
    write_json(args["result"], {"formats": results, "matrices": len(weights),
                                "params": sum(w.numel() for w in weights)})  # fmt: skip


def _errors(weights: list[torch.Tensor], quantize: Callable[[torch.Tensor], tuple[Any, int]]) -> dict[str, float]:
    """Stored bits per parameter and the mean and max absolute error of `quantize` over `weights`."""
    stored = err_sum = err_max = 0.0
    for w in weights:
        deq, nbytes = quantize(w)
        diff = (deq - w).abs()
        stored += nbytes
        err_sum += float(diff.double().sum())
        err_max = max(err_max, float(diff.max()))
    count = sum(w.numel() for w in weights)
    return {"bits_per_param": 8 * stored / count, "mean_abs_error": err_sum / count, "max_abs_error": err_max}


def _our_quantize(backend: Any, w: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Our backend's path into the module our loader builds: (dequantized fp32 weight, stored bytes)."""
    module = backend.make_module(nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta"))
    backend.load_weight(module, w, device=torch.device("cpu"))
    stored = module.packed_bytes().nbytes + sum(t.nbytes for t in module.state_bytes().values())
    return module.dequantize().float(), stored


def _reference_quantize(cfg: Any, w: Any) -> tuple[Any, int]:
    """The library's own path with its default storage: returns (dequantized fp32 weight, stored bytes)."""
    if cfg.quant == "bnb":
        import bitsandbytes.functional as bnbf

        # What HF's 4-bit loading does: cast to the compute dtype, quantize in 64-element blocks, uint8 storage.
        packed, state = bnbf.quantize_4bit(w.to(torch.bfloat16), blocksize=64, quant_type=cfg.bnb_quant_type,
                                           compress_statistics=cfg.bnb_double_quant)  # fmt: skip
        stored = packed.nbytes + sum(t.nbytes for t in state.as_dict(packed=True).values())  # packed: all tensors
        return bnbf.dequantize_4bit(packed, state).float(), stored
    from hqq.core.quantize import BaseQuantizeConfig, HQQLinear

    linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
    linear.weight.data = w.clone()
    module = HQQLinear(linear, BaseQuantizeConfig(nbits=cfg.hqq_bits, group_size=cfg.hqq_group_size),
                       compute_dtype=torch.bfloat16, device="cpu")  # fmt: skip
    return module.dequantize().float(), module.W_q.nbytes + sum(t.nbytes for t in quant_state_tensors(module))


def moe_peer(args: dict[str, Any]) -> None:
    """HF's 4-bit load of an MoE: its bytes, the fused experts it leaves 16-bit (bitsandbytes#1849)."""
    model, record = _peer_load(args)
    import bitsandbytes as bnb

    fused = [p for p in model.parameters() if p.dim() == 3]
    linear4bit = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    write_json(args["result"], {
        **record, "model_bytes": model_bytes(model), "fused_expert_tensors": len(fused),
        "fused_expert_bytes": sum(p.nbytes for p in fused),
        "fused_expert_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in fused}),
        "linear4bit_layers": len(linear4bit), "linear4bit_weight_bytes": sum(m.weight.nbytes for m in linear4bit),
    })  # fmt: skip


def build_moe(args: dict[str, Any]) -> None:
    """tests/moe_models.py's Mixtral in bf16, renamed into place so a broken build never looks finished."""
    from tests.moe_models import build_moe_model

    out = Path(args["out"])
    tmp = out.with_name(f"{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    build_moe_model("mixtral", tmp, tokenizer_from=Path(args["tokenizer_from"]), seed=args["seed"], dtype="bfloat16",
                    **args["sizes"])  # fmt: skip
    tmp.replace(out)


def compare(args: dict[str, Any]) -> None:
    """Whether two DCP directories hold the same tensors bit for bit; read in chunks of COMPARE_CHUNK_BYTES."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    layouts = []
    for path in (args["a"], args["b"]):
        items = dcp.FileSystemReader(path).read_metadata().state_dict_metadata.items()
        layouts.append({k: (v.size, v.properties.dtype) for k, v in items if isinstance(v, TensorStorageMetadata)})
    layout, same_layout = layouts[0], layouts[0] == layouts[1]
    size = {k: shape.numel() * dtype.itemsize for k, (shape, dtype) in layout.items()}
    chunks: list[list[str]] = [[]]
    for key in sorted(layout) if same_layout else []:
        if chunks[-1] and sum(size[k] for k in chunks[-1]) + size[key] > COMPARE_CHUNK_BYTES:
            chunks.append([])
        chunks[-1].append(key)
    differing, max_diff = [], 0.0
    for chunk in filter(None, chunks):
        x, y = ({k: torch.empty(layout[k][0], dtype=layout[k][1]) for k in chunk} for _ in range(2))
        dcp.load(x, checkpoint_id=args["a"], no_dist=True)
        dcp.load(y, checkpoint_id=args["b"], no_dist=True)
        for k in chunk:
            if not torch.equal(x[k], y[k]):
                differing.append(k)
                max_diff = max(max_diff, (x[k].double() - y[k].double()).abs().max().item())
    write_json(args["result"], {
        "tensors": len(layout), "tensor_bytes": sum(size.values()), "same_layout": same_layout, "differing": differing,
        "max_abs_diff": max_diff, "identical": same_layout and not differing,
    })  # fmt: skip


if __name__ == "__main__":
    # Every worker: bitsandbytes logs an irrelevant optional-kernel miss at import; transformers warns about PEFT's
    # attribute; torch (compare) that torch.distributed is disabled.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    worker_main((load_ours, write_formats, load_peer, train_peer, quant_quality, moe_peer, build_moe, compare))
