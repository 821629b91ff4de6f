"""Run a script exactly as `python SCRIPT ARGS` would, recording the resident-set peak of each training step.

`python -m benchmarks.step_probe train.py --flags` (or the same under `torchrun -m`) is our real CLI. On a CPU the
CLI's `peak_memory_bytes` is VmHWM, the process's high-water mark since exec, so a step that needs less than
loading did reports loading's peak, and no step's own need shows. The probe therefore resets VmHWM (Linux's
clear_refs "5", see benchmarks.common.reset_peak_rss) just before the first step, noting the RSS at that moment as
the baseline, and again right after each step's reading: step k's figure is the largest RSS during step k alone,
and metrics.jsonl's `peak_memory_bytes` of these runs is that per-step peak too. Two names of the package are
wrapped, never edited: `qlora_fsdp.trainer.train_loop` (the baseline) and `qlora_fsdp.loop.peak_memory_bytes`
(each step's reading). Each rank writes `$BENCH_STEP_RSS_FILE.rankR.json`.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Callable
from typing import Any

from benchmarks.common import current_rss_bytes, peak_rss_bytes, reset_peak_rss, write_json

RESET_SLACK_BYTES = 1 << 20
"""A reset counts as done when VmHWM reads at most this much above the RSS right after it (pages move meanwhile)."""


def _reset() -> tuple[int, bool]:
    """Restart VmHWM from the RSS now; returns (that RSS, whether the kernel restarted it)."""
    reset_peak_rss()
    rss = current_rss_bytes()
    return rss, peak_rss_bytes() <= rss + RESET_SLACK_BYTES


def install(record: dict[str, Any]) -> None:
    """Wrap the trainer's train_loop and the loop's peak_memory_bytes so that they fill `record`."""
    import qlora_fsdp.loop as loop
    import qlora_fsdp.trainer as trainer

    for module, name in ((trainer, "train_loop"), (loop, "peak_memory_bytes")):
        if not callable(getattr(module, name, None)):
            raise RuntimeError(f"benchmarks/step_probe.py: {module.__name__}.{name} is gone; update the probe")
    train_loop: Callable[..., Any] = trainer.train_loop
    peak_memory_bytes: Callable[..., int] = loop.peak_memory_bytes

    def measured_train_loop(*args: Any, **kwargs: Any) -> Any:
        record["baseline_rss_bytes"], record["reset"] = _reset()
        return train_loop(*args, **kwargs)

    def measured_peak(device: Any) -> int:
        peak = peak_memory_bytes(device)
        if getattr(device, "type", "cpu") != "cpu":
            return peak
        rss, ok = _reset()
        record["steps"].append({"peak_rss_bytes": peak, "rss_after_bytes": rss})
        record["reset"] = record["reset"] and ok
        return peak

    trainer.train_loop = measured_train_loop
    loop.peak_memory_bytes = measured_peak


def main() -> None:
    script, args = sys.argv[1], sys.argv[2:]
    rank = os.environ.get("RANK", "0")
    record: dict[str, Any] = {"rank": int(rank), "baseline_rss_bytes": None, "reset": False, "steps": []}
    install(record)
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        out = os.environ.get("BENCH_STEP_RSS_FILE")
        if out:
            write_json(f"{out}.rank{rank}.json", record)


if __name__ == "__main__":
    main()
