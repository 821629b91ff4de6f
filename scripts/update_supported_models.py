"""Regenerate the supported-models table in docs/supported-models.md from what the test suite trains end to end.

Each row is read from the tables the 2-rank end-to-end tests are parametrized by, so the page lists an
architecture and checkpoint format only where a test trains it through the CLI.

python scripts/update_supported_models.py          # rewrite the table between the markers
python scripts/update_supported_models.py --check  # exit 1 if docs/supported-models.md is out of date
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PAGE = Path(__file__).resolve().parents[1] / "docs" / "supported-models.md"
START, END = "<!-- supported:start -->", "<!-- supported:end -->"
NAMES = {
    "llama": "Llama", "mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE", "qwen3_moe": "Qwen3-MoE", "phimoe": "PhiMoE",
    "deepseek_v2": "DeepSeek-V2", "olmoe": "OLMoE", "deepseek_v3": "DeepSeek-V3", "gpt_oss": "gpt-oss",
    "llama4": "Llama 4 (text)", "qwen2_vl": "Qwen2-VL", "llava": "LLaVA", "qwen3_5_moe": "Qwen3.5-MoE (text)",
    "qwen3_next": "Qwen3-Next", "deepseek_v32": "DeepSeek-V3.2", "deepseek_v4": "DeepSeek-V4",
    "glm4_moe": "GLM-4.5 (GLM-4-MoE)", "glm4_moe_lite": "GLM-4.7-Flash (GLM-4-MoE-Lite)", "glm_moe_dsa": "GLM-5",
    "minimax_m2": "MiniMax-M2", "minimax": "MiniMax-Text-01", "afmoe": "AFMoE", "aria_text": "Aria (text)",
    "cohere2_moe": "Cohere2-MoE", "ernie4_5_moe": "ERNIE-4.5-MoE", "exaone_moe": "EXAONE-MoE", "flex_olmo": "FlexOlmo",
    "gemma4_text": "Gemma 4 (text, MoE block)", "granitemoe": "GraniteMoE", "granitemoe_swa": "GraniteMoE-SWA",
    "granitemoeshared": "GraniteMoE-Shared", "hunyuan_v1_moe": "Hunyuan-MoE", "kimi_linear": "Kimi Linear",
}  # fmt: skip
"""Display names; a family without one is shown by its transformers model type."""
FORMATS = {
    "": "plain safetensors", "fp8": "FP8, block scales", "mxfp4": "MXFP4 experts",
    "fp4": "FP8, E8M0 scales, FP4 experts",
    "bnb": "bitsandbytes NF4, pre-quantized", "hqq": "HQQ qmodel.pt (our export)",
}  # fmt: skip


def trained() -> list[tuple[str, str, str, int, str]]:
    """(family, checkpoint format, --quant, FSDP version, test file) for every end-to-end run of the suite."""
    from tests.distributed import (
        test_moe_e2e,
        test_moe_matrix,
        test_quantized_checkpoints_e2e,
        test_train_e2e,
        test_vlm,
    )

    runs = [("llama", "", quant, version, test_train_e2e) for quant, version in test_train_e2e.RUNS]
    runs += [(family, "", quant, version, test_moe_e2e) for family, quant, version in test_moe_e2e.COMBOS]
    runs += [(family, "", quant, 2, test_moe_matrix) for family, quant, _ in test_moe_matrix.MATRIX.values()]
    runs += [(family, "", quant, version, test_vlm) for family, quant, version in test_vlm.COMBOS]
    for kind, quant, flags in test_quantized_checkpoints_e2e.RUNS.values():
        family, _, fmt = kind.partition("-")
        fmt = {"bnb-4bit": "bnb", "hqq-export": "hqq"}.get(fmt, fmt)
        mode = f" ({flags[-1]})" if "--mxfp4" in flags else ""
        runs.append((family, fmt + mode, quant, 2, test_quantized_checkpoints_e2e))
    root = PAGE.parents[1]
    return [(f, fmt, q, v, Path(module.__file__).relative_to(root).as_posix()) for f, fmt, q, v, module in runs]


def table() -> str:
    rows: dict[tuple[str, str], dict[str, set]] = {}
    for family, fmt, quant, version, test in trained():
        row = rows.setdefault((family, fmt), {"quant": set(), "fsdp": set(), "tests": set()})
        row["quant"].add(quant)
        row["fsdp"].add(f"FSDP{version}")
        row["tests"].add(f"`{test}`")
    lines = ["| architecture | checkpoint | --quant | FSDP | trained by |", "|---|---|---|---|---|"]
    for (family, fmt), row in rows.items():
        base, _, mode = fmt.partition(" ")
        checkpoint = FORMATS[base] + (f" {mode}" if mode else "")
        name = NAMES.get(family, f"`{family}`")
        cells = [name, checkpoint, ", ".join(sorted(row["quant"])), ", ".join(sorted(row["fsdp"])),
                 ", ".join(sorted(row["tests"]))]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def rendered(page: str) -> str:
    """`page` with the text between the markers replaced by the table generated now."""
    head, rest = page.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table()}{END}{tail}"


if __name__ == "__main__":
    current = PAGE.read_text()
    if "--check" in sys.argv[1:]:
        sys.exit(0 if rendered(current) == current else 1)
    PAGE.write_text(rendered(current))
