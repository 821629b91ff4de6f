"""The benchmark harness, run for real in its reduced modes: every figure present and positive, ratio = ours/peer.

`python benchmarks/run.py --suite cpu --quick` (small model, one repetition) and `bash benchmarks/gpu.sh OUT
--dry-run` (the GPU suite's code on the CPU with tiny shapes) are the commands users run; nothing is mocked.
The dry run takes the whole GPU plan, --compile included, with the Python that QLORA_GPU_PYTHON names: .ci/run
names a venv holding exactly the GPU machine's packages plus the carried wheels (scripts/install_gpu_machine.sh), so
a module that machine lacks fails here. Without it, this venv's Python.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.gpu_suite import NAMES, parse_only
from benchmarks.harness import behind, keyed_rows, row
from benchmarks.report import fmt, render
from benchmarks.run import OPTIONS, SUITES
from tests.benchmarks.suites import ROW_FIELDS, env, positive, run, run_suite
from tests.conftest import THREADS

LOAD = (
    "load_wall_s", "load_peak_rss_rank0_bytes", "load_peak_rss_rank1_bytes", "load_rss_growth_rank0_bytes",
    "load_rss_growth_rank1_bytes", "load_peak_rss_sum_bytes", "load_rss_sum_over_model",
)  # fmt: skip
WORLD = ("fsdp2_bnb", "fsdp2_hqq", "fsdp1_bnb")
TRAIN = ("bnb_1proc", "bnb_2ranks_fsdp2")  # --quick: one process and one torchrun job
CPU_KEYS = {
    # 1. loading, each FSDP version
    *(f"{k}_fsdp{v}" for k in LOAD for v in (1, 2)),
    "quantized_model_bytes",
    "load_wall_s_hqq_split",
    # 2. memory vs world size
    *(f"{k}_{c}_n{n}" for k in ("param_shard_bytes_per_rank", "resident_bytes_per_rank") for c in WORLD
      for n in (1, 2)),  # --quick: 1 and 2 ranks
    *(f"resident_efficiency_{c}_n2" for c in WORLD),
    # 3. training
    *(f"tokens_per_s_{r}" for r in TRAIN),
    *(f"train_peak_rss_{r}_bytes" for r in TRAIN),
    # 4. quantization
    *(
        f"{metric}_{fmt_}"
        for metric in ("bits_per_param", "mean_abs_error", "max_abs_error")
        for fmt_ in ("bnb_nf4_dq", "bnb_nf4", "bnb_fp4_dq", "hqq_4bit", "hqq_3bit", "hqq_2bit")
    ),
}  # fmt: skip
GPU_DRY_KEYS = {
    f"{metric}_{run}"
    for metric in (
        "tokens_per_s", "mfu", "peak_reserved", "peak_allocated", "load_peak_reserved", "load_peak_allocated", "load_s"
    )
    for run in ("bnb", "hqq", "compile", "whole_logits", "fsdp1", "bnb_1x512")
} | {f"{metric}_long_{context}" for metric in ("tokens_per_s", "peak_allocated", "peak_reserved")
     for context in (128, 256)} | {"longest_context_long"}  # fmt: skip


def _check_rows(results: dict[str, Any], expected: set[str]) -> None:
    rows = results["rows"]
    keys = [r["key"] for r in rows]
    assert len(keys) == len(set(keys)), "duplicate row keys"
    assert set(keys) == expected, f"missing {expected - set(keys)}, unexpected {set(keys) - expected}"
    for r in rows:
        for name in ROW_FIELDS:
            assert name in r, f"{r.get('key')}: no {name}"
        assert r["better"] in ("higher", "lower")
        positive({k: r[k] for k in ("ours", "peer", "ratio", "runs")}, r["key"])
        assert r["runs"]["ours"] and r["runs"]["peer"], r["key"]
        assert math.isclose(r["ratio"], r["ours"] / r["peer"], rel_tol=1e-9), r["key"]
    assert results["wall_time_s"] > 0


@pytest.mark.distributed
@pytest.mark.benchmark
def test_cpu_suite_quick(tmp_path: Path) -> None:
    results, _ = run_suite(tmp_path, "cpu")
    _check_rows(results, CPU_KEYS)
    positive(results["details"], "details", may_be_zero=("replicated_state_bytes",))
    # FSDP2 shards the quantization state with the weights; FSDP1 keeps a copy of it on every rank.
    for combo, sizes in results["details"]["world_sizes"].items():
        state = [b for n in sizes.values() for b in n["replicated_state_bytes"]]
        assert all(b == 0 for b in state) if combo.startswith("fsdp2") else all(b > 0 for b in state), combo
    positive(results["model"], "model")
    by_key = {r["key"]: r for r in results["rows"]}
    # Sharding really divides what each rank holds; the peer holds the whole model at any world size. FSDP2 shards
    # the quantization state too, so its resident bytes divide almost exactly; FSDP1 replicates the state.
    for combo in WORLD:
        held = [by_key[f"resident_bytes_per_rank_{combo}_n{n}"]["ours"] for n in (1, 2)]
        assert held[0] > held[1], combo
        assert by_key[f"resident_efficiency_{combo}_n2"]["peer"] == pytest.approx(0.5)
    for combo in ("fsdp2_bnb", "fsdp2_hqq"):
        # Everything sharded, up to a few bytes of padding per tensor.
        assert by_key[f"resident_efficiency_{combo}_n2"]["ours"] == pytest.approx(1.0, abs=0.01)
        assert by_key[f"resident_efficiency_{combo}_n2"]["ours"] > by_key["resident_efficiency_fsdp1_bnb_n2"]["ours"]
    # Fewer bits really are stored, and cost accuracy.
    bits = [by_key[f"bits_per_param_hqq_{b}bit"]["ours"] for b in (4, 3, 2)]
    errors = [by_key[f"mean_abs_error_hqq_{b}bit"]["ours"] for b in (4, 3, 2)]
    assert bits == sorted(bits, reverse=True) and errors == sorted(errors)
    assert by_key["bits_per_param_bnb_nf4_dq"]["ours"] < by_key["bits_per_param_bnb_nf4"]["ours"]


@pytest.mark.distributed
@pytest.mark.benchmark
@pytest.mark.gpu_machine
def test_gpu_script_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "gpu"
    cmd = ["bash", "benchmarks/gpu.sh", str(out), "--dry-run"]
    python = os.environ.get("QLORA_GPU_PYTHON", sys.executable)
    run(cmd, timeout=1200, environ={**env(), "PYTHON": python, "OMP_NUM_THREADS": str(THREADS)})

    results = json.loads((out / "results.json").read_text())
    assert results["suite"] == "gpu" and results["dry_run"] is True and not results["errors"]
    assert results["plan"] == list(NAMES) and not results["missing"]
    _check_rows(results, GPU_DRY_KEYS)
    positive(results["details"], "details")
    assert results["model"]["parameters"] > 0
    # The GPU tier is collected and skipped on a machine without CUDA, and nothing in it fails to import.
    tier = results["tests"]
    assert tier["skipped"] > 0 and not tier["failed"] and not tier["passed"] and not tier["causes"], tier
    by_key = {r["key"]: r for r in results["rows"]}
    # MFU by PaLM's convention, counted by hand for the dry model (hidden 128, 2 layers, MLP 256, 4 heads of 32, 2 KV
    # heads, vocab 512, untied): a layer holds q, o 128x128, k, v 128x64, gate, up, down 128x256 and two norms of
    # 128, so 2 x 147,712 + the final norm 128 + the head 512 x 128 = 361,088 non-embedding parameters; at a
    # sequence of 96, 6 x 361,088 + 12 x 2 x 128 x 96 = 2,461,440 FLOPs a token (64: 2,363,136).
    assert results["model"]["non_embedding_parameters"] == 361_088
    peak = results["settings"]["peak_flops"]
    big = ("bnb", "hqq", "compile", "whole_logits", "fsdp1")
    for key, per_token in (*((k, 2_461_440) for k in big), ("bnb_1x512", 2_363_136)):
        tps, mfu = by_key[f"tokens_per_s_{key}"], by_key[f"mfu_{key}"]
        for side in ("ours", "peer"):
            assert mfu[side] == pytest.approx(per_token * tps[side] / peak, rel=1e-9)
    # The long-context item trained both settings at both dry contexts on rows that fill them (the worker checks).
    assert results["details"]["long-context"] == {
        name: {"trained": [128, 256], "out_of_memory_at": None, "longest": 256}
        for name in ("tiled_offload", "checkpointing")
    }
    assert by_key["longest_context_long"]["ratio"] == 1.0
    # Each variant is compared at its own shape: the peer's batch 1 row is not its batch 2 row.
    assert by_key["tokens_per_s_bnb_1x512"]["runs"]["peer"] != by_key["tokens_per_s_bnb"]["runs"]["peer"]
    report = (out / "results.md").read_text()
    assert (
        "| tokens/s |" in report
        and f"GPU test tier (`python -m pytest -m gpu tests/gpu`): {tier['skipped']} skipped" in report
    )


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("code", "cause"),
    [
        ("import sys; print('error: --quant bnb: no', file=sys.stderr); sys.exit(2)", "error: --quant bnb: no"),
        ("print('step 1'); raise ValueError('boom')", "ValueError: boom"),
    ],
    ids=["cli-error-line", "exception"],
)
def test_gpu_failure_cause_is_the_last_error_line(code: str, cause: str) -> None:
    """What results.md says of a failed variant: its own error line, not 'exit status 1'."""
    from benchmarks.gpu_suite import failure_cause
    from benchmarks.harness import base_env, launch

    noise = "import atexit; atexit.register(print, 'teardown noise after the error')"  # the log's last line
    job = launch([[sys.executable, "-c", f"{noise}\n{code}"]], [base_env(1)], timeout_s=60)
    assert failure_cause(job) == f"{cause} (exit status {job.returncode})" and job.returncode in (1, 2)


@pytest.mark.parametrize("suite", sorted({m: key for key, m in reversed(SUITES.items()) if m != "gpu_suite"}.values()))
def test_a_quick_plan_waits_for_nobody_and_keeps_a_contended_launch(suite: str) -> None:
    """A test's other worker keeps the machine busy: a quick plan measuring again on contention launched each
    process twice there (the formats and generation quick plans did). Each suite's plan as run.py makes it."""
    plan = importlib.import_module(f"benchmarks.{SUITES[suite]}").plan
    extra: dict[str, Any] = {name: None for name, owner in OPTIONS.items() if owner == suite}
    extra.update({"kind": suite} if SUITES[suite] == "cpu_suite" else {})
    quick = plan(quick=True, threads=2, reps=None, idle_wait_s=None, precision="fp32", **extra)
    assert quick.retries == 0 and quick.idle_wait_s == 0.0
    assert plan(quick=False, threads=2, reps=None, idle_wait_s=None, precision="fp32", **extra).idle_wait_s > 0


