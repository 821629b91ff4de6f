"""Worker for test_hqq_split: run under torchrun; writes one JSON report per rank.

Each case streams the tiny model into the skeleton with the real loader, the ranks sharing HQQ's weights out, and
then, in this same process, quantizes every checkpoint weight alone with a plain backend: the bytes the layer holds
(packed, scale, zero) and its metadata must be what that one process computes. The backend used for loading
records which weights this rank quantized, so the report also shows how the work was split.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from qlora_fsdp.config.options import ModelConfig
from qlora_fsdp.model.skeleton import build_skeleton
from qlora_fsdp.model.streaming import stream_weights
from qlora_fsdp.parallel.distributed import DistEnv, init_distributed
from qlora_fsdp.quant.base import QuantizedLinear, QuantizedWeight
from qlora_fsdp.quant.hqq import HqqBackend

CASES = {"4bit-bf16": (4, torch.bfloat16), "3bit-fp32": (3, torch.float32)}


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class RecordingHqq(HqqBackend):
    """HQQ's own quantizer, noting a digest of every weight this rank quantized."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.inputs: list[str] = []

    def quantize(self, weight: torch.Tensor, *, env: DistEnv | None = None) -> QuantizedWeight:
        self.inputs.append(digest(weight))
        return super().quantize(weight, env=env)


def check(model_dir: str, *, nbits: int, compute: torch.dtype, env: DistEnv) -> dict:
    settings = {"storage_dtype": torch.uint8, "compute_dtype": compute, "nbits": nbits, "group_size": 64}
    backend = RecordingHqq(**settings)
    skeleton = build_skeleton(ModelConfig(model=model_dir), backend=backend, param_dtype=torch.float32)
    stream_weights(skeleton, backend=backend, device=env.device, env=env)
    checkpoint = {k: v for f in sorted(Path(model_dir).glob("*.safetensors")) for k, v in load_file(f).items()}
    alone = HqqBackend(**settings)
    by_input: dict[str, str] = {}
    mismatches = []
    for name in skeleton.quantized:
        module = skeleton.model.get_submodule(name)
        assert isinstance(module, QuantizedLinear)
        weight = checkpoint[f"{name}.weight"]
        by_input[digest(weight)] = name
        expected = alone.quantize(weight)
        if digest(module.packed_bytes()) != digest(expected.packed):
            mismatches.append(f"{name}: packed")
        state = module.state_tensors()
        for key, value in expected.state.items():
            if key not in state or state[key].dtype != value.dtype or not torch.equal(state[key], value):
                mismatches.append(f"{name}: {key}")
        if module.meta != expected.meta:
            mismatches.append(f"{name}: meta")
    dist.barrier()
    return {
        "checked": len(skeleton.quantized),
        "mismatches": mismatches,
        "quantized_here": sorted(by_input.get(d, d) for d in backend.inputs),
    }


def main() -> None:
    model_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    env = init_distributed(device="cpu")
    reports = {case: check(model_dir, nbits=n, compute=c, env=env) for case, (n, c) in CASES.items()}
    (out_dir / f"rank{env.rank}.json").write_text(json.dumps(reports, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
