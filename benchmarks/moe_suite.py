"""The mixture-of-experts suite (--suite cpu-moe), on a Mixtral-shaped random model quantized expert by expert:
(1) resident parameter bytes per rank of our CLI at 1, 2 and 4 ranks against HF's 4-bit load (which leaves the fused
experts 16-bit: bitsandbytes#1849); (2) step time against a dense Llama with the same active parameters per token.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import harness, report
from benchmarks.harness import Runner, Settings, brief, llama, median, row, session
from benchmarks.report import fmt

QUANTS = ("bnb", "hqq")
MOE_HEADS = (4, 2)
"""Attention and key/value heads tests/moe_models.py's moe_config gives every family; the dense model copies them."""
FULL_MOE = dict(hidden=1024, layers=4, experts=8, top_k=2, intermediate=3584)
"""Mixtral's shape scaled down: 8 experts, top-2, expert intermediate 3.5 x hidden (Mixtral: 14336 / 4096)."""
QUICK_MOE = dict(hidden=128, layers=2, experts=4, top_k=2, intermediate=128)
PEER_LOAD = "HF from_pretrained 4-bit (nf4 + double quant), 1 process"
RESIDENT_LINE = re.compile(r"resident parameter bytes per rank after sharding: (\[[\d, ]+\])")
DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2}
SIZE_KEYS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
             "vocab_size", "num_local_experts", "num_experts_per_tok")  # fmt: skip
KEEP = ("step", "loss", "tokens", "tokens_per_s", "peak_memory_bytes_per_rank", "elapsed_s", "aux_loss",
        "expert_load_max", "expert_load_mean")  # fmt: skip


@dataclass
class MoePlan(Settings):
    moe: dict[str, int]
    """build_moe_model's sizes: hidden, layers, experts, top_k, intermediate (per expert)."""
    vocab_size: int
    reps: int
    """Repetitions of the step-time pair; the byte counts are deterministic and run once."""
    world_sizes: tuple[int, ...] = (1, 2, 4)
    quants: tuple[str, ...] = ("bnb",)
    memory_batch_size: int = 1
    """Per rank, in the memory runs (they train only to show that the sharded model trains)."""
    memory_context_length: int = 64
    memory_steps: int = 2
    step_quant: str = "bnb"
    step_nproc: int = 2
    batch_size: int = 2
    context_length: int = 256
    steps: int = 5
    skip_steps: int = 1
    """Step time is the median over the steps after these (step 1 holds one-time costs)."""
    seed: int = 0


def plan(*, quick: bool, quants: tuple[str, ...] | None = None, **launch: Any) -> MoePlan:
    """The full suite (hidden 1024, 8 experts, bnb) or the quick one (hidden 128, 4 experts, bnb and HQQ)."""
    if quick:
        p = MoePlan(dict(QUICK_MOE), 512, reps=1, world_sizes=(1, 2), quants=QUANTS, batch_size=1, context_length=64,
                    steps=3, quick=True, launch_timeout_s=180.0)  # fmt: skip
    else:
        p = MoePlan(dict(FULL_MOE), 8192, reps=2)
    if quants is not None:
        p.quants = harness.choose("--quants", quants, QUANTS)
    p.retries = 0
    p.configure(**launch)
    return p


def dense_sizes(moe: dict[str, int], vocab_size: int) -> dict[str, int]:
    """scripts/make_tiny_model.py flags of the dense Llama with the MoE's active parameters per token."""
    return llama(moe["hidden"], moe["layers"], moe["top_k"] * moe["intermediate"], *MOE_HEADS, vocab_size, 2)


