"""The mixture-of-experts suite (--suite cpu-moe): a Mixtral-shaped random model, quantized expert by expert.

1. memory vs world size: the resident parameter bytes per rank of our CLI (`train.py --quant bnb`, optionally HQQ)
   at 1, 2 and 4 ranks, from metrics.jsonl and the "resident parameter bytes per rank after sharding" line, against
   Hugging Face's 4-bit loading of the same directory in one process (which quantizes nn.Linear only, so the fused
   experts stay 16-bit: bitsandbytes#1849);
2. step time: the MoE model against a dense Llama with the same active parameters per token (same hidden size,
   layers and heads; intermediate = top_k x the expert intermediate), same quantization, ranks, batch, context and
   steps.

Each measurement is a fresh process (or torchrun job) started through cpu_suite's Runner. The models are built once
under --cache in processes of their own: the dense Llama by scripts/make_tiny_model.py, the MoE by
tests/moe_models.py's build_moe_model (transformers' own classes and save_pretrained) with the dense model's
tokenizer, so both read the same token ids. `python -m benchmarks.moe_suite NAME JSON` runs the two workers (the
MoE builder and the peer's load).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import (
    REPO_ROOT,
    base_env,
    launch,
    median,
    read_json,
    run_metrics,
    worker_cmd,
    write_json,
)
from benchmarks.cpu_suite import (
    CpuPlan,
    LaunchSettings,
    Runner,
    ensure_model,
    launch_conditions,
    launches_markdown,
)
from benchmarks.data_suite import _shell
from benchmarks.report import fmt, render
from benchmarks.rows import row

QUANTS = ("bnb", "hqq")
MOE_HEADS = (4, 2)
"""Attention and key/value heads tests/moe_models.py's moe_config gives every family; the dense model copies them."""
FULL_MOE = dict(hidden=1024, layers=4, experts=8, top_k=2, intermediate=3584)
"""Mixtral's shape scaled down: 8 experts, top-2, expert intermediate 3.5 x hidden (Mixtral: 14336 / 4096)."""
QUICK_MOE = dict(hidden=128, layers=2, experts=4, top_k=2, intermediate=128)
FULL_VOCAB, QUICK_VOCAB = 8192, 512
PEER_LOAD = "HF from_pretrained 4-bit (nf4 + double quant), 1 process"
RESIDENT_LINE = re.compile(r"resident parameter bytes per rank after sharding: (\[[\d, ]+\])")


@dataclass
class MoePlan(LaunchSettings):
    """Sizes and repetitions of one MoE suite run."""

    moe: dict[str, int]
    """build_moe_model's sizes: hidden, layers, experts, top_k, intermediate (per expert)."""
    vocab_size: int
    reps: int
    """Repetitions of the step-time pair (MoE, dense); the byte counts are deterministic and run once."""
    world_sizes: tuple[int, ...] = (1, 2, 4)
    quants: tuple[str, ...] = ("bnb",)
    """Backends of the memory section."""
    memory_batch_size: int = 1
    """Per rank, in the memory runs (they train only to show that the sharded model trains)."""
    memory_context_length: int = 64
    memory_steps: int = 2
    step_quant: str = "bnb"
    step_nproc: int = 2
    batch_size: int = 2
    """Per rank, in the step-time runs."""
    context_length: int = 256
    steps: int = 5
    skip_steps: int = 1
    """Step time is the median over the steps after these (step 1 holds one-time costs)."""
    lora_rank: int = 16
    lora_alpha: float = 32.0
    seed: int = 0
    retries: int = field(default=0, kw_only=True)
    """No re-measuring on contention: the byte counts cannot change, and the step-time pair alternates on a machine
    whose other load a re-measurement rarely escapes; results.md lists every launch with the cores others took."""
    launch_timeout_s: float = field(default=600.0, kw_only=True)


