"""The GPU suite: the GPU test tier, then a Llama-2-7B-shaped model, ours against the HF + PEFT + bnb loop, in priority
order (NAMES) within a budget, results saved after every job. Each run is a fresh process (`python -m
benchmarks.gpu_suite NAME JSON`) that reads the CUDA allocator's peaks; `--dry-run` runs it on the CPU, tiny shapes.
"""

from __future__ import annotations

import gc
import json
import os
import re
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import llama, row

PLANS = {
    "gpu": {"model": llama(4096, 32, 11008, 32, 32, 32000, 7), "big": (8, 2048), "small": (1, 512), "warmup": 2,
            "measured": 3, "device": "cuda", "long": (16384, 32768, 65536), "budget_s": 500.0, "min_start_s": 45.0},
    "dry": {"model": llama(128, 2, 256, 4, 2, 512, 2), "big": (2, 96), "small": (1, 64), "warmup": 1, "measured": 2,
            "device": "cpu", "long": (128, 256), "budget_s": 1100.0, "min_start_s": 5.0},
}  # fmt: skip
"""Llama-2-7B-shaped on the GPU (--quick: 1 warmup + 2 measured steps), tiny on the CPU. The budget: on the GPU inside
the machine's 9 minutes with gpu.sh's install; on the dry run's 2-core CPU --compile alone takes minutes (inductor
compiles C++). No job starts with under min_start_s left: on a GPU every training job loads a 7B model first."""
LORA = {"lora_rank": 64, "lora_alpha": 16.0}
CHECKPOINTING = True
PEER_LABEL = "HF from_pretrained 4-bit + PEFT + AdamW, 1 process"
TESTS = "tests"
TEST_TIER_TIMEOUT_S = 150.0  # the tier is sized for 2 minutes on one GPU
ERROR_LINE = re.compile(r"^(error: |[\w.]*(Error|Exception|Exit|Interrupt)\b)")
OOM = re.compile(r"OutOfMemoryError|out of memory", re.IGNORECASE)
THREADS = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)  # a process's CPU threads; the user's if set


@dataclass(frozen=True)
class Variant:
    """One of our settings (`--only` calls a variant by its name), at the plan's "big" or "small" shape."""

    name: str
    label: str
    quant: str = "bnb"
    fsdp_version: int = 2
    flags: dict[str, Any] = field(default_factory=dict)
    shape: str = "big"


VARIANTS = (
    Variant("bnb", "bnb FSDP2 (defaults)"),
    Variant("hqq", "hqq 4-bit g64 FSDP2", quant="hqq"),
    Variant("compile", "bnb FSDP2, --compile true", flags={"compile": True}),
    Variant("whole-logits", "bnb FSDP2, --loss_chunk_tokens 0 (whole logits)", flags={"loss_chunk_tokens": 0}),
    Variant("fsdp1", "bnb FSDP1", fsdp_version=1),
    Variant("bnb-1x512", "bnb FSDP2 (defaults)", shape="small"),
)
LONG = "long-context"
LONG_SETTINGS = (
    Variant("tiled_offload", "bnb FSDP2, --tiled_mlp auto --activation_offload true",
            flags={"tiled_mlp": "auto", "activation_offload": True}),
    Variant("checkpointing", "bnb FSDP2, gradient checkpointing only (defaults)"),
)  # fmt: skip
"""The long-context item's two settings, ours then the peer column, each at every context of the plan, ascending."""
MEMORY = (("peak_allocated", "peak allocated memory"), ("peak_reserved", "peak reserved memory"))
"""The two CUDA allocator peaks (on the CPU both are the peak RSS): key and figure."""
NAMES = (TESTS, *(v.name for v in VARIANTS), LONG)


def parse_only(text: str | None) -> tuple[str, ...]:
    """`--only a,b` as plan names in priority order; every name must be one of NAMES."""
    if not text:
        return NAMES
    asked = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in asked if n not in NAMES]
    if unknown or not asked:
        raise ValueError(f"--only {text}: unknown {', '.join(unknown) or 'nothing'}; choose from {','.join(NAMES)}")
    return tuple(n for n in NAMES if n in asked)