def test_palm_flops_per_token_of_llama2_7b() -> None:
    """Llama-2-7B holds 6,738,415,616 parameters, 32,000 x 4,096 of them in the input embedding: by PaLM's
    convention a token of a 2,048-token sequence costs 6 x 6,607,343,616 + 12 x 32 x 4,096 x 2,048 FLOPs."""
    from benchmarks.gpu_suite import palm_flops_per_token

    assert palm_flops_per_token(6_607_343_616, layers=32, hidden=4096, sequence=2048) == 42_865_287_168


def test_gpu_long_context_longest_fit() -> None:
    """The longest context is the largest that trained below a setting's first out-of-memory context; a context
    that was never measured (budget) is not a fit, and with no baseline fit there is no ratio row."""
    from benchmarks.gpu_suite import long_key, long_rows, longest_fits

    contexts = (16384, 32768, 65536)
    trained = {"tps": [1.0], "peak_allocated_bytes": 2, "peak_reserved_bytes": 3}
    records = {
        long_key("tiled_offload", 16384): trained,
        long_key("tiled_offload", 32768): trained,
        long_key("checkpointing", 16384): {"out_of_memory": "torch.OutOfMemoryError: CUDA out of memory."},
    }
    fits = longest_fits(records, contexts)
    assert fits["tiled_offload"] == {"trained": [16384, 32768], "out_of_memory_at": None, "longest": 32768}
    assert fits["checkpointing"] == {"trained": [], "out_of_memory_at": 16384, "longest": None}
    assert long_rows(records, contexts) == []
    records[long_key("checkpointing", 16384)] = trained
    records[long_key("checkpointing", 32768)] = {"out_of_memory": "CUDA out of memory"}
    by_key = {r["key"]: r for r in long_rows(records, contexts)}
    assert set(by_key) == {"tokens_per_s_long_16384", "peak_allocated_long_16384", "peak_reserved_long_16384",
                           "longest_context_long"}  # fmt: skip
    assert by_key["longest_context_long"]["ours"] == 32768 and by_key["longest_context_long"]["ratio"] == 2.0