def describe(model: Path, *, experts: int = 0, top_k: int = 0) -> dict[str, Any]:
    """Parameters and bytes on disk from the headers; for an MoE its experts' share and active parameters."""
    tensors, config = harness.tensor_headers(model), harness.read_json(model / "config.json")
    params = {k: math.prod(t["shape"]) for k, t in tensors.items()}
    disk = {k: n * DTYPE_BYTES[tensors[k]["dtype"]] for k, n in params.items()}
    total = sum(params.values())
    info: dict[str, Any] = {
        "path": str(model), "architecture": (config.get("architectures") or ["?"])[0], "parameters": total,
        "bytes_on_disk": sum(disk.values()), "dtypes_on_disk": sorted({t["dtype"] for t in tensors.values()}),
        "sizes": {k: config.get(k) for k in SIZE_KEYS}, "active_parameters": total,
    }  # fmt: skip
    if experts:  # per-expert tensors (...experts.E.w1/w2/w3) or fused 3-D ones
        routed = [k for k in tensors if ".experts." in k or k.endswith((".gate_up_proj", ".down_proj"))]
        expert_params = sum(params[k] for k in routed)
        info.update(expert_parameters=expert_params, expert_bytes_on_disk=sum(disk[k] for k in routed),
                    active_parameters=total - expert_params + expert_params * top_k // experts)  # fmt: skip
    return info


def ensure_models(runner: Runner, cache: Path) -> tuple[Path, Path]:
    """The MoE and its dense twin (built once; the MoE takes the dense tokenizer, so the same token ids)."""
    p = runner.plan
    dense = runner.model(dense_sizes(p.moe, p.vocab_size), cache)
    name = "mixtral-" + "-".join(f"{k[0]}{v}" for k, v in p.moe.items()) + f"-v{p.vocab_size}-s{p.seed}-bf16"
    moe = cache / name
    if not (moe / "config.json").is_file():
        print(f"building {name}")
        args = {"out": str(moe), "tokenizer_from": str(dense), "seed": p.seed, "sizes": p.moe}
        cmd = harness.worker_cmd("benchmarks.cpu_workers", "build_moe", args)
        harness.launch([cmd], [harness.base_env(p.threads)], timeout_s=p.launch_timeout_s).check(f"building {name}")
    a, b = (harness.read_json(m / "config.json") for m in (moe, dense))
    same = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")
    wrong = [f"{k}: {a.get(k)} vs {b.get(k)}" for k in same if a.get(k) != b.get(k)]
    if a["num_experts_per_tok"] * a["intermediate_size"] != b["intermediate_size"]:
        wrong.append(f"dense intermediate {b['intermediate_size']} != top_k x {a['intermediate_size']}")
    if (moe / "tokenizer.json").read_bytes() != (dense / "tokenizer.json").read_bytes():
        wrong.append("different tokenizer.json")
    if wrong:
        raise RuntimeError(f"{moe.name} and {dense.name} are no pair: {'; '.join(wrong)}")
    return moe, dense


def train(runner: Runner, what: str, model: Path, quant: str, *, nproc: int, batch_size: int, context_length: int,
          steps: int) -> dict[str, Any]:  # fmt: skip
    """train.py on `--dataset dummy`; the log's resident-bytes line must agree with metrics.jsonl."""
    run = runner.train(what, runner.flags(
        f"train-{quant}-{nproc}", model=model, quant=quant, dataset="dummy", dataset_samples=nproc * batch_size * steps,
        context_length=context_length, batch_size=batch_size, gradient_checkpointing="false", max_steps=steps),
        nproc=nproc, steps=steps)  # fmt: skip
    param_bytes = run["metrics"][0]["param_bytes_per_rank"]
    match = RESIDENT_LINE.search(run.pop("log"))
    printed = json.loads(match.group(1)) if match else None
    if printed is not None and printed != param_bytes:
        raise RuntimeError(f"{what}: the log says {printed} resident bytes per rank, metrics.jsonl {param_bytes}")
    return {**run, "param_bytes_per_rank": param_bytes, "printed_param_bytes_per_rank": printed,
            "trainable_parameters": run["metrics"][0]["trainable_parameters"]}  # fmt: skip


def _memory(runner: Runner, moe: Path, peer: dict[str, Any], rows: list, details: dict) -> None:
    """1: the resident bytes per rank of our CLI at each world size, per backend, against HF's 4-bit load."""
    p = runner.plan
    adapter_bytes = 2 if p.precision == "bf16" else 4  # LoRA weights are stored in --precision
    hf = peer["model_bytes"]["total"]
    details["memory"] = {}
    for quant in p.quants:
        runs = {n: train(runner, f"memory, MoE {quant} x{n} rank(s), {p.memory_steps} steps", moe, quant, nproc=n,
                         batch_size=p.memory_batch_size, context_length=p.memory_context_length,
                         steps=p.memory_steps) for n in p.world_sizes}  # fmt: skip
        kind = "bnb nf4 + double quant" if quant == "bnb" else "hqq 4-bit g64"
        kw = {"ours_label": f"qlora-fsdp CLI, FSDP2 full_shard, {kind}, {p.precision}, LoRA r{p.lora_rank} on every "
                            "linear and expert", "peer_label": PEER_LOAD,
              "note": f"ours: train.py --max_steps {p.memory_steps}, batch {p.memory_batch_size} x "
                      f"{p.memory_context_length} per rank, param_bytes_per_rank of metrics.jsonl (= the log's "
                      "resident-bytes line), largest rank; peer: parameters + buffers + bitsandbytes' quantization "
                      "state of the loaded model"}  # fmt: skip
        first = min(runs)
        whole = max(runs[first]["param_bytes_per_rank"]) * first  # the model's bytes, from the fewest ranks
        details["memory"][quant] = {}
        for n, run in runs.items():
            resident = max(run["param_bytes_per_rank"])
            adapters = run["trainable_parameters"] * adapter_bytes
            base = resident - adapters / n
            rows += [
                row("memory vs world size", f"resident_bytes_per_rank_{quant}_n{n}", f"{quant}, {n} rank(s): "
                    "resident parameter bytes per rank, LoRA adapters included", "bytes", "lower", [resident], [hf],
                    **kw),
                row("memory vs world size", f"base_bytes_per_rank_{quant}_n{n}", f"{quant}, {n} rank(s): the same "
                    f"less the adapters' share (trainable parameters x {adapter_bytes} B / {n})", "bytes", "lower",
                    [base], [hf], **kw),
            ]  # fmt: skip
            details["memory"][quant][str(n)] = {
                **brief(run, KEEP), "adapter_bytes": adapters, "base_bytes_per_rank": base,
                "sharding_efficiency": (whole / n) / resident, "peak_rss_bytes": max(run["exit_peak_rss_bytes"]),
            }  # fmt: skip


def _step_time(runner: Runner, moe: Path, dense: Path, rows: list, details: dict) -> None:
    """2: step time of the MoE against the dense model with its active parameters, the two alternating."""
    p = runner.plan

    def measure(kind: str, rep: int) -> dict[str, Any]:
        what = f"step time, {kind} {p.step_quant} x{p.step_nproc} (rep {rep + 1})"
        return train(runner, what, moe if kind == "moe" else dense, p.step_quant, nproc=p.step_nproc,
                     batch_size=p.batch_size, context_length=p.context_length, steps=p.steps)  # fmt: skip

    runs = harness.alternating(p.reps, ("moe", "dense"), measure)
    # A record's elapsed_s counts from the start of training: a step's own time is tokens / tokens_per_s.
    seconds = {k: [median([m["tokens"] / m["tokens_per_s"] for m in r["metrics"][p.skip_steps :]]) for r in v]
               for k, v in runs.items()}  # fmt: skip
    peaks = {k: [max(r["exit_peak_rss_bytes"]) for r in v] for k, v in runs.items()}
    tokens = {k: [[m["tokens"] for m in r["metrics"]] for r in v] for k, v in runs.items()}
    same_tokens = all(t == tokens["moe"][0] for v in tokens.values() for t in v)
    if not same_tokens:
        raise RuntimeError(f"the MoE and the dense model trained different tokens per step: {tokens}")
    shape = (f"{p.step_nproc} ranks (torchrun, gloo), FSDP2, {p.step_quant}, batch {p.batch_size} x {p.context_length} "
             f"per rank, --max_steps {p.steps}, LoRA r{p.lora_rank} on every linear and expert")  # fmt: skip
    kw = {"ours_label": f"MoE ({p.moe['experts']} experts, top-{p.moe['top_k']}); {shape}",
          "peer_label": f"dense Llama, intermediate {p.moe['top_k'] * p.moe['intermediate']} (the same active "
                        "parameters per token), the same CLI and settings",
          "note": f"step seconds = tokens / tokens_per_s of metrics.jsonl; median of steps {p.skip_steps + 1}-"
                  f"{p.steps} of each run, then over {p.reps} run(s) each, the two models alternating"}  # fmt: skip
    rows += [
        row("step time", "step_time_s", f"seconds per optimizer step, steps {p.skip_steps + 1}-{p.steps}", "s",
            "lower", seconds["moe"], seconds["dense"], **kw),
        row("step time", "train_peak_rss_bytes", "peak RSS while training (largest rank)", "bytes", "lower",
            peaks["moe"], peaks["dense"], **kw),
    ]  # fmt: skip
    details["step_time"] = {"seconds": seconds, "same_tokens_per_step": same_tokens,
                            "runs": {k: [brief(r, KEEP) for r in v] for k, v in runs.items()}}  # fmt: skip


def run(p: MoePlan, *, cache: Path, model: Path | None = None) -> dict[str, Any]:
    """Every measurement of the MoE suite; returns results.json's content."""
    rows: list[dict[str, Any]] = []
    with session(p, "moe") as runner:
        moe, dense = ensure_models(runner, cache)
        models = {"moe": describe(moe, experts=p.moe["experts"], top_k=p.moe["top_k"]), "dense": describe(dense)}
        print(f"1/2 resident bytes per rank at {p.world_sizes} ranks ({', '.join(p.quants)}) against HF 4-bit")
        peer = runner.worker("peer: HF from_pretrained 4-bit, 1 process", "moe_peer",
                             {"model": str(moe), "precision": p.precision})[0]  # fmt: skip
        details: dict[str, Any] = {"peer": peer}
        _memory(runner, moe, peer, rows, details)
        print(f"2/2 step time, MoE against the dense model with its active parameters, {p.step_nproc} ranks")
        _step_time(runner, moe, dense, rows, details)
        return runner.results("cpu-moe", rows, details, {
            "precision": f"--precision {p.precision} (weights, storage and compute; the peer's dtype and bnb "
                         f"compute/storage dtype {p.precision})",
            "quantization": "ours: every expert and every linear but the head, one quantized layer per expert "
                            "(qlora_fsdp/quant/experts.py); peer: nn.Linear only (bnb nf4 + double quant, "
                            "blocksize 64)",
            "our_training": "the real CLI: python train.py / torchrun train.py --dataset dummy, metrics.jsonl",
            "adapters": f"ours: LoRA r{p.lora_rank} in {p.precision} on every linear but the head and the routers, "
                        "and per expert on the fused projections; sharded with the model",
        }, models=models)  # fmt: skip


def render(results: dict[str, Any]) -> str:
    """The tables after the two models, where HF's bytes are, sharding efficiency and peak RSS."""
    lines, models, details = [], results.get("models"), results.get("details", {})
    if models:
        moe, dense, s = models["moe"], models["dense"], models["moe"]["sizes"]
        lines += ["", "### Models", "",
                  f"- MoE: random {moe['architecture']} (tests/moe_models.py), hidden {s['hidden_size']}, "
                  f"{s['num_hidden_layers']} layers, {s['num_local_experts']} experts, top-{s['num_experts_per_tok']}, "
                  f"expert intermediate {s['intermediate_size']}, {s['num_attention_heads']} heads "
                  f"({s['num_key_value_heads']} key/value), vocabulary {s['vocab_size']}: {moe['parameters']:,} "
                  f"parameters ({moe['expert_parameters']:,} in routed experts), {moe['active_parameters']:,} active "
                  f"per token; {fmt(moe['bytes_on_disk'], 'bytes')} on disk in {'/'.join(moe['dtypes_on_disk'])} "
                  f"(experts {fmt(moe['expert_bytes_on_disk'], 'bytes')}).",
                  f"- Dense: random {dense['architecture']} (scripts/make_tiny_model.py), intermediate "
                  f"{dense['sizes']['intermediate_size']}, otherwise the same: {dense['parameters']:,} parameters "
                  f"({'/'.join(dense['dtypes_on_disk'])} on disk; --precision casts both alike)."]  # fmt: skip
    if peer := details.get("peer"):
        b = peer["model_bytes"]
        lines += ["", "### Where Hugging Face's bytes are", "",
                  f"HF's 4-bit load holds {fmt(b['total'], 'bytes')} (parameters {fmt(b['params'], 'bytes')}, "
                  f"quantization state {fmt(b['quant_state'], 'bytes')}, buffers {fmt(b['buffers'], 'bytes')}): "
                  f"{peer['linear4bit_layers']} Linear4bit layers ({fmt(peer['linear4bit_weight_bytes'], 'bytes')} "
                  f"packed) and {peer['fused_expert_tensors']} fused expert tensors left in "
                  f"{'/'.join(peer['fused_expert_dtypes']) or '-'} ({fmt(peer['fused_expert_bytes'], 'bytes')}); "
                  f"loaded in {peer['load_s']:.1f} s, peak RSS {fmt(peer['peak_rss_bytes'], 'bytes')}."]  # fmt: skip
        if models:
            disk = models["moe"]["bytes_on_disk"]
            lines[-1] += (f" For scale, the checkpoint's {'/'.join(models['moe']['dtypes_on_disk'])} weights are "
                          f"{fmt(disk, 'bytes')}: HF's 4-bit model is {b['total'] / disk:.2f}x of them.")  # fmt: skip
    if memory := details.get("memory"):
        efficiency = "; ".join(f"{q} " + ", ".join(f"{n} ranks {r['sharding_efficiency']:.3f}" for n, r in by_n.items()
                                                   if n != "1") for q, by_n in memory.items())  # fmt: skip
        # Not a ratio row: our peak covers loading and training steps, the peer's its loading alone.
        peaks = "; ".join(f"{q} " + ", ".join(f"{n} rank(s) {fmt(r['peak_rss_bytes'], 'bytes')}"
                                              for n, r in by_n.items()) for q, by_n in memory.items())  # fmt: skip
        hf = f"; HF's loading alone: {fmt(peer['peak_rss_bytes'], 'bytes')}" if peer else ""
        steps = results.get("settings", {}).get("memory_steps", "?")
        lines += ["", "Sharding efficiency, (bytes per rank at 1 rank / N) / bytes per rank at N (1.00 = all of it "
                  f"sharded): {efficiency}.", "", f"Peak RSS (VmHWM) of the largest rank, loading + {steps} training "
                  f"steps: {peaks}{hf}."]  # fmt: skip
    return report.render(results, lines)
