"""Run a script as `python SCRIPT ARGS` would (`python -m benchmarks.probe train.py --flags`, or under `torchrun -m`),
recording memory the CLI's own figures cannot give (its peak_memory_bytes is ru_maxrss, which counts the launcher's).

- `$BENCH_PEAK_RSS_FILE`: each rank writes its VmHWM at exit to `FILE.rankR`.
- `$BENCH_STEP_RSS_FILE`: each rank writes `FILE.rankR`, JSON, the RSS of every step alone: VmHWM is reset before step
  1 and after each step's reading, by wrapping the trainer's train_loop and the loop's peak_memory_bytes. COLLECTIVES
  wait until gloo's thread lets their tensors go, so the profiler (`--profile true`) sees the free where it happens.
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness import current_rss_bytes, peak_rss_bytes, reset_peak_rss

RESET_SLACK_BYTES = 1 << 20
"""A reset counts as done when VmHWM reads at most this much above the RSS right after it (pages move meanwhile)."""
COLLECTIVES = ("all_to_all_single", "all_reduce", "all_gather")
"""The calls of qlora_fsdp/parallel/sequence_parallel.py whose buffers gloo may free on its own thread."""
RELEASE_WAIT_S = 1.0
"""Give up waiting for gloo to let a tensor go after this long (a holder that never lets go is not gloo's)."""


def _reset() -> tuple[int, bool]:
    """Restart VmHWM from the RSS now; returns (that RSS, whether the kernel restarted it)."""
    reset_peak_rss()
    rss = current_rss_bytes()
    return rss, peak_rss_bytes() <= rss + RESET_SLACK_BYTES


def install(record: dict[str, Any]) -> None:
    """Wrap the trainer's train_loop and the loop's peak_memory_bytes so that they fill `record`."""
    import qlora_fsdp.train.loop as loop
    import qlora_fsdp.train.trainer as trainer

    for module, name in ((trainer, "train_loop"), (loop, "peak_memory_bytes")):
        if not callable(getattr(module, name, None)):
            raise RuntimeError(f"benchmarks/probe.py: {module.__name__}.{name} is gone; update the probe")
    train_loop: Callable[..., Any] = trainer.train_loop
    peak_memory_bytes: Callable[..., int] = loop.peak_memory_bytes

    def measured_train_loop(*args: Any, **kwargs: Any) -> Any:
        record["baseline_rss_bytes"], record["reset"] = _reset()
        return train_loop(*args, **kwargs)

    def measured_peak(device: Any) -> int:
        peak = peak_memory_bytes(device)
        if getattr(device, "type", "cpu") == "cpu":
            rss, ok = _reset()
            record["steps"].append({"peak_rss_bytes": peak, "rss_after_bytes": rss})
            record["reset"] = record["reset"] and ok
        return peak

    trainer.train_loop = measured_train_loop
    loop.peak_memory_bytes = measured_peak


def release_collectives() -> None:
    """Wrap COLLECTIVES so that each returns once gloo's worker holds none of its tensors (each back to its use count
    before); an asynchronous call is left alone (its caller waits for it later), and torch without Tensor._use_count
    keeps them as they are."""
    import torch
    import torch.distributed as dist

    def released(collective: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(collective)
        def call(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("async_op"):
                return collective(*args, **kwargs)
            values = [v for a in (*args, *kwargs.values()) for v in (a if isinstance(a, (list, tuple)) else [a])]
            tensors = [t for t in values if isinstance(t, torch.Tensor)]
            before = [t._use_count() for t in tensors]
            result = collective(*args, **kwargs)
            deadline = time.monotonic() + RELEASE_WAIT_S
            while any(t._use_count() > n for t, n in zip(tensors, before, strict=True)) and time.monotonic() < deadline:
                time.sleep(0)
            return result

        return call

    if hasattr(torch.Tensor, "_use_count"):
        for name in COLLECTIVES:
            setattr(dist, name, released(getattr(dist, name)))


def main() -> None:
    sys.argv = sys.argv[1:]  # the script's, as `python SCRIPT ARGS` gives it
    rank = os.environ.get("RANK", "0")
    steps_file, peak_file = os.environ.get("BENCH_STEP_RSS_FILE"), os.environ.get("BENCH_PEAK_RSS_FILE")
    record: dict[str, Any] = {"rank": int(rank), "baseline_rss_bytes": None, "reset": False, "steps": []}
    if steps_file:
        install(record)
        release_collectives()
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        if steps_file:
            Path(f"{steps_file}.rank{rank}").write_text(json.dumps(record))
        if peak_file:
            Path(f"{peak_file}.rank{rank}").write_text(str(peak_rss_bytes()))


if __name__ == "__main__":
    main()