def _settings(p: dict[str, Any], dry_run: bool, peak_flops: float, budget: float) -> dict[str, Any]:
    return {
        "device": p["device"],
        "shapes": "batch {} x {}; the bnb-1x512 variant batch {} x {}".format(*p["big"], *p["small"]),
        "long_context": f"{LONG}: batch 1 at contexts {', '.join(map(str, p['long']))} (rows that fill them), "
                        f"{LONG_SETTINGS[0].label} (ours) against {LONG_SETTINGS[1].label} (peer column), 1 warmup + 1 "
                        "measured step; a setting stops at its first context that runs out of memory; longest = the "
                        "largest that trained",
        "steps": f"{p['warmup']} warmup + {p['measured']} measured (median)",
        "precision": "bf16 parameters, storage and compute; activation checkpointing on both sides",
        "quantization": "bnb nf4 + double quant (ours and peer), hqq 4-bit group 64 (ours)",
        "adapters": f"LoRA r{LORA['lora_rank']} alpha {LORA['lora_alpha']} on every linear but the head, dropout 0",
        "mfu": f"PaLM's convention: tokens/s x (6 x non-embedding parameters + 12 x layers x hidden x sequence) / "
               f"peak_flops ({peak_flops:.3g}); the input embedding is a lookup (the head is counted), and neither "
               "the recomputed forward of activation checkpointing nor the frozen base's skipped weight gradients "
               "change it",
        "memory": "CUDA allocator peaks" if not dry_run else "dry run: peak RSS stands in for both memory figures",
        "peaks": "reset once the model is built, on both sides: loading and training peaks are separate rows",
        "peak_flops": peak_flops, "budget_s": budget,
    }  # fmt: skip


def _jobs(p: dict[str, Any], variants: list[Variant], only: tuple[str, ...], work: Path) -> list[tuple[str, str, dict]]:
    """(key, worker, args) of each job, in order: the tests, the model, the peer, the variants, the long contexts."""
    model = work / "model"
    common = {"model": str(model), "warmup": p["warmup"], "measured": p["measured"], "device": p["device"]}
    jobs: list[tuple[str, str, dict[str, Any]]] = [(TESTS, TESTS, {})] if TESTS in only else []
    if variants or LONG in only:
        jobs.append(("write_model", "write_model", {"out": str(model), "sizes": p["model"], **common}))
    if variants:
        jobs.append(("peer", "peer", {**common, "shapes": sorted({p[v.shape] for v in variants}, reverse=True)}))

    def our_args(v: Variant, shape: tuple[int, int], **kw: Any) -> dict[str, Any]:
        return {**common, "shape": shape, "quant": v.quant, "fsdp_version": v.fsdp_version, "flags": v.flags, **kw}

    # --compile compiles the layers at the second step (after the first has run eagerly): one more warmup step.
    jobs += [(v.name, "ours", our_args(v, p[v.shape], warmup=p["warmup"] + bool(v.flags.get("compile"))))
             for v in variants]  # fmt: skip
    if LONG in only:
        rows = harness.write_long_rows(work / "long-rows.jsonl", rows=2, words=max(p["long"]) + 8, seed=0)
        # Tokenized in memory: the GPU machine has no `datasets`, which the tokenized cache is built with.
        data = {"dataset": str(rows), "dataset_in_memory": True}
        jobs += [(long_key(v.name, c), "ours", our_args(v, (1, c), flags={**v.flags, **data}, warmup=1, measured=1))
                 for c in p["long"] for v in LONG_SETTINGS]  # fmt: skip
    return jobs


