"""Export the base model quantized exactly as training quantized it, in the quantization library's own format.

python scripts/export_quantized.py --model BASE --adapter ADAPTER_DIR --output OUT [--overwrite true]
python scripts/export_quantized.py --model BASE --quant bnb|hqq [the other quantization flags of train.py] --output OUT

--adapter (the training run's adapter or checkpoint directory) takes the flags from its qlora_manifest.json and
checks every layer against the digests training recorded before anything is written; without it, the flags as given.

bnb: a directory `AutoModelForCausalLM.from_pretrained` loads in 4 bits without quantizing again; hqq: HQQ's
qmodel.pt + config.json, which `AutoHQQHFModel.from_quantized` loads. Pass the trained adapter on top with PEFT or
scripts/generate.py. --help lists every flag; the logic lives in qlora_fsdp/tools/export.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qlora_fsdp.cli import run_tool  # after the sys.path set-up above
from qlora_fsdp.config.options import TrainConfig
from qlora_fsdp.tools.config import ExportConfig


def _export(cfg: TrainConfig, options: ExportConfig) -> None:
    from qlora_fsdp.tools.export import export_quantized

    written = export_quantized(cfg.model, cfg.quant, precision=cfg.fsdp.precision, options=options)
    print(written.summary(f"{cfg.quant.quant} model"), flush=True)


def main(argv: list[str] | None = None) -> int:
    return run_tool(ExportConfig, _export, argv)


if __name__ == "__main__":
    sys.exit(main())
