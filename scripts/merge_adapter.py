"""Merge a trained adapter into its base model: a plain Hugging Face model directory for serving.

python scripts/merge_adapter.py --model BASE --adapter ADAPTER_DIR --output OUT [--dtype bf16|fp16|fp32]
    [--base_weights original|dequantized] [--overwrite true]

The quantization flags of train.py come from the adapter's qlora_manifest.json (pass them only for an adapter
without one); with --base_weights dequantized the base is checked against its digests before anything is written.

--help lists every flag; the logic lives in qlora_fsdp/tools/export.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qlora_fsdp.cli import run_tool  # after the sys.path set-up above
from qlora_fsdp.config.options import TrainConfig
from qlora_fsdp.tools.config import MergeConfig


def _merge(cfg: TrainConfig, options: MergeConfig) -> None:
    from qlora_fsdp.tools.export import merge_adapter

    written = merge_adapter(cfg.model, cfg.quant, precision=cfg.fsdp.precision, options=options)
    print(written.summary("merged model"), flush=True)


def main(argv: list[str] | None = None) -> int:
    return run_tool(MergeConfig, _merge, argv)


if __name__ == "__main__":
    sys.exit(main())