def plan(
    *,
    quick: bool,
    threads: int,
    reps: int | None,
    idle_wait_s: float | None,
    precision: str | None = None,
    quants: tuple[str, ...] | None = None,
) -> MoePlan:
    """The full suite (hidden 1024, 4 layers, 8 experts, bnb alone; about 10 minutes on a busy 2-core machine, 6
    with --reps 1) or the quick one the test runs (hidden 128, 2 layers, 4 experts; 1 and 2 ranks, bnb and HQQ)."""
    if quick:
        p = MoePlan(dict(QUICK_MOE), QUICK_VOCAB, reps=1, world_sizes=(1, 2), quants=QUANTS, batch_size=1,
                    context_length=64, steps=3, quick=True)  # fmt: skip
        p.idle_wait_s, p.launch_timeout_s = 0.0, 180.0
    else:
        p = MoePlan(dict(FULL_MOE), FULL_VOCAB, reps=2)
    if quants is not None:
        unknown = sorted(set(quants) - set(QUANTS))
        if unknown or not quants:
            raise ValueError(f"--quants: choose from {', '.join(QUANTS)} (got {','.join(quants) or 'nothing'})")
        p.quants = tuple(dict.fromkeys(quants))
    p.set_launch(threads=threads, precision=precision, idle_wait_s=idle_wait_s)
    if reps is not None:
        p.reps = reps
    return p


