"""Worker: stream MODEL into every rank with HQQ's split loading (as training does) and compare every parameter and
the logits with one process loading it alone; writes OUT/rank{R}.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from qlora_fsdp.config.options import ModelConfig, QuantConfig
from qlora_fsdp.model.skeleton import build_skeleton
from qlora_fsdp.model.streaming import load_model, stream_weights
from qlora_fsdp.parallel.distributed import init_distributed
from qlora_fsdp.quant import make_backend
from qlora_fsdp.quant.base import QuantizedLinear


def main(model: str, out: str) -> None:
    env = init_distributed(device="cpu", timeout_s=300)
    backend = make_backend(QuantConfig(quant="hqq"), storage_dtype=torch.uint8, compute_dtype=torch.float32)
    skeleton = build_skeleton(ModelConfig(model=model), backend=backend, param_dtype=torch.float32)
    stream_weights(skeleton, backend=backend, device=env.device, env=env)
    alone = load_model(ModelConfig(model=model), backend=backend, device=env.device, param_dtype=torch.float32)
    theirs = dict(alone.model.named_parameters())
    mismatches = [n for n, p in skeleton.model.named_parameters() if not torch.equal(p, theirs[n])]
    modules = dict(alone.model.named_modules())
    for name, module in skeleton.model.named_modules():
        if isinstance(module, QuantizedLinear) and not torch.equal(module.dequantize(), modules[name].dequantize()):
            mismatches.append(f"{name} (dequantized)")
    ids = torch.randint(0, skeleton.model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (skeleton.model(input_ids=ids).logits - alone.model(input_ids=ids).logits).abs().max().item()
    biases = sum(1 for n, _ in skeleton.model.named_parameters() if n.endswith(".bias"))
    report = {"mismatches": mismatches, "logit_gap": gap, "biases": biases}
    Path(out, f"rank{env.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:3])
