"""The GPU suite: a Llama-2-7B-shaped random model, bnb and HQQ against the HF + PEFT + bitsandbytes loop.

Orchestrator (`run_gpu_suite`) and workers (`python -m benchmarks.gpu_suite NAME JSON`) live here. The model is
written once as bf16 safetensors shards to local disk (random weights generated on the GPU, about 13.5 GB, so the
page cache keeps it), then both sides load it the way they always do: ours through the real CLI code
(`qlora_fsdp.cli.main`, in-process so the worker can read the CUDA allocator's reserved peak afterwards), the peer
through `from_pretrained(..., BitsAndBytesConfig(load_in_4bit=True, ...))`. Each side is one fresh process that
runs the small shape, then the large one (the cache is emptied and the peaks reset in between).

`--dry-run` runs exactly this on the CPU with tiny shapes and a few steps; peak memory is then the process's
peak RSS (the CPU has no allocator statistics) and MFU is computed against the same --peak_flops.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import base_env, launch, machine_info, read_json, worker_cmd, write_json
from benchmarks.rows import row

MODULE = "benchmarks.gpu_suite"
LLAMA2_7B = dict(
    hidden_size=4096,
    num_layers=32,
    intermediate_size=11008,
    num_heads=32,
    num_kv_heads=32,
    vocab_size=32000,
    num_shards=7,
)
DRY_MODEL = dict(
    hidden_size=128, num_layers=2, intermediate_size=256, num_heads=4, num_kv_heads=2, vocab_size=512, num_shards=2
)
# (batch, context): the small shape first, so the large one's reserved peak is not inherited from it.
SHAPES = ((1, 512), (8, 2048))
DRY_SHAPES = ((1, 64), (2, 96))
LORA = {"lora_rank": 64, "lora_alpha": 16.0}
CHECKPOINTING = True
# Our runs: (record key, --quant, --fsdp_version, other flags); FSDP2 is the default, FSDP1 kept for comparison.
# The variants after them measure one option each against the default run of their backend: whole logits
# (--loss_chunk_tokens 0, the loss before chunking) and compiled decoder layers.
OUR_RUNS: tuple[tuple[str, str, int, dict[str, Any]], ...] = (
    ("bnb", "bnb", 2, {}),
    ("hqq", "hqq", 2, {}),
    ("bnb-whole-logits", "bnb", 2, {"loss_chunk_tokens": 0}),
    ("bnb-compile", "bnb", 2, {"compile": True}),
    ("hqq-compile", "hqq", 2, {"compile": True}),
    ("bnb-fsdp1", "bnb", 1, {}),
)
DEFAULT_BUDGET_S = 480.0
PEER_LABEL = "HF from_pretrained 4-bit + PEFT + AdamW, 1 process"


def _plan(dry_run: bool, quick: bool) -> dict[str, Any]:
    if dry_run:
        # Inductor on a CPU takes minutes per variant; the test suite trains a compiled model of its own.
        runs = tuple(r for r in OUR_RUNS if not r[3].get("compile"))
        return {"model": DRY_MODEL, "shapes": DRY_SHAPES, "warmup": 1, "measured": 2, "device": "cpu", "runs": runs}
    warmup, measured = (1, 2) if quick else (2, 3)
    return {"model": LLAMA2_7B, "shapes": SHAPES, "warmup": warmup, "measured": measured, "device": "cuda",
            "runs": OUR_RUNS}  # fmt: skip


def run_gpu_suite(
    out_dir: Path, *, dry_run: bool, peak_flops: float, budget_s: float | None, quick: bool = False
) -> dict[str, Any]:
    """Write the model, run the peer and each of our runs in fresh processes within the budget, return the results."""
    suite_start = time.perf_counter()
    budget = budget_s or DEFAULT_BUDGET_S
    p = _plan(dry_run, quick)
    threads = os.cpu_count() or 1
    errors: list[str] = []
    records: dict[str, dict[str, Any]] = {}
    launches = []
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    try:
        model_dir = work / "model"
        jobs = [("write_model", "write_model", {"out": str(model_dir), "sizes": p["model"], "device": p["device"]})]
        common = {
            "model": str(model_dir),
            "shapes": p["shapes"],
            "warmup": p["warmup"],
            "measured": p["measured"],
            "device": p["device"],
        }
        jobs += [("peer", "peer", common)]
        jobs += [
            (f"ours-{run}", "ours", {**common, "quant": q, "fsdp_version": v, "flags": flags})
            for run, q, v, flags in p["runs"]
        ]
        for key, name, args in jobs:
            left = budget - (time.perf_counter() - suite_start)
            if left < 20:
                errors.append(f"{key}: skipped, the {budget:.0f} s budget is spent")
                continue
            result = str(work / f"{key}.json")
            done = launch([worker_cmd(MODULE, name, {**args, "result": result})], [base_env(threads)], timeout_s=left)
            launches.append({"what": key, "wall_s": round(done.wall_s, 1), "returncode": done.returncode})
            print(f"  {key}: {done.wall_s:.1f} s, exit {done.returncode}", flush=True)
            if done.returncode != 0 or not Path(result).is_file():
                errors.append(f"{key}: exit status {done.returncode}\n{done.log[-3000:]}")
                if key == "write_model":
                    break
                continue
            records[key] = read_json(result)
            write_json(out_dir / "results.partial.json", {"records": records, "errors": errors})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = _rows(records, p, peak_flops)
    (out_dir / "results.partial.json").unlink(missing_ok=True)
    machine = machine_info()
    gpu = next((r.get("device_name") for r in records.values() if r.get("device_name")), None)
    if gpu:
        machine["gpu"] = gpu
    factor = 8 if CHECKPOINTING else 4
    return {
        "suite": "gpu",
        "dry_run": dry_run,
        "quick": quick,
        "model": {
            "parameters": records.get("write_model", {}).get("parameters", 0),
            "shards": p["model"]["num_shards"],
            "sizes": p["model"],
        },
        "settings": {
            "device": p["device"],
            "shapes": ", ".join(f"{b} x {s}" for b, s in p["shapes"]),
            "steps": f"{p['warmup']} warmup + {p['measured']} measured (median) per shape",
            "precision": "bf16 parameters, storage and compute; activation checkpointing on both sides",
            "quantization": "bnb nf4 + double quant (ours and peer), hqq 4-bit group 64 (ours)",
            "adapters": f"LoRA r{LORA['lora_rank']} alpha {LORA['lora_alpha']} on every linear but the head, dropout 0",
            "mfu": f"{factor} x params x tokens/s / peak_flops ({peak_flops:.3g}): 4 = 2 forward + 2 backward to the "
            "inputs (the base weights get no gradient); with activation checkpointing the harness counts 8, as "
            "specified (an exact count of the recomputed forward would be 6)",
            "memory": "CUDA allocator peaks" if not dry_run else "dry run: peak RSS stands in for both memory figures",
            "peak_flops": peak_flops,
            "budget_s": budget,
        },
        "rows": rows,
        "details": {k: v for k, v in records.items() if k != "write_model"},
        "conditions": {"launches": launches},
        "errors": errors,
        "machine": machine,
        "wall_time_s": time.perf_counter() - suite_start,
    }


def _rows(records: dict[str, dict[str, Any]], p: dict[str, Any], peak_flops: float) -> list[dict[str, Any]]:
    """Rows for every backend whose run finished (a run that failed or ran out of budget is listed in errors)."""
    if "peer" not in records:
        return []
    params = records["write_model"]["parameters"]
    factor = 8 if CHECKPOINTING else 4
    peer = records["peer"]["shapes"]
    rows = []
    for run, quant, version, flags in p["runs"]:
        if f"ours-{run}" not in records:
            continue
        ours = records[f"ours-{run}"]["shapes"]
        options = "".join(f", --{k} {str(v).lower()}" for k, v in flags.items())
        for (batch, context), o, q in zip(p["shapes"], ours, peer, strict=True):
            shape = f"{batch} x {context}"
            label = f"qlora-fsdp CLI code, {quant}, FSDP{version}{options}, 1 GPU"
            kw = {"ours_label": label, "peer_label": PEER_LABEL}
            section = f"{quant} FSDP{version}{options}, batch {shape}"
            slug = f"{run.replace('-', '_')}_b{batch}_s{context}"
            rows += [
                row(section, f"tokens_per_s_{slug}", "tokens/s", "tokens/s", "higher", o["tps"], q["tps"], **kw),
                row(
                    section,
                    f"mfu_{slug}",
                    "MFU",
                    "fraction",
                    "higher",
                    [factor * params * t / peak_flops for t in o["tps"]],
                    [factor * params * t / peak_flops for t in q["tps"]],
                    **kw,
                ),
                row(
                    section,
                    f"peak_reserved_{slug}",
                    "peak reserved memory",
                    "bytes",
                    "lower",
                    [o["peak_reserved_bytes"]],
                    [q["peak_reserved_bytes"]],
                    **kw,
                ),
                row(
                    section,
                    f"peak_allocated_{slug}",
                    "peak allocated memory",
                    "bytes",
                    "lower",
                    [o["peak_allocated_bytes"]],
                    [q["peak_allocated_bytes"]],
                    **kw,
                ),
            ]
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Workers
# ---------------------------------------------------------------------------------------------------------------


def _device_peaks(device: Any) -> tuple[int, int]:
    """(peak reserved, peak allocated) since the last reset; peak RSS twice on the CPU."""
    import torch

    from benchmarks.common import peak_rss_bytes

    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device)), int(torch.cuda.max_memory_allocated(device))
    rss = peak_rss_bytes()
    return rss, rss


def _reset_peaks(device: Any) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def write_model(args: dict[str, Any]) -> None:
    """A random bf16 Llama with these sizes, generated on the device, as HF safetensors shards + tokenizer."""
    import torch

    from qlora_fsdp.model import meta_model
    from scripts.make_tiny_model import (
        DEFAULT_DATA,
        make_config,
        read_rows,
        train_tokenizer,
        validate_sizes,
        write_shards,
    )

    sizes = args["sizes"]
    validate_sizes(arch="llama", tie_word_embeddings=False, **sizes)
    out = Path(args["out"])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(read_rows(DEFAULT_DATA), sizes["vocab_size"])
    config = make_config(
        "llama",
        vocab_size=sizes["vocab_size"],
        hidden_size=sizes["hidden_size"],
        intermediate_size=sizes["intermediate_size"],
        num_hidden_layers=sizes["num_layers"],
        num_attention_heads=sizes["num_heads"],
        num_key_value_heads=sizes["num_kv_heads"],
        head_dim=sizes["hidden_size"] // sizes["num_heads"],
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    device = torch.device(args["device"])
    model = meta_model(out, dtype=torch.bfloat16, trust_remote_code=False)
    generator = torch.Generator(device=device).manual_seed(0)
    state = {}
    start = time.perf_counter()
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            value = torch.ones(param.shape, dtype=torch.bfloat16, device=device)
        else:
            value = torch.randn(param.shape, generator=generator, dtype=torch.float32, device=device)
            value = value.mul_(0.02).to(torch.bfloat16)
        state[name] = value.cpu()
    generated = time.perf_counter() - start
    write_shards(state, out, sizes["num_shards"])
    write_json(
        args["result"],
        {
            "parameters": sum(t.numel() for t in state.values()),
            "generate_s": generated,
            "write_s": time.perf_counter() - start - generated,
        },
    )


def ours(args: dict[str, Any]) -> None:
    """Our training step through the CLI code path, once per shape, in this one process."""
    import torch

    from qlora_fsdp.cli import main as cli_main

    device = torch.device(args["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the GPU suite needs a CUDA GPU (use --dry-run on a CPU machine)")
    shapes = []
    for batch, context in args["shapes"]:
        out = Path(args["result"]).with_suffix(f".{batch}x{context}")
        steps = args["warmup"] + args["measured"]
        _reset_peaks(device)
        # A fresh rendezvous port per run: the previous process group was torn down with its store.
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(var, None)
        try:
            cli_main(
                model=args["model"],
                quant=args["quant"],
                fsdp_version=args["fsdp_version"],
                hqq_bits=4,
                hqq_group_size=64,
                precision="bf16",
                dataset="dummy",
                dataset_samples=batch * steps,
                context_length=context,
                batch_size=batch,
                lora_dropout=0.0,
                lora_target_modules="all",
                gradient_checkpointing=CHECKPOINTING,
                max_steps=steps,
                lr=1e-5,
                log_to="stdout",
                save_model=False,
                device=args["device"],
                output_dir=str(out),
                **LORA,
                **args["flags"],
            )
        except SystemExit as exc:
            raise RuntimeError(f"train.py code exited with {exc.code} at batch {batch} x {context}") from None
        with open(out / "metrics.jsonl") as fh:
            metrics = [json.loads(line) for line in fh if line.strip()]
        reserved, allocated = _device_peaks(device)
        shapes.append(
            {
                "batch": batch,
                "context": context,
                "tps": [m["tokens_per_s"] for m in metrics[args["warmup"] :]],
                "peak_reserved_bytes": reserved,
                # On the GPU the CLI logs the allocator's peak too; on the CPU it logs ru_maxrss, which would add
                # the launcher's high-water mark, so only VmHWM counts there.
                "peak_allocated_bytes": max(allocated, *(m["peak_memory_bytes"] for m in metrics))
                if device.type == "cuda"
                else allocated,
            }
        )
    write_json(args["result"], {"shapes": shapes, **_device_name(device)})


def peer(args: dict[str, Any]) -> None:
    """The HF + PEFT + bitsandbytes loop: load once, then each shape's steps."""
    import torch

    from benchmarks.peer import add_lora, dummy_batches, load_peer, train_steps

    device = torch.device(args["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the GPU suite needs a CUDA GPU (use --dry-run on a CPU machine)")
    model = load_peer(args["model"], device=args["device"])
    model = add_lora(model, rank=LORA["lora_rank"], alpha=LORA["lora_alpha"], dropout=0.0, checkpointing=CHECKPOINTING)
    shapes = []
    for batch, context in args["shapes"]:
        batches = dummy_batches(
            args["model"], batch_size=batch, context_length=context, count=args["warmup"] + args["measured"]
        )
        _reset_peaks(device)
        steps = list(train_steps(model, batches, device=device))
        reserved, allocated = _device_peaks(device)
        shapes.append(
            {
                "batch": batch,
                "context": context,
                "tps": [n / s for n, s in steps[args["warmup"] :]],
                "peak_reserved_bytes": reserved,
                "peak_allocated_bytes": allocated,
            }
        )
    write_json(args["result"], {"shapes": shapes, **_device_name(device)})


def _device_name(device: Any) -> dict[str, str]:
    import torch

    return {"device_name": torch.cuda.get_device_name(device)} if device.type == "cuda" else {}


WORKERS = {"write_model": write_model, "ours": ours, "peer": peer}

if __name__ == "__main__":
    WORKERS[sys.argv[1]](json.loads(sys.argv[2]))
