"""The checkpoint-formats suite (--suite cpu-formats): loading the same model from the files people download, on 2
ranks with --quant bnb (FSDP2): a pre-quantized bitsandbytes NF4 checkpoint, kept as it is, and an FP8 one (128 x 128
block scales), dequantized and quantized, each against the bf16 release. Same model, same result (the resident
bytes per rank are a check); what differs is what each rank reads, its peak and the time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import FULL_MODEL, QUICK_MODEL, Settings, alternating, figure_rows, session

FORMATS = ("bf16", "bnb-4bit", "fp8")
"""The checkpoints write_formats makes; bf16 is the `peer` column of both sections."""
FIGURES = (
    ("checkpoint_bytes", "checkpoint bytes on disk", "bytes", "lower"),
    ("read_bytes", "bytes a rank reads (read(2), largest rank)", "bytes", "lower"),
    ("peak_rss_bytes", "peak RSS per rank (largest rank)", "bytes", "lower"),
    ("load_wall_s", "wall time to load + quantize + shard (slowest rank)", "s", "lower"),
    ("resident_bytes", "resident bytes per rank after sharding (the same model: a check)", "bytes", "lower"),
)


@dataclass
class FormatsPlan(Settings):
    model: dict[str, int]
    reps: int
    nproc: int = 2


def plan(*, quick: bool, **launch: Any) -> FormatsPlan:
    """The full suite (the CPU suite's 171M model, 3 repetitions) or the quick one (its quick model, once)."""
    p = FormatsPlan(dict(QUICK_MODEL if quick else FULL_MODEL), reps=1 if quick else 3, quick=quick)
    return p.configure(**launch)


def summary(ranks: list[dict[str, Any]], checkpoint: Path) -> dict[str, float]:
    """One load's FIGURES: the files' size, then the largest rank's figure."""
    return {"checkpoint_bytes": float(sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))),
            "read_bytes": float(max(r["read_bytes"] for r in ranks)),
            "peak_rss_bytes": float(max(r["peak_rss_bytes"] for r in ranks)),
            "load_wall_s": max(r["total_s"] for r in ranks),
            "resident_bytes": float(max(r["resident_bytes"] for r in ranks))}  # fmt: skip


def check_same_model(sums: dict[str, list[dict[str, float]]]) -> None:
    """Every format loads into the same resident bytes: the comparison is of one model, not of three."""
    held = {fmt: {s["resident_bytes"] for s in runs} for fmt, runs in sums.items()}
    if len({b for v in held.values() for b in v}) != 1:
        raise RuntimeError(f"the formats loaded into different resident bytes per rank: {held}")


def run(p: FormatsPlan, *, cache: Path, model: Path | None = None) -> dict[str, Any]:
    """Every run of the formats suite; returns results.json's content."""
    with session(p, "formats") as runner:
        dense = model or runner.model(p.model, cache)
        files = runner.work / "checkpoints"
        runner.worker("writing the bf16, pre-quantized bnb and FP8 checkpoints", "write_formats",
                      {"model": str(dense), "out": str(files)})  # fmt: skip
        print(f"{p.reps} x {len(FORMATS)} loads on {p.nproc} ranks")

        def load(fmt: str, rep: int) -> list[dict[str, Any]]:
            args = {"model": str(files / fmt), "fsdp_version": 2, "quant": "bnb", "precision": p.precision}
            return runner.worker(f"load {fmt} (rep {rep + 1})", "load_ours", args, nproc=p.nproc)

        runs = alternating(p.reps, FORMATS, load)
        sums = {fmt: [summary(r, files / fmt) for r in runs[fmt]] for fmt in FORMATS}
        check_same_model(sums)
        note = f"{p.nproc} ranks, --quant bnb (NF4), FSDP2, {p.precision}; {p.reps} repetition(s), medians"
        rows = []
        for fmt, section in (("bnb-4bit", "pre-quantized bnb 4-bit"), ("fp8", "FP8")):
            rows += figure_rows(section, FIGURES, sums[fmt], sums["bf16"], suffix=f"_{fmt.replace('-', '_')}",
                                note=note, ours_label=f"{fmt} checkpoint", peer_label="bf16 checkpoint")  # fmt: skip
        return runner.results("cpu-formats", rows, {"summaries": sums}, {
            "loading": "benchmarks.cpu_workers load_ours: skeleton on meta, stream, quantize (or keep the file's 4-bit "
                       "bytes), shard each layer as it is whole (FSDP2 full_shard), no adapters",
            "checkpoints": "the random Llama saved in bf16 by transformers; pre-quantized by transformers' 4-bit load "
                           "and save_pretrained (NF4, double quantization, bf16 elsewhere); FP8 e4m3 by "
                           "transformers' Fp8Quantize with 128 x 128 blocks (bf16 elsewhere)",
        }, model=harness.model_record(dense, p.model))  # fmt: skip