class GpuRun:
    """One run of the plan: the budget, the records so far, and results.json saved after every job."""

    def __init__(self, dry_run: bool, peak_flops: float, budget_s: float | None, quick: bool,
                 only: tuple[str, ...], save: Callable[[dict[str, Any]], None]) -> None:  # fmt: skip
        self.p = {**PLANS["dry" if dry_run else "gpu"], **({"warmup": 1, "measured": 2} if quick else {})}
        self.start, self.budget = time.perf_counter(), budget_s or self.p["budget_s"]
        self.only, self.save, self.peak_flops = only, save, peak_flops
        self.variants = [v for v in VARIANTS if v.name in only]
        self.records: dict[str, dict[str, Any]] = {}
        self.results: dict[str, Any] = {
            "suite": "gpu", "dry_run": dry_run, "quick": quick, "plan": list(only),
            "model": {"parameters": 0, "non_embedding_parameters": 0, "shards": self.p["model"]["num_shards"],
                      "sizes": self.p["model"]},
            "settings": _settings(self.p, dry_run, peak_flops, self.budget), "tests": None, "rows": [], "details": {},
            "conditions": {"launches": []}, "errors": [], "missing": [], "machine": harness.machine_info(),
            "wall_time_s": 0.0,
        }  # fmt: skip

    def left(self) -> float:
        return max(self.budget - (time.perf_counter() - self.start), 0.0)

    def done(self, name: str, job: harness.Launch | None, *, missing: Sequence[str] = ()) -> None:
        """Record a job, recompute every row from the records so far, and save."""
        r = self.results
        if job is not None:
            r["conditions"]["launches"].append({"what": name, "wall_s": round(job.wall_s, 1),
                                                "returncode": job.returncode})  # fmt: skip
            print(f"  {name}: {job.wall_s:.1f} s, exit {job.returncode}", flush=True)
        r["missing"] += [m for m in missing if m not in r["missing"]]
        r["rows"] = [*_rows(self.records, self.variants, self.p, self.peak_flops),
                     *long_rows(self.records, self.p["long"])]  # fmt: skip
        r["details"] = {k: v for k, v in self.records.items() if k != "write_model"}
        if LONG in self.only:
            r["details"][LONG] = longest_fits(self.records, self.p["long"])
        for key in ("parameters", "non_embedding_parameters"):
            r["model"][key] = self.records.get("write_model", {}).get(key, 0)
        if gpu := next((x.get("device_name") for x in self.records.values() if x.get("device_name")), None):
            r["machine"]["gpu"] = gpu
        r["wall_time_s"] = time.perf_counter() - self.start
        self.save(r)

    def jobs(self, jobs: list[tuple[str, str, dict[str, Any]]], work: Path) -> None:
        """Each job in turn while the budget lasts; out of memory ends a long-context setting (a result, not an
        error), a failed model or peer what needs it."""
        unrun: set[str] = set()
        for i, (key, worker, args) in enumerate(jobs):
            item = key.split("/")[0]  # a long-context job's item is LONG
            if key in unrun:
                continue
            if self.left() < self.p["min_start_s"]:
                self.results["errors"].append(f"{key}: skipped, {self.left():.0f} s of the {self.budget:.0f} s "
                                              "budget left")  # fmt: skip
                self.done(key, None, missing=[item] if item in NAMES else [])
                continue
            job, causes = self.tests(work) if key == TESTS else self.worker(key, worker, args, work)
            missing = [item] if causes else []
            if item == LONG and causes and OOM.search(causes[0]):
                self.records[key], missing = {"out_of_memory": causes[0]}, []
                unrun.update(k for k, _, _ in jobs if k.startswith(key.rsplit("/", 1)[0] + "/"))  # longer contexts
            elif causes:
                self.results["errors"] += [f"{key}: {cause}" for cause in causes]
                self.results.setdefault("logs", {})[key] = job.log[-4000:]
            if causes and key in ("write_model", "peer"):  # nothing after it can be compared (after the peer: to it)
                rest = [k for k, _, _ in jobs[i + 1 :] if key == "write_model" or not k.startswith(f"{LONG}/")]
                self.results["errors"] += [f"{k}: not run, {key} failed" for k in rest]
                unrun.update(rest)
                missing = [n for n in NAMES if n in {k.split("/")[0] for k in rest}]
            self.done(key, job, missing=missing)

    def worker(self, key: str, worker: str, args: dict[str, Any], work: Path) -> tuple[harness.Launch, list[str]]:
        """One measurement in a fresh process: its record, or why it failed."""
        result = work / f"{key}.json"
        cmd = harness.worker_cmd("benchmarks.gpu_suite", worker, {**args, "result": str(result)})
        job = harness.launch([cmd], [harness.base_env(THREADS)], timeout_s=self.left())
        if job.returncode == 0 and result.is_file():
            self.records[key] = harness.read_json(result)
            return job, []
        return job, [failure_cause(job)]

    def tests(self, work: Path) -> tuple[harness.Launch, list[str]]:
        """`pytest -m gpu` in a fresh process: its counts, and one line per failing test."""
        report = work / "gpu-tests.xml"
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
               "tests/gpu"]  # fmt: skip
        # Only the plugins pytest itself brings: the GPU machine's image has others, built for its own pytest.
        env = {**harness.base_env(THREADS), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
        job = harness.launch([cmd], [env], timeout_s=min(TEST_TIER_TIMEOUT_S, self.left()))
        tier = self.results["tests"] = {"command": "python -m pytest -m gpu tests/gpu", "wall_s": round(job.wall_s, 1),
                                        "returncode": job.returncode, "causes": [],
                                        **(_test_counts(report) if report.is_file() else {})}  # fmt: skip
        if not report.is_file() or job.returncode not in (0, 1) or (job.returncode == 1 and not tier["failed"]):
            tier["causes"].append(failure_cause(job))
        return job, tier["causes"]


def run(*, dry_run: bool, peak_flops: float, budget_s: float | None, quick: bool = False,
        only: tuple[str, ...] = NAMES, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:  # fmt: skip
    """Run the selected plan in priority order within the budget; `save(results)` after every job."""
    state = GpuRun(dry_run, peak_flops, budget_s, quick, only, save)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-", ignore_cleanup_errors=True) as tmp:
        state.jobs(_jobs(state.p, state.variants, only, Path(tmp)), Path(tmp))
    state.results["wall_time_s"] = time.perf_counter() - state.start
    return state.results


def failure_cause(job: harness.Launch) -> str:
    """One line saying why a job failed: its last error line (an exception, or the CLI's `error:` line)."""
    if job.returncode == 124:
        return f"killed at its time limit, after {job.wall_s:.0f} s"
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", ln).strip() for ln in job.log.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("--- process ")]
    cause = next((ln for ln in reversed(lines) if ERROR_LINE.match(ln)), lines[-1] if lines else "no output")
    return f"{cause} (exit status {job.returncode})"


def _test_counts(report: Path) -> dict[str, Any]:
    """A JUnit XML report's counts, the first skip's reason, and one line per failing test (`causes`)."""
    out: dict[str, Any] = {"causes": [], "passed": 0, "failed": 0, "skipped": 0, "xfailed": 0}
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            out["passed"] += 1
        elif outcome.tag == "skipped":
            out["xfailed" if outcome.get("type") == "pytest.xfail" else "skipped"] += 1
            out.setdefault("skipped_because", (outcome.get("message") or "").strip())
        else:
            out["failed"] += 1
            message = (outcome.get("message") or outcome.text or "").strip().splitlines()
            out["causes"].append(f"{case.get('name', '?')}: {message[0] if message else outcome.tag}")
    return out


def palm_flops_per_token(non_embedding_parameters: int, *, layers: int, hidden: int, sequence: int) -> int:
    """PaLM's training FLOPs a token (appendix B): model FLOPs, so recomputation is not counted."""
    return 6 * non_embedding_parameters + 12 * layers * hidden * sequence


def long_key(setting: str, context: int) -> str:
    return f"{LONG}/{setting}/{context}"


def longest_fits(records: dict[str, dict[str, Any]], contexts: tuple[int, ...]) -> dict[str, Any]:
    """Per long-context setting: contexts trained, the first out of memory, the longest trained below it."""
    out: dict[str, Any] = {}
    for name in (v.name for v in LONG_SETTINGS):
        trained = [c for c in contexts if "tps" in records.get(long_key(name, c), {})]
        failed = next((c for c in contexts if "out_of_memory" in records.get(long_key(name, c), {})), None)
        below = [c for c in trained if failed is None or c < failed]
        out[name] = {"trained": trained, "out_of_memory_at": failed, "longest": max(below) if below else None}
    return out


def long_rows(records: dict[str, dict[str, Any]], contexts: tuple[int, ...]) -> list[dict[str, Any]]:
    """Tiled MLP + offload against checkpointing alone at each context both trained, and the longest."""
    ours, base = LONG_SETTINGS
    kw = {"ours_label": f"qlora-fsdp CLI code, {ours.label}, 1 process",
          "peer_label": f"qlora-fsdp CLI code, {base.label}, 1 process"}  # fmt: skip
    rows = []
    for context in contexts:
        o, b = records.get(long_key(ours.name, context), {}), records.get(long_key(base.name, context), {})
        if "tps" in o and "tps" in b:
            rows += [row(f"long context, batch 1 x {context}", f"{key}_long_{context}", *figure, **kw)
                     for key, *figure in _training(o, b)]  # fmt: skip
    longest = [fit["longest"] for fit in longest_fits(records, contexts).values()]  # ours, then the other
    if all(longest):
        note = f"of {', '.join(map(str, contexts))}; a setting that trained the largest may fit more"
        rows.append(row("long context, longest that trained", "longest_context_long", "longest context", "tokens",
                        "higher", longest[:1], longest[1:], note=note, **kw))  # fmt: skip
    return rows


def _training(o: dict[str, Any], b: dict[str, Any]) -> list[tuple]:
    """(key, figure, unit, better, ours, other) of tokens/s and the training peaks of two runs at one shape."""
    return [("tokens_per_s", "tokens/s", "tokens/s", "higher", o["tps"], b["tps"]),
            *((key, f"{figure}, training", "bytes", "lower", [o[f"{key}_bytes"]], [b[f"{key}_bytes"]])
              for key, figure in MEMORY)]  # fmt: skip


def _rows(records: dict[str, dict[str, Any]], variants: list[Variant], p: dict[str, Any],
          peak_flops: float) -> list[dict[str, Any]]:  # fmt: skip
    """Rows for every variant that finished, each beside the peer at its shape."""
    if "peer" not in records:
        return []
    peer, sizes = records["peer"], p["model"]
    by_shape = {(s["batch"], s["context"]): s for s in peer["shapes"]}
    rows = []
    for v in (v for v in variants if v.name in records):
        o, q = records[v.name], by_shape[tuple(p[v.shape])]
        per_token = palm_flops_per_token(records["write_model"]["non_embedding_parameters"], layers=sizes["num_layers"],
                                         hidden=sizes["hidden_size"], sequence=o["context"])  # fmt: skip
        mfu = [[per_token * t / peak_flops for t in x["tps"]] for x in (o, q)]
        tps, *memory = _training(o, q)
        figures = [tps, ("mfu", "MFU", "fraction", "higher", *mfu), *memory,
                   *((f"load_{key}", f"{figure}, loading", "bytes", "lower", [o["load"][f"{key}_bytes"]],
                      [peer["load"][f"{key}_bytes"]]) for key, figure in MEMORY),
                   ("load_s", "loading time", "s", "lower", [o["load"]["s"]], [peer["load"]["s"]])]  # fmt: skip
        section, slug = f"{v.label}, batch {o['batch']} x {o['context']}", v.name.replace("-", "_")
        rows += [row(section, f"{key}_{slug}", figure, unit, better, a, b, peer_label=PEER_LABEL,
                     ours_label=f"qlora-fsdp CLI code, {v.label}, 1 process")
                 for key, figure, unit, better, a, b in figures]  # fmt: skip
    return rows


# Workers


def _peaks(device: Any) -> dict[str, int]:
    """Peak allocated and reserved memory since the last reset; on the CPU the peak RSS, for both."""
    import torch

    if device.type == "cuda":
        return {"peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
                "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device))}  # fmt: skip
    rss = harness.peak_rss_bytes()
    return {"peak_allocated_bytes": rss, "peak_reserved_bytes": rss}


def _reset_peaks(device: Any) -> None:
    """Start both peaks afresh from what is in use now (the cache is emptied first, on both sides alike)."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    else:
        harness.reset_peak_rss()


def _device(args: dict[str, Any]) -> tuple[Any, dict[str, str]]:
    """The worker's device, and its name for results.json (none on the CPU)."""
    import torch

    device = torch.device(args["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the GPU suite needs a CUDA GPU (use --dry-run on a CPU machine)")
    return device, {"device_name": torch.cuda.get_device_name(device)} if device.type == "cuda" else {}


def write_model(args: dict[str, Any]) -> None:
    """A random bf16 Llama with these sizes, generated on the device, as HF safetensors shards + tokenizer."""
    import torch

    from qlora_fsdp.model.skeleton import meta_model
    from scripts import make_tiny_model as tiny

    sizes, out = args["sizes"], Path(args["out"])
    tiny.validate_sizes(arch="llama", tie_word_embeddings=False, **sizes)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny.train_tokenizer(tiny.read_rows(tiny.DEFAULT_DATA), sizes["vocab_size"])
    config = tiny.make_config("llama", vocab_size=sizes["vocab_size"], hidden_size=sizes["hidden_size"],
                              intermediate_size=sizes["intermediate_size"], num_hidden_layers=sizes["num_layers"],
                              num_attention_heads=sizes["num_heads"], num_key_value_heads=sizes["num_kv_heads"],
                              head_dim=sizes["hidden_size"] // sizes["num_heads"], tie_word_embeddings=False,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                              bos_token_id=tokenizer.bos_token_id)  # fmt: skip
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    device, _ = _device(args)
    model = meta_model(out, dtype=torch.bfloat16, trust_remote_code=False)
    generator = torch.Generator(device=device).manual_seed(0)
    state, start = {}, time.perf_counter()
    for name, param in model.named_parameters():
        value = (torch.ones(param.shape, device=device) if name.endswith("norm.weight")
                 else torch.randn(param.shape, generator=generator, device=device).mul_(0.02))  # fmt: skip
        state[name] = value.to(torch.bfloat16).cpu()
    generated = time.perf_counter() - start
    tiny.write_shards(state, out, sizes["num_shards"])
    harness.write_json(args["result"], {
        "parameters": sum(t.numel() for t in state.values()),
        "non_embedding_parameters": sum(t.numel() for k, t in state.items() if "embed_tokens" not in k),
        "generate_s": generated, "write_s": time.perf_counter() - start - generated})  # fmt: skip


def _cli_flags(args: dict[str, Any], out: Path) -> dict[str, Any]:
    """train.py's flags of one of our runs: bnb or HQQ 4-bit, LoRA on every linear, no saving, then the variant's."""
    (batch, context), steps = args["shape"], args["warmup"] + args["measured"]
    return {"model": args["model"], "quant": args["quant"], "fsdp_version": args["fsdp_version"], "hqq_bits": 4,
            "hqq_group_size": 64, "precision": "bf16", "dataset": args["flags"].get("dataset", "dummy"),
            "dataset_samples": batch * steps, "context_length": context, "batch_size": batch, "lora_dropout": 0.0,
            "lora_target_modules": "all", "gradient_checkpointing": CHECKPOINTING, "max_steps": steps, "lr": 1e-5,
            "log_to": "stdout", "save_model": False, "device": args["device"], "output_dir": str(out), **LORA,
            **{k: v for k, v in args["flags"].items() if k != "dataset"}}  # fmt: skip


def ours(args: dict[str, Any]) -> None:
    """Our training through the CLI code path at one shape; the loading peaks are read at the first forward."""
    import torch
    from torch.nn.modules.module import register_module_forward_pre_hook

    from qlora_fsdp.cli import main as cli_main

    device, name = _device(args)
    (batch, context), out = args["shape"], Path(args["result"]).with_suffix(".run")
    load: dict[str, Any] = {}
    start = time.perf_counter()

    def loaded(module: torch.nn.Module, inputs: Any) -> None:
        """The model is built and the first forward begins: what was held until now is the loading peak."""
        hook.remove()
        load.update(s=time.perf_counter() - start, **_peaks(device))
        _reset_peaks(device)

    # Fired before every module's forward until it removes itself: the CLI's model has no other way in.
    hook = register_module_forward_pre_hook(loaded)
    # An error ends this process with the CLI's one `error:` line (exit status 2): the cause the orchestrator reports.
    cli_main(**_cli_flags(args, out))
    with open(out / "metrics.jsonl") as fh:
        metrics = [m for m in map(json.loads, filter(str.strip, fh)) if "tokens_per_s" in m]  # steps, not evals
    if "dataset" in args["flags"] and any(m["tokens"] != batch * context for m in metrics):
        tokens = [m["tokens"] for m in metrics]
        raise RuntimeError(f"tokens per step {tokens}: the rows did not fill {batch} x {context}")
    tps = [m["tokens_per_s"] for m in metrics[args["warmup"] :]]
    harness.write_json(args["result"], {"batch": batch, "context": context, "tps": tps, **_peaks(device), "load": load,
                                        **name})  # fmt: skip


def peer(args: dict[str, Any]) -> None:
    """The HF + PEFT + bitsandbytes loop: load once, then each shape's steps, peaks reset before each."""
    from benchmarks.peer import add_lora, dummy_batches, load_peer, train_steps

    device, name = _device(args)
    start = time.perf_counter()
    model = load_peer(args["model"], device=args["device"])
    model = add_lora(model, rank=LORA["lora_rank"], alpha=LORA["lora_alpha"], dropout=0.0, checkpointing=CHECKPOINTING)
    load = {"s": time.perf_counter() - start, **_peaks(device)}
    shapes = []
    for batch, context in args["shapes"]:
        count = args["warmup"] + args["measured"]
        batches = dummy_batches(args["model"], batch_size=batch, context_length=context, count=count)
        _reset_peaks(device)
        steps = list(train_steps(model, batches, device=device))
        shapes.append({"batch": batch, "context": context, "tps": [n / s for n, s in steps[args["warmup"] :]],
                       **_peaks(device)})  # fmt: skip
    harness.write_json(args["result"], {"load": load, "shapes": shapes, **name})


if __name__ == "__main__":
    harness.worker_main((write_model, ours, peer))
