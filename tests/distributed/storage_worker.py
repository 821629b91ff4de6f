"""Worker for test_storage_integrity: run under torchrun; writes one JSON report per rank.

For each backend x storage dtype it loads the tiny model with low-memory loading, wraps it with FSDP under a
MixedPrecision policy whose parameter dtype differs from the storage dtype (so a cast would corrupt the packed
bytes), and compares what each quantized module holds at forward time and after unsharding with rank 0's
pre-wrap values.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from qlora_fsdp.config import FSDPConfig, LoraConfig, ModelConfig, QuantConfig
from qlora_fsdp.distributed import init_distributed
from qlora_fsdp.fsdp import Precision, wrap_model
from qlora_fsdp.lora import inject_lora
from qlora_fsdp.model import load_model
from qlora_fsdp.quant import make_backend

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


def check(model_dir: str, quant: str, storage: str, *, ignore_quantized: bool, env) -> dict:
    storage_dtype = DTYPES[storage]
    cast_to = torch.bfloat16 if storage_dtype == torch.float32 else torch.float32
    precision = Precision(storage_dtype, None, (cast_to, cast_to, torch.float32))
    backend = make_backend(QuantConfig(quant=quant), storage_dtype=storage_dtype, compute_dtype=torch.bfloat16)
    loaded = load_model(ModelConfig(model=model_dir), backend=backend, env=env, param_dtype=storage_dtype)
    quantized = {n: m for n, m in loaded.model.named_modules() if backend.is_quantized(m)}

    # Only rank 0 holds real packed tensors before wrapping (low-memory loading); the others get its digests.
    before = None
    if env.rank == 0:
        before = {n: (digest(backend.dequantize(m)), str(backend.packed(m).dtype)) for n, m in quantized.items()}
    box = [before]
    dist.broadcast_object_list(box, src=0)
    before = box[0]
    states = {n: {k: digest(v) for k, v in backend.quant_state_tensors(m).items()} for n, m in quantized.items()}
    all_states = [None] * env.world_size
    dist.all_gather_object(all_states, states)

    torch.manual_seed(0)
    model = inject_lora(
        loaded.model, LoraConfig(lora_rank=8), dtype=storage_dtype, quantized_classes=backend.module_classes
    )
    at_forward: dict[str, tuple[str, str]] = {}
    for name, module in quantized.items():
        module.register_forward_pre_hook(
            lambda m, _, name=name: at_forward.__setitem__(
                name, (digest(backend.dequantize(m)), str(backend.packed(m).dtype))
            )
        )
    report = {"quant_state_identical": all(s == all_states[0] for s in all_states)}
    try:
        wrapped = wrap_model(
            model,
            FSDPConfig(gradient_checkpointing=False),
            env=env,
            precision=precision,
            layer_classes=loaded.layer_classes,
            ignore=backend.module_classes if ignore_quantized else (),
            adapters_own_units=True,
            sync_from_rank0=True,
        )
        # Mixed-dtype layers need autocast, as in the autocast --precision modes.
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            wrapped(input_ids=torch.arange(16).view(1, 16) % 100 + 3)
        with FSDP.summon_full_params(wrapped):
            unsharded = {n: (digest(backend.dequantize(m)), str(backend.packed(m).dtype)) for n, m in quantized.items()}
        report.update(
            modules=len(before),
            forward_identical=at_forward == before,
            unsharded_identical=unsharded == before,
            dtypes=sorted({d for _, d in [*at_forward.values(), *unsharded.values()]}),
            error=None,
        )
    except Exception as exc:  # the control run may fail in any way; that is the point
        report.update(forward_identical=False, unsharded_identical=False, error=f"{type(exc).__name__}: {exc}"[:300])
    dist.barrier()
    return report


def main() -> None:
    model_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    env = init_distributed(device="cpu")
    reports = {}
    for quant in ("bnb", "hqq"):
        for storage in DTYPES:
            reports[f"{quant}-{storage}"] = check(model_dir, quant, storage, ignore_quantized=True, env=env)
    # Control: without the MixedPrecision exclusion FSDP casts the packed bytes, and the check must notice.
    reports["control-bnb-fp32-not-ignored"] = check(model_dir, "bnb", "fp32", ignore_quantized=False, env=env)
    (out_dir / f"rank{env.rank}.json").write_text(json.dumps(reports, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