def test_gpu_plan_names() -> None:
    """--only keeps the plan's priority order whatever order it is given in, and refuses unknown names."""
    assert parse_only(None) == NAMES
    assert parse_only("fsdp1,tests") == ("tests", "fsdp1")
    assert parse_only("long-context") == ("long-context",)
    with pytest.raises(ValueError, match="unknown fsdp3"):
        parse_only("bnb,fsdp3")


def test_rows_ratio_and_report() -> None:
    """The row arithmetic and the Markdown renderer, without launching anything."""
    faster = row("s", "tps", "tokens/s", "tokens/s", "higher", [90.0, 100.0, 200.0], [50.0, 60.0, 40.0])
    smaller = row("s", "mem", "memory", "bytes", "lower", [3 * 2**20], [2**20])
    assert faster["ours"] == 100.0 and faster["peer"] == 50.0 and faster["ratio"] == 2.0
    assert smaller["ratio"] == 3.0
    assert behind([faster, smaller]) == [smaller]
    assert fmt(3 * 2**20, "bytes") == "3.0 MiB" and fmt(0.4321, "fraction") == "43.2%"
    text = render({"suite": "cpu", "rows": [faster, smaller], "wall_time_s": 1.0})
    assert "| tokens/s | 100 | 50.0 | 2.00x | higher |" in text
    assert "s: memory: 3.00x (lower is better)" in text
    with pytest.raises(ValueError):
        row("s", "k", "f", "x", "sideways", [1.0], [1.0])


def test_keyed_rows() -> None:
    """keyed_rows gives figure_rows by each figure's key, the suffix left off."""
    figures = (("a", "A", "s", "lower"), ("b", "B", "tokens/s", "higher"))
    made = keyed_rows("x", figures, [{"a": 2.0, "b": 3.0}], [{"a": 4.0, "b": 1.0}], suffix="_dpo", note="n")
    assert list(made) == ["a", "b"] and [r["key"] for r in made.values()] == ["a_dpo", "b_dpo"]
    assert made["a"]["ratio"] == 0.5 and made["b"]["ratio"] == 3.0 and made["a"]["note"] == "n"
