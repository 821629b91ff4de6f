"""Run a script exactly as `python SCRIPT ARGS` would, recording the resident-set peak of each training step.

`python -m benchmarks.step_probe train.py --flags` (or the same under `torchrun -m`) is our real CLI. On a CPU the
CLI's `peak_memory_bytes` is VmHWM, the process's high-water mark since exec, so a step that needs less than
loading did reports loading's peak, and no step's own need shows. The probe therefore resets VmHWM (Linux's
clear_refs "5", see benchmarks.common.reset_peak_rss) just before the first step, noting the RSS at that moment as
the baseline, and again right after each step's reading: step k's figure is the largest RSS during step k alone,
and metrics.jsonl's `peak_memory_bytes` of these runs is that per-step peak too. Two names of the package are
wrapped, never edited: `qlora_fsdp.train.trainer.train_loop` (the baseline) and
`qlora_fsdp.train.loop.peak_memory_bytes` (each step's reading). Each rank writes `$BENCH_STEP_RSS_FILE.rankR.json`.

It also makes the profiler's tensor peak (`--profile true`) honest under gloo: a gloo collective returns while its
worker thread still holds the buffers for a moment, so the last reference, and the free, can fall on that thread,
where the profiler records no memory event; each such buffer then counts as live until the end of the trace (seen
with --sequence_parallel_size: 13 MB of all-to-all buffers on a 46 MB peak). The collectives that path calls
(COLLECTIVES, of torch.distributed) are wrapped to yield until gloo has let their tensors go, so the training
thread frees them, as it would have a moment later anyway.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import current_rss_bytes, peak_rss_bytes, reset_peak_rss, write_json

RESET_SLACK_BYTES = 1 << 20
"""A reset counts as done when VmHWM reads at most this much above the RSS right after it (pages move meanwhile)."""
COLLECTIVES = ("all_to_all_single", "all_reduce", "all_gather")
"""The torch.distributed calls of qlora_fsdp/parallel/sequence_parallel.py whose buffers gloo may free on its own
thread."""
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


def _tensors(values: Any) -> list[Any]:
    """The tensors among a collective's arguments (lists of them included)."""
    import torch

    found = []
    for value in values:
        items = value if isinstance(value, (list, tuple)) else [value]
        found += [t for t in items if isinstance(t, torch.Tensor)]
    return found


def _released(collective: Callable[..., Any]) -> Callable[..., Any]:
    """`collective`, returning once gloo's worker holds none of its tensors (each back to its use count before);
    an asynchronous call is left alone (its caller waits for it later)."""

    @functools.wraps(collective)
    def call(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("async_op"):
            return collective(*args, **kwargs)
        tensors = _tensors([*args, *kwargs.values()])
        before = [t._use_count() for t in tensors]
        result = collective(*args, **kwargs)
        deadline = time.monotonic() + RELEASE_WAIT_S
        while any(t._use_count() > n for t, n in zip(tensors, before, strict=True)) and time.monotonic() < deadline:
            time.sleep(0)
        return result

    return call


def release_collectives() -> None:
    """Wrap COLLECTIVES so that their buffers are freed on the calling thread (see the module docstring); torch
    without Tensor._use_count keeps them as they are."""
    import torch
    import torch.distributed as dist

    if hasattr(torch.Tensor, "_use_count"):
        for name in COLLECTIVES:
            setattr(dist, name, _released(getattr(dist, name)))


def main() -> None:
    script, args = sys.argv[1], sys.argv[2:]
    rank = os.environ.get("RANK", "0")
    record: dict[str, Any] = {"rank": int(rank), "baseline_rss_bytes": None, "reset": False, "steps": []}
    install(record)
    release_collectives()
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        out = os.environ.get("BENCH_STEP_RSS_FILE")
        if out:
            write_json(f"{out}.rank{rank}.json", record)


if __name__ == "__main__":
    main()
