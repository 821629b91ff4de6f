"""Will it fit? Each rank's memory for a training run, planned from config.json before downloading the weights.

python scripts/plan.py --model DIR_OR_HUB_ID --nproc_per_node N [--nnodes M] [--gpu_memory_gib 24]
    [--config FILE.yaml] [any train.py flag: --quant, --lora_rank, --batch_size, --context_length ...]

A hub id fetches its JSON files only. Prints, per rank, the quantized base (packed bytes and quantization state),
the adapters, their gradients and optimizer state, and estimates of the gathered units and activations, against
--gpu_memory_gib; the parameter bytes per rank are exactly what training logs. The logic lives in
qlora_fsdp/tools/plan.py; docs/planning.md says what it counts and assumes.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qlora_fsdp.cli import run_tool  # after the sys.path set-up above
from qlora_fsdp.config.options import TrainConfig
from qlora_fsdp.tools.config import PlanConfig


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv

    def plan(cfg: TrainConfig, options: PlanConfig) -> None:
        from qlora_fsdp.tools.plan import plan_run, render

        command = shlex.join(["python", "scripts/plan.py", *args])
        print(render(plan_run(cfg, options), command=command), flush=True)

    return run_tool(PlanConfig, plan, args)


if __name__ == "__main__":
    sys.exit(main())