def dense_sizes(moe: dict[str, int], vocab_size: int) -> dict[str, int]:
    """scripts/make_tiny_model.py flags of the dense Llama with the MoE's active parameters per token."""
    heads, kv_heads = MOE_HEADS
    return dict(
        hidden_size=moe["hidden"],
        num_layers=moe["layers"],
        intermediate_size=moe["top_k"] * moe["intermediate"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        vocab_size=vocab_size,
        num_shards=2,
    )


# ---------------------------------------------------------------------------------------------------------------
# The models
# ---------------------------------------------------------------------------------------------------------------


def _tensors(model: Path) -> dict[str, tuple[str, list[int]]]:
    """Every tensor's (dtype, shape) from the safetensors headers, without reading a tensor."""
    out = {}
    for file in sorted(model.glob("*.safetensors")):
        with open(file, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        out.update({k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return out


DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2}
SIZE_KEYS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
             "vocab_size", "num_local_experts", "num_experts_per_tok")  # fmt: skip


def describe(model: Path, *, experts: int = 0, top_k: int = 0) -> dict[str, Any]:
    """Parameters, on-disk bytes, and for an MoE its routed experts' share and the parameters a token uses."""
    tensors = _tensors(model)
    config = json.loads((model / "config.json").read_text())

    def count(shape: list[int]) -> int:
        n = 1
        for d in shape:
            n *= d
        return n

    total = sum(count(s) for _, s in tensors.values())
    info: dict[str, Any] = {
        "path": str(model),
        "architecture": (config.get("architectures") or ["?"])[0],
        "parameters": total,
        "bytes_on_disk": sum(count(s) * DTYPE_BYTES[d] for d, s in tensors.values()),
        "dtypes_on_disk": sorted({d for d, _ in tensors.values()}),
        "sizes": {k: config.get(k) for k in SIZE_KEYS},
    }
    if experts:
        # Routed experts: the per-expert tensors transformers writes (...experts.E.w1/w2/w3) or fused 3-D ones.
        routed = [
            (d, s) for k, (d, s) in tensors.items() if ".experts." in k or k.endswith((".gate_up_proj", ".down_proj"))
        ]
        expert_params = sum(count(s) for _, s in routed)
        info["expert_parameters"] = expert_params
        info["expert_bytes_on_disk"] = sum(count(s) * DTYPE_BYTES[d] for d, s in routed)
        info["active_parameters"] = total - expert_params + expert_params * top_k // experts
    else:
        info["active_parameters"] = total
    return info


def ensure_models(plan: MoePlan, cache: Path, say: Callable[[str], None]) -> tuple[Path, Path]:
    """The dense Llama and the MoE, each built once under `cache` in a process of its own (both deterministic)."""
    dense_plan = CpuPlan(dense_sizes(plan.moe, plan.vocab_size), reps=1, batch_size=1, context_length=1,
                         warmup_steps=0, measured_steps=0, threads=plan.threads,
                         launch_timeout_s=plan.launch_timeout_s)  # fmt: skip
    dense = ensure_model(dense_plan, cache)
    name = "mixtral-" + "-".join(f"{k[0]}{v}" for k, v in plan.moe.items()) + f"-v{plan.vocab_size}-s{plan.seed}-bf16"
    moe = cache / name
    if not (moe / "config.json").is_file():
        say(f"building {name}")
        args = {"out": str(moe), "tokenizer_from": str(dense), "seed": plan.seed, "sizes": plan.moe}
        launch([worker_cmd("benchmarks.moe_suite", "build_moe", args)], [base_env(plan.threads)],
               timeout_s=plan.launch_timeout_s).check(f"building {name}")  # fmt: skip
    _check_pair(moe, dense, plan)
    return moe, dense


def _check_pair(moe: Path, dense: Path, plan: MoePlan) -> None:
    """The dense model really is the MoE's active-parameter twin, and both read the same tokenizer."""
    a = json.loads((moe / "config.json").read_text())
    b = json.loads((dense / "config.json").read_text())
    same = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")
    wrong = [f"{k}: {a.get(k)} vs {b.get(k)}" for k in same if a.get(k) != b.get(k)]
    if a["num_experts_per_tok"] * a["intermediate_size"] != b["intermediate_size"]:
        wrong.append(f"dense intermediate {b['intermediate_size']} != top_k x {a['intermediate_size']}")
    if (moe / "tokenizer.json").read_bytes() != (dense / "tokenizer.json").read_bytes():
        wrong.append("different tokenizer.json")
    if wrong:
        raise RuntimeError(f"{moe.name} and {dense.name} are no pair: {'; '.join(wrong)}")


# ---------------------------------------------------------------------------------------------------------------
# Workers (fresh processes)
# ---------------------------------------------------------------------------------------------------------------


def build_moe(args: dict[str, Any]) -> None:
    """tests/moe_models.py's builder, bf16 weights (the config's dtype), written next to `out` and renamed into
    place, so an interrupted build leaves nothing that looks finished."""
    from tests.moe_models import build_moe_model

    out = Path(args["out"])
    tmp = out.with_name(f"{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    build_moe_model("mixtral", tmp, tokenizer_from=Path(args["tokenizer_from"]), seed=args["seed"], dtype="bfloat16",
                    **args["sizes"])  # fmt: skip
    tmp.replace(out)


def load_peer(args: dict[str, Any]) -> None:
    """HF from_pretrained 4-bit in this one process: the bytes the loaded model holds (parameters, buffers,
    bitsandbytes' quantization state), where they are (the fused experts, the Linear4bit layers), and peak RSS."""
    from benchmarks.cpu_workers import measured_peer_load

    model, record = measured_peer_load(args)
    import bitsandbytes as bnb

    from benchmarks.measure import model_bytes, tensor_bytes

    fused = [p for p in model.parameters() if p.dim() == 3]
    linear4bit = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    write_json(
        args["result"],
        {
            **record,
            "model_bytes": model_bytes(model),
            "fused_expert_tensors": len(fused),
            "fused_expert_bytes": sum(tensor_bytes(p) for p in fused),
            "fused_expert_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in fused}),
            "linear4bit_layers": len(linear4bit),
            "linear4bit_weight_bytes": sum(tensor_bytes(m.weight) for m in linear4bit),
        },
    )


WORKERS: dict[str, Callable[[dict[str, Any]], None]] = {"build_moe": build_moe, "load_peer": load_peer}


# ---------------------------------------------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------------------------------------------


class MoeRunner(Runner):
    """cpu_suite's Runner (idle waits, contention records, one retry of a failed launch) with the CLI runs this
    suite needs: any batch, context and step count, and the log's resident-bytes line."""

    def __init__(self, plan: MoePlan, work: Path, log: Callable[[str], None]) -> None:
        super().__init__(plan, work, log)
        self.moe_plan = plan

    def peer(self, what: str, model: Path) -> dict[str, Any]:
        result = self.result_path("peer")
        args = {"model": str(model), "precision": self.moe_plan.precision, "result": result}
        self._go(what, [worker_cmd("benchmarks.moe_suite", "load_peer", args)], [base_env(self.moe_plan.threads)])
        return read_json(result)

    def train(self, what: str, model: Path, quant: str, *, nproc: int, batch_size: int, context_length: int,
              steps: int) -> dict[str, Any]:  # fmt: skip
        """train.py (torchrun for several ranks) on `--dataset dummy`: metrics.jsonl's records, each rank's VmHWM
        at exit (cli_probe), and the resident-bytes line of the log, which must agree with the metrics."""
        p = self.moe_plan
        out = Path(self.result_path(f"train-{quant}-{nproc}"))
        flags = {
            "model": model, "quant": quant, "precision": p.precision, "dataset": "dummy",
            "dataset_samples": nproc * batch_size * steps, "context_length": context_length,
            "batch_size": batch_size, "lora_rank": p.lora_rank, "lora_alpha": p.lora_alpha, "lora_dropout": 0.0,
            "lora_target_modules": "all", "gradient_checkpointing": "false", "max_steps": steps, "lr": 1e-5,
            "log_to": "stdout", "save_model": "false", "device": "cpu", "output_dir": out,
        }  # fmt: skip
        args = ["-m", "benchmarks.cli_probe", str(REPO_ROOT / "train.py"), *(f"--{k}={v}" for k, v in flags.items())]
        if nproc == 1:
            cmd, env = [sys.executable, *args], base_env(p.threads)
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
            env = base_env(max(1, p.threads // nproc))
        peaks = f"{out}.peak-rss"
        env["BENCH_PEAK_RSS_FILE"] = peaks

        result = self._go(what, [cmd], [env], reset=lambda: shutil.rmtree(out, ignore_errors=True),
                          finished=lambda: len(run_metrics(out)) == steps)  # fmt: skip
        records = run_metrics(out)
        if len(records) != steps:
            raise RuntimeError(f"{what}: {len(records)} metrics records, expected {steps}:\n{result.log}")
        param_bytes = records[0]["param_bytes_per_rank"]
        match = RESIDENT_LINE.search(result.log)
        printed = json.loads(match.group(1)) if match else None
        if printed is not None and printed != param_bytes:
            raise RuntimeError(f"{what}: the log says {printed} resident bytes per rank, metrics.jsonl {param_bytes}")
        return {
            "command": _shell(cmd),
            "wall_s": result.wall_s,
            "foreign_cores": result.foreign_cores,
            "metrics": records,
            "param_bytes_per_rank": param_bytes,
            "printed_param_bytes_per_rank": printed,
            "trainable_parameters": records[0]["trainable_parameters"],
            "exit_peak_rss_bytes": [int(Path(f"{peaks}.rank{r}").read_text()) for r in range(nproc)],
        }


def _step_seconds(run: dict[str, Any], skip: int) -> list[float]:
    """Each step's seconds after the first `skip` (a record's elapsed_s counts from the start of training, so a
    step's own time is its tokens / tokens_per_s)."""
    return [m["tokens"] / m["tokens_per_s"] for m in run["metrics"][skip:]]


def _brief(run: dict[str, Any]) -> dict[str, Any]:
    """A run's record for results.json without every field of every step."""
    keep = ("step", "loss", "tokens", "tokens_per_s", "peak_memory_bytes_per_rank", "elapsed_s", "aux_loss",
            "expert_load_max", "expert_load_mean")  # fmt: skip
    out = {k: v for k, v in run.items() if k != "metrics"}
    out["steps"] = [{k: m[k] for k in keep if k in m} for m in run["metrics"]]
    return out


# ---------------------------------------------------------------------------------------------------------------
# The sections
# ---------------------------------------------------------------------------------------------------------------


def _memory(runner: MoeRunner, moe: Path, peer: dict[str, Any], rows: list, details: dict) -> None:
    """1: the resident bytes per rank of our CLI at each world size, per backend, against HF's 4-bit load."""
    p = runner.moe_plan
    adapter_bytes = 2 if p.precision == "bf16" else 4  # LoRA weights are stored in --precision
    hf = peer["model_bytes"]["total"]
    sec = "memory vs world size"
    details["memory"] = {}
    for quant in p.quants:
        runs = {}
        for n in p.world_sizes:
            what = f"memory, MoE {quant} x{n} rank(s), {p.memory_steps} steps"
            runs[n] = runner.train(what, moe, quant, nproc=n, batch_size=p.memory_batch_size,
                                   context_length=p.memory_context_length, steps=p.memory_steps)  # fmt: skip
        kind = "bnb nf4 + double quant" if quant == "bnb" else "hqq 4-bit g64"
        kw = {"ours_label": f"qlora-fsdp CLI, FSDP2 full_shard, {kind}, {p.precision}, LoRA r{p.lora_rank} on every "
                            "linear and expert", "peer_label": PEER_LOAD,
              "note": f"ours: train.py --max_steps {p.memory_steps}, batch {p.memory_batch_size} x "
                      f"{p.memory_context_length} per rank, param_bytes_per_rank of metrics.jsonl (= the log's "
                      "resident-bytes line), largest rank; peer: parameters + buffers + bitsandbytes' quantization "
                      "state of the loaded model"}  # fmt: skip
        record: dict[str, Any] = {}
        for n, run in runs.items():
            resident = max(run["param_bytes_per_rank"])
            adapters = run["trainable_parameters"] * adapter_bytes
            base = resident - adapters / n
            rows.append(row(sec, f"resident_bytes_per_rank_{quant}_n{n}",
                            f"{quant}, {n} rank(s): resident parameter bytes per rank, LoRA adapters included",
                            "bytes", "lower", [resident], [hf], **kw))  # fmt: skip
            rows.append(row(sec, f"base_bytes_per_rank_{quant}_n{n}",
                            f"{quant}, {n} rank(s): the same less the adapters' share (trainable parameters x "
                            f"{adapter_bytes} B / {n})", "bytes", "lower", [base], [hf], **kw))  # fmt: skip
            first = min(runs)
            whole = max(runs[first]["param_bytes_per_rank"]) * first  # the model's bytes, from the fewest ranks
            record[str(n)] = {
                **_brief(run),
                "adapter_bytes": adapters,
                "base_bytes_per_rank": base,
                "sharding_efficiency": (whole / n) / resident,
                "peak_rss_bytes": max(run["exit_peak_rss_bytes"]),
            }
        details["memory"][quant] = record


def _step_time(runner: MoeRunner, moe: Path, dense: Path, rows: list, details: dict) -> None:
    """2: step time of the MoE against the dense model with its active parameters, alternating the two."""
    p = runner.moe_plan
    seconds: dict[str, list[float]] = {"moe": [], "dense": []}
    peaks: dict[str, list[int]] = {"moe": [], "dense": []}
    runs: dict[str, list[dict[str, Any]]] = {"moe": [], "dense": []}
    for rep in range(p.reps):
        order = ("moe", "dense") if rep % 2 == 0 else ("dense", "moe")
        for kind in order:
            what = f"step time, {kind} {p.step_quant} x{p.step_nproc} (rep {rep + 1})"
            run = runner.train(what, moe if kind == "moe" else dense, p.step_quant, nproc=p.step_nproc,
                               batch_size=p.batch_size, context_length=p.context_length, steps=p.steps)  # fmt: skip
            seconds[kind].append(median(_step_seconds(run, p.skip_steps)))
            peaks[kind].append(max(run["exit_peak_rss_bytes"]))
            runs[kind].append(run)
    tokens = {k: [[m["tokens"] for m in r["metrics"]] for r in v] for k, v in runs.items()}
    same_tokens = all(t == tokens["moe"][0] for v in tokens.values() for t in v)
    if not same_tokens:
        raise RuntimeError(f"the MoE and the dense model trained different tokens per step: {tokens}")
    sec = "step time"
    shape = (
        f"{p.step_nproc} ranks (torchrun, gloo), FSDP2, {p.step_quant}, batch {p.batch_size} x "
        f"{p.context_length} per rank, --max_steps {p.steps}, LoRA r{p.lora_rank} on every linear and expert"
    )
    kw = {"ours_label": f"MoE ({p.moe['experts']} experts, top-{p.moe['top_k']}); {shape}",
          "peer_label": f"dense Llama, intermediate {p.moe['top_k'] * p.moe['intermediate']} (the same active "
                        "parameters per token), the same CLI and settings",
          "note": f"step seconds = tokens / tokens_per_s of metrics.jsonl; median of steps {p.skip_steps + 1}-"
                  f"{p.steps} of each run, then over {p.reps} run(s) each, the two models alternating"}  # fmt: skip
    rows.append(row(sec, "step_time_s", f"seconds per optimizer step, steps {p.skip_steps + 1}-{p.steps}", "s",
                    "lower", seconds["moe"], seconds["dense"], **kw))  # fmt: skip
    rows.append(row(sec, "train_peak_rss_bytes", "peak RSS while training (largest rank)", "bytes", "lower",
                    peaks["moe"], peaks["dense"], **kw))  # fmt: skip
    details["step_time"] = {
        "seconds": seconds,
        "same_tokens_per_step": same_tokens,
        "runs": {k: [_brief(r) for r in v] for k, v in runs.items()},
    }


def run_moe_suite(plan: MoePlan, *, cache: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every measurement of the MoE suite; returns results.json's content."""
    suite_start = time.perf_counter()
    moe, dense = ensure_models(plan, cache, log)
    build_s = time.perf_counter() - suite_start
    models = {
        "moe": describe(moe, experts=plan.moe["experts"], top_k=plan.moe["top_k"]),
        "dense": describe(dense),
    }
    rows: list[dict[str, Any]] = []
    details: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-moe-") as tmp:
        runner = MoeRunner(plan, Path(tmp), log)
        log(f"1/2 resident bytes per rank at {plan.world_sizes} ranks ({', '.join(plan.quants)}) against HF 4-bit")
        peer = runner.peer("peer: HF from_pretrained 4-bit, 1 process", moe)
        details["peer"] = peer
        _memory(runner, moe, peer, rows, details)
        log(f"2/2 step time, MoE against the dense model with its active parameters, {plan.step_nproc} ranks")
        _step_time(runner, moe, dense, rows, details)
        launches = runner.launches
    return {
        "suite": "cpu-moe",
        "quick": plan.quick,
        "models": models,
        "settings": {
            **asdict(plan),
            "precision": f"--precision {plan.precision} (weights, storage and compute; the peer's dtype and bnb "
            f"compute/storage dtype {plan.precision})",
            "quantization": "ours: every expert and every linear but the head, one quantized layer per expert "
            "(qlora_fsdp/quant/experts.py); peer: nn.Linear only (bnb nf4 + double quant, blocksize 64)",
            "threads": f"OMP_NUM_THREADS={plan.threads} for one-process runs and the peer; threads // ranks (at "
            "least 1) per rank of an N-rank job",
            "our_training": "the real CLI: python train.py / torchrun train.py --dataset dummy, metrics.jsonl",
            "adapters": f"ours: LoRA r{plan.lora_rank} in {plan.precision} on every linear but the head and the "
            "routers, and per expert on the fused projections; sharded with the model",
        },
        "rows": rows,
        "details": details,
        "conditions": {"build_models_s": round(build_s, 1), **launch_conditions(launches)},
        "wall_time_s": time.perf_counter() - suite_start,
    }


def render_moe(results: dict[str, Any]) -> str:
    """report.render's tables after a description of the two models and where HF's bytes are."""
    lines = [render(results).rstrip("\n")]
    models = results.get("models")
    if models:
        moe, dense = models["moe"], models["dense"]
        s = moe["sizes"]
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
    peer = results.get("details", {}).get("peer")
    if peer:
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
    memory = results.get("details", {}).get("memory") or {}
    if memory:
        lines += ["", "Sharding efficiency, (bytes per rank at 1 rank / N) / bytes per rank at N (1.00 = all of it "
                  "sharded): " + "; ".join(f"{q} " + ", ".join(f"{n} ranks {r['sharding_efficiency']:.3f}"
                                                               for n, r in by_n.items() if n != "1")
                                           for q, by_n in memory.items()) + "."]  # fmt: skip
        # Not a ratio row: our peak covers loading and training steps, the peer's its loading alone.
        steps = results.get("settings", {}).get("memory_steps", "?")
        lines += ["", f"Peak RSS (VmHWM) of the largest rank, loading + {steps} training steps: " + "; ".join(
            f"{q} " + ", ".join(f"{n} rank(s) {fmt(r['peak_rss_bytes'], 'bytes')}" for n, r in by_n.items())
            for q, by_n in memory.items()) + (f"; HF's loading alone: {fmt(peer['peak_rss_bytes'], 'bytes')}"
                                              if peer else "") + "."]  # fmt: skip
    lines += launches_markdown(results)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in WORKERS:
        raise SystemExit(f"usage: python -m benchmarks.moe_suite {{{','.join(WORKERS)}}} JSON_ARGS")
    WORKERS[sys.argv[1]](json.loads(sys.argv[2]))
