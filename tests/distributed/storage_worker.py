"""Worker for test_storage_integrity: run under torchrun; writes one JSON report per rank.

Each case streams the tiny model into shards with the real loader and sharder, under a mixed-precision policy that
casts parameters, and compares what every quantized layer holds in its first forward (and after gathering) with
the bytes loading produced. Its own forward hook takes digests before the package's verify_packed runs, so a
corruption is seen whether or not the package notices it.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import bitsandbytes.functional as bnbf
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from qlora_fsdp.config.options import FSDPConfig, LoraConfig, ModelConfig, QuantConfig
from qlora_fsdp.errors import UserError
from qlora_fsdp.model.lora import init_adapters, inject_lora, lora_layers
from qlora_fsdp.model.skeleton import build_skeleton
from qlora_fsdp.model.streaming import stream_weights
from qlora_fsdp.parallel.distributed import init_distributed
from qlora_fsdp.parallel.precision import PRECISIONS, Precision
from qlora_fsdp.parallel.sharding import PackedWeightsChanged, make_sharder, verify_packed
from qlora_fsdp.quant import make_backend
from qlora_fsdp.quant.base import QuantizedLinear

FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16


def digest(t: torch.Tensor) -> str:
    # A copy: a numpy view would make a parameter's storage unresizable, which FSDP2 needs it to be.
    return hashlib.sha256(t.detach().cpu().clone().view(torch.uint8).numpy().tobytes()).hexdigest()


def snapshot(module: QuantizedLinear) -> dict[str, str]:
    """What the layer computes with: its dequantized weight, its packed bytes and state, and the packed dtype."""
    cast = module.weight.dtype != module.storage_dtype  # a cast that changed the size cannot be decoded at all
    return {
        "weight": "cast" if cast else digest(module.dequantize()),
        "packed": digest(module.packed_bytes()),
        "state": digest(torch.cat([t.flatten() for t in module.state_bytes().values()])),
        "dtype": str(module.weight.dtype),
    }


def checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(Path(model_dir).glob("*.safetensors")) for k, v in load_file(f).items()}


def check(
    model_dir: str,
    *,
    quant: str,
    version: int,
    precision: Precision,
    storage: torch.dtype | None = None,
    packed_layout: str = "auto",
    ignore_quantized: bool = True,
    verify: bool = True,
    env,
) -> dict:
    sharder = make_sharder(
        FSDPConfig(fsdp_version=version, gradient_checkpointing=False, packed_layout=packed_layout),
        env=env,
        precision=precision,
        ignore=(QuantizedLinear,) if ignore_quantized else (),
        adapters_own_units=True,
    )
    layout = sharder.layout
    backend = make_backend(
        QuantConfig(quant=quant),
        storage_dtype=storage or layout.storage_dtype,
        compute_dtype=torch.bfloat16,
        shard_state=storage is None and layout.state_sharded,
    )
    skeleton = build_skeleton(ModelConfig(model=model_dir), backend=backend, param_dtype=precision.param_dtype)
    quantized = {m: n for n, m in skeleton.model.named_modules() if isinstance(m, QuantizedLinear)}
    peft_model = inject_lora(skeleton.model, LoraConfig(lora_rank=8), dtype=precision.param_dtype)
    before: dict[str, dict[str, str]] = {}
    nan_patterns = [0]

    def shard_layer(name: str, layer: torch.nn.Module) -> None:
        init_adapters(lora_layers(layer), seed=0, name=name)
        for module in layer.modules():
            if module in quantized:
                before[quantized[module]] = snapshot(module)
                # Float views of packed bytes hold NaN bit patterns, which a cast or canonicalizing copy rewrites.
                if module.weight.is_floating_point():
                    nan_patterns[0] += int(module.weight.isnan().sum())
        sharder.shard_unit(name, layer, root=skeleton.model)

    stream_weights(skeleton, backend=backend, device=env.device, on_unit_ready=shard_layer, env=env)
    everyone: list = [None] * env.world_size
    dist.all_gather_object(everyone, before)
    at_forward: dict[str, dict[str, str]] = {}
    for module, name in quantized.items():
        module.register_forward_pre_hook(lambda m, _, name=name: at_forward.__setitem__(name, snapshot(m)))
    report = {
        "layers": len(before),
        "identical_across_ranks": all(b == everyone[0] for b in everyone),
        "nan_patterns": nan_patterns[0],
        "state_parameters": all(m.state_as_parameters for m in quantized),
        "layout": layout.describe(),
    }
    if quant == "bnb":
        one_process = {"blocksize": 64, "compress_statistics": True, "quant_type": "nf4"}
        report["bnb_matches_one_process"] = all(
            digest(bnbf.quantize_4bit(w.to(torch.bfloat16), **one_process)[0])
            == before[name.removesuffix(".weight")]["packed"]
            for name, w in checkpoint(model_dir).items()
            if name.removesuffix(".weight") in before
        )
    sharded = sharder.finish(peft_model)
    if verify:
        verify_packed(sharded.module, sharder.reference)
    try:
        with torch.no_grad():
            sharded.module(input_ids=torch.arange(16).view(1, 16) % 100 + 3)
        report["error"] = None
    except PackedWeightsChanged as exc:  # only the package's own verdict; anything else fails the worker
        report["error"] = str(exc)
    report["forward_identical"] = at_forward == before
    report["forward_changed"] = sorted(n for n in at_forward if at_forward[n] != before[n])
    report["forward_dtypes"] = sorted({s["dtype"] for s in at_forward.values()})
    report["storage_dtype"] = str(backend.storage_dtype)
    if report["error"] is None and ignore_quantized:
        gathered = dict(sharded.gather(list(quantized)))
        if env.rank == 0:
            # Whole packed bytes (and, under FSDP2, state) after gathering the shards back.
            report["gathered_identical"] = all(
                digest(gathered[m]["weight"].view(torch.uint8)[: m.packed_nbytes]) == before[n]["packed"]
                for m, n in quantized.items()
            )
            if report["state_parameters"]:
                report["gathered_state_identical"] = all(
                    digest(torch.cat([gathered[m][k].view(torch.uint8) for k in m.layouts])) == before[n]["state"]
                    for m, n in quantized.items()
                )
    dist.barrier()
    return report


def main() -> None:
    model_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    env = init_distributed(device="cpu")
    reports = {}
    mp_bf16 = PRECISIONS["mp_bf16"]
    for quant in ("bnb", "hqq"):
        for version in (2, 1):
            reports[f"v{version}-{quant}-mp_bf16"] = check(
                model_dir, quant=quant, version=version, precision=mp_bf16, env=env
            )
        # FSDP2's float view (the layout of torch < 2.12, forced here on any torch): bf16, the dtype mp_bf16 gathers
        # in, and fp32 and bf16 parameters without a policy.
        for name in ("mp_bf16", "fp32", "bf16"):
            reports[f"v2float-{quant}-{name}"] = check(
                model_dir, quant=quant, version=2, precision=PRECISIONS[name], packed_layout="float", env=env
            )
        # FSDP1 views the packed bytes as the parameter dtype: each, under a policy that casts parameters to another.
        for storage, cast_to in ((BF16, FP32), (FP16, FP32), (FP32, BF16)):
            precision = Precision(storage, None, (cast_to, cast_to, FP32))
            reports[f"v1-{quant}-{storage}"] = check(model_dir, quant=quant, version=1, precision=precision, env=env)
    # Controls: each must be caught by the worker's own digests, and by verify_packed where it runs.
    reports["control-v1-not-ignored"] = check(
        model_dir, quant="bnb", version=1, precision=mp_bf16, ignore_quantized=False, env=env
    )
    # bf16 bytes cast to fp16 keep their size: nothing crashes, the weights are silently wrong.
    same_size = Precision(BF16, None, (FP16, FP16, FP32))
    for verify in (True, False):
        reports[f"control-v1-same-size-cast-verify-{verify}"] = check(
            model_dir, quant="hqq", version=1, precision=same_size, ignore_quantized=False, verify=verify, env=env
        )
    # FSDP2 with a float view instead of uint8: its policy casts it like any floating parameter.
    reports["control-v2-float-storage"] = check(
        model_dir, quant="bnb", version=2, precision=mp_bf16, storage=FP32, env=env
    )
    try:
        check(model_dir, quant="bnb", version=2, precision=mp_bf16, packed_layout="uint8", env=env)
        reports["forced-uint8-error"] = None
    except UserError as exc:  # refused before anything is loaded where this torch's FSDP2 cannot shard uint8
        reports["forced-uint8-error"] = str(exc)
    (out_dir / f"rank{env.rank}.json").write_text(json.dumps(reports, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
