"""Try a trained model: a merged directory, an exported quantized base + adapter, or base + adapter.

python scripts/generate.py --model DIR [--adapter DIR] [--quant none|bnb|hqq ...] (--prompt TEXT | --chat)
    (an adapter's qlora_manifest.json supplies --quant and its flags for --model BASE)
    [--max_new_tokens N] [--prompt_style alpaca|guanaco|qna|chat_template|raw] [--do_sample true ...]

Greedy unless --do_sample; prompts framed as train.py frames them (--prompt_style, default alpaca). --help lists
every flag; the logic lives in qlora_fsdp/tools/generate.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qlora_fsdp.cli import run_tool  # after the sys.path set-up above
from qlora_fsdp.config.options import TrainConfig
from qlora_fsdp.tools.config import GenerateConfig


def _generate(cfg: TrainConfig, options: GenerateConfig) -> None:
    from qlora_fsdp.tools.generate import run_generate

    run_generate(cfg, options)


def main(argv: list[str] | None = None) -> int:
    return run_tool(GenerateConfig, _generate, argv)


if __name__ == "__main__":
    sys.exit(main())
