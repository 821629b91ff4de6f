"""The CPU suite (--suite cpu): loading, per-rank memory vs world size, training throughput, quantization quality;
--suite cpu-large (loading alone on a 1.1B model), cpu-loss (chunked against whole-logit loss) and cpu-packing
(packed against unpacked training). Ours and the peer's runs alternate; see benchmarks/README.md."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import FULL_MODEL, QUICK_MODEL, Runner, Settings, alternating, figure_rows, median, row

PEER_LOAD = "HF from_pretrained 4-bit, 1 process"
PEER_TRAIN = "HF 4-bit + PEFT + AdamW, 1 process"
PEER_REPLICATED = "HF 4-bit model, replicated on every rank"
FORMATS = (
    ("bnb_nf4_dq", "bnb nf4 + double quant", {"quant": "bnb", "bnb_quant_type": "nf4", "bnb_double_quant": True}),
    ("bnb_nf4", "bnb nf4", {"quant": "bnb", "bnb_quant_type": "nf4", "bnb_double_quant": False}),
    ("bnb_fp4_dq", "bnb fp4 + double quant", {"quant": "bnb", "bnb_quant_type": "fp4", "bnb_double_quant": True}),
    ("hqq_4bit", "hqq 4-bit g64", {"quant": "hqq", "hqq_bits": 4, "hqq_group_size": 64}),
    ("hqq_3bit", "hqq 3-bit g64", {"quant": "hqq", "hqq_bits": 3, "hqq_group_size": 64}),
    ("hqq_2bit", "hqq 2-bit g64", {"quant": "hqq", "hqq_bits": 2, "hqq_group_size": 64}),
)
"""Section 4's formats: (key slug, name, QuantConfig fields)."""
TRAIN_RUNS = (("bnb_1proc", "bnb", 1, 2), ("hqq_1proc", "hqq", 1, 2), ("bnb_2ranks_fsdp2", "bnb", 2, 2),
              ("hqq_2ranks_fsdp2", "hqq", 2, 2), ("bnb_2ranks_fsdp1", "bnb", 2, 1))  # fmt: skip
"""Section 3's runs of ours: (key slug, --quant, ranks, --fsdp_version)."""
LOAD_FIGURES = (
    ("load_wall_s", "wall time to load + quantize + shard (slowest rank)", "s", "lower"),
    *(figure for r in range(2) for figure in (
        (f"load_peak_rss_rank{r}_bytes", f"peak RSS, rank {r} (peer: its one process)", "bytes", "lower"),
        (f"load_rss_growth_rank{r}_bytes", f"peak RSS minus RSS after imports, rank {r}", "bytes", "lower"))),
    ("load_peak_rss_sum_bytes", "sum of peak RSS over ranks", "bytes", "lower"),
    ("load_rss_sum_over_model", "sum of peak RSS over ranks / quantized model bytes", "x", "lower"),
)  # fmt: skip
"""Section 1's figures of each FSDP version: (key, figure, unit, better)."""
WORLD_COMBOS = ((2, "bnb"), (2, "hqq"), (1, "bnb"))
LOSS_MODEL = harness.llama(256, 2, 512, 4, 4, 0, 1)
"""The loss suite's memory model: one decoder too small to matter, so the head and its logits decide the peak."""
LOSS_VOCABS = (512, 128256)  # a toy vocabulary, and Llama 3's
LOSS_SHAPE = {"batch_size": 1, "context_length": 2048}
LOSS_CHUNK = 512  # --loss_chunk_tokens' default


@dataclass
class CpuPlan(Settings):
    """Sizes and repetitions of one CPU suite run."""

    model: dict[str, int]
    reps: int
    batch_size: int = 4
    context_length: int = 256
    warmup_steps: int = 2
    measured_steps: int = 3
    gradient_checkpointing: bool = False
    world_sizes: tuple[int, ...] = (1, 2, 4)
    train_runs: tuple[tuple[str, str, int, int], ...] = TRAIN_RUNS
    kind: str = "cpu"
    """cpu, cpu-large (loading alone), cpu-loss or cpu-packing."""


def plan(*, quick: bool, kind: str = "cpu", **launch: Any) -> CpuPlan:
    """The full suite (about 33 minutes on 2 cores), --quick (what the test runs), or one of the single sections."""
    if kind == "cpu-large":
        p = CpuPlan(model=harness.LARGE_MODEL, reps=1, batch_size=1, context_length=64, warmup_steps=0,
                    measured_steps=0)  # fmt: skip
    elif quick and kind == "cpu":
        # 4 ranks on 2 cores show nothing 2 do not; one process and one torchrun job cover both launch paths.
        p = CpuPlan(model=QUICK_MODEL, reps=1, batch_size=2, context_length=64, warmup_steps=1, measured_steps=2,
                    launch_timeout_s=180.0, world_sizes=(1, 2),
                    train_runs=tuple(r for r in TRAIN_RUNS if r[0] in ("bnb_1proc", "bnb_2ranks_fsdp2")))  # fmt: skip
    else:  # the full suite; packing: 2 ranks on data/alpaca_tiny.jsonl; loss: memory on LOSS_MODEL
        p = CpuPlan(model=QUICK_MODEL if quick else FULL_MODEL, reps=1 if quick else 3,
                    context_length=512 if kind == "cpu-packing" else 256)  # fmt: skip
    p.kind, p.quick = kind, quick and kind != "cpu-large"
    return p.configure(**launch)


def train_cli(runner: Runner, what: str, model: Path, quant: str, *, nproc: int, version: int,
              **flags: Any) -> tuple[list[dict[str, Any]], list[int]]:  # fmt: skip
    """Our CLI on `--dataset dummy` unless `flags` say otherwise, batch split over ranks: records, peak RSS per rank."""
    p = runner.plan
    if p.batch_size % nproc:
        raise ValueError(f"batch {p.batch_size} does not split over {nproc} ranks")
    steps = p.warmup_steps + p.measured_steps
    flags = {"model": model, "quant": quant, "fsdp_version": version, "dataset": "dummy",
             "dataset_samples": p.batch_size * steps, "context_length": p.context_length,
             "batch_size": p.batch_size // nproc, "gradient_checkpointing": str(p.gradient_checkpointing).lower(),
             "max_steps": steps, **flags}  # fmt: skip
    run = runner.train(what, runner.flags(f"train-{quant}-{nproc}-fsdp{version}", **flags), nproc=nproc, steps=steps)
    return run["metrics"], run["exit_peak_rss_bytes"]


def run(p: CpuPlan, *, model: Path | None, cache: Path) -> dict[str, Any]:
    """Every measurement of the plan's kind; returns results.json's content."""
    with harness.session(p, "cpu") as runner:
        model_dir = model or runner.model(p.model, cache)
        rows: list[dict[str, Any]] = []
        details: dict[str, Any] = {"parameters": harness.parameters(model_dir)}
        if p.kind == "cpu-loss":
            print("loss: --loss_chunk_tokens 512 against 0 (whole logits), step memory and tokens/s")
            _loss(runner, model_dir, cache, rows, details)
        elif p.kind == "cpu-packing":
            print("packing: 2 ranks, --packing true against false on the bundled data")
            _packing(runner, model_dir, rows, details)
        else:
            print("1/4 loading (ours: 2 ranks, streaming, FSDP2 and FSDP1; peer: HF from_pretrained)")
            loads = {(v, "bnb"): runs[0] for v, runs in _loading(runner, model_dir, rows, details).items()}
            if p.kind == "cpu":  # cpu-large: one unsplit HQQ load of 1.1B runs past the 600 s launch timeout
                loads[(2, "hqq")] = _hqq_split(runner, model_dir, rows)
                print("2/4 per-rank memory vs world size")
                _world_sizes(runner, model_dir, loads, rows, details)
                print("3/4 training throughput")
                _training(runner, model_dir, rows, details)
                print("4/4 quantization quality and size")
                _quality(runner, model_dir, rows, details)
        bf16 = "" if p.precision == "bf16" else "; this CPU has no native bf16 matmul (AVX512-BF16/AMX)"
        return runner.results(p.kind, rows, details, {
            "precision": f"{p.precision} parameters, storage and compute (ours --precision {p.precision}; peer dtype "
                         f"and bnb compute/storage {p.precision}){bf16}",
            "quantization": "bnb nf4 + double quant, blocksize 64 (both sides) unless a row says otherwise",
            "our_training": "the real CLI: python train.py / torchrun train.py --max_steps, metrics.jsonl tokens_per_s",
            "adapters": f"ours: LoRA weights in {p.precision} (qlora-fsdp stores them in --precision); peer: PEFT "
                        "default fp32",
        }, model=harness.model_record(model_dir))  # fmt: skip


def _load(runner: Runner, what: str, model: Path, version: int, quant: str, *, nproc: int = 2,
          **extra: Any) -> list[dict[str, Any]]:  # fmt: skip
    """Each rank's record of one run of our streaming load (benchmarks/cpu_workers.py load_ours)."""
    args = {"model": str(model), "fsdp_version": version, "quant": quant, "precision": runner.plan.precision}
    return runner.worker(what, "load_ours", {**args, **extra}, nproc=nproc)


def _load_summary(ranks: list[dict[str, Any]], model_bytes: int, wall: str = "total_s") -> dict[str, float]:
    """A load's LOAD_FIGURES from its ranks' records (the peer's one process stands for both ranks)."""
    peaks = [r["peak_rss_bytes"] for r in ranks]
    out = {"load_wall_s": max(r[wall] for r in ranks), "load_peak_rss_sum_bytes": sum(peaks),
           "load_rss_sum_over_model": sum(peaks) / model_bytes}  # fmt: skip
    for i in range(2):
        r = ranks[min(i, len(ranks) - 1)]
        out[f"load_peak_rss_rank{i}_bytes"] = r["peak_rss_bytes"]
        out[f"load_rss_growth_rank{i}_bytes"] = r["peak_rss_bytes"] - r["rss_after_imports_bytes"]
    return out


def _loading(runner: Runner, model: Path, rows: list, details: dict) -> dict[int, list[list[dict[str, Any]]]]:
    """Section 1: our 2-rank streaming load (FSDP2, FSDP1) against HF's; each version's runs of rank records."""
    p = runner.plan
    ours: dict[int, list[list[dict[str, Any]]]] = {2: [], 1: []}
    peer = []
    for rep in range(p.reps):
        for v in ours:
            ours[v].append(_load(runner, f"load ours FSDP{v} 2 ranks (rep {rep + 1})", model, v, "bnb"))
        args = {"model": str(model), "precision": p.precision}
        peer.append(runner.worker(f"load peer (rep {rep + 1})", "load_peer", args)[0])
    ours_model, peer_model = ours[2][0][0]["quantized_model_bytes"], peer[0]["quantized_model_bytes"]
    details["quantized_model_bytes"] = {"ours": ours_model, "peer": peer_model}
    peer_sums = [_load_summary([x], peer_model["total"], wall="load_s") for x in peer]
    for version, runs in ours.items():
        rows += figure_rows("loading", LOAD_FIGURES, [_load_summary(r, ours_model) for r in runs], peer_sums,
                            suffix=f"_fsdp{version}", prefix=f"FSDP{version}: ", peer_label=PEER_LOAD,
                            ours_label=f"qlora-fsdp FSDP{version}, 2 ranks (gloo), streaming")  # fmt: skip
    rows.append(row("loading", "quantized_model_bytes", "quantized model bytes (packed + quant state + unquantized "
                    "weights)", "bytes", "lower", [ours_model], [peer_model["total"]],
                    ours_label=f"qlora-fsdp, bnb nf4, {p.precision}", peer_label=PEER_LOAD))  # fmt: skip
    return ours


def _hqq_split(runner: Runner, model: Path, rows: list) -> list[dict[str, Any]]:
    """Section 1, HQQ: the ranks sharing whole weights out against every rank quantizing every weight; the first
    shared load's rank records (section 2's FSDP2 HQQ load at 2 ranks)."""
    runs: dict[bool, list[float]] = {True: [], False: []}
    first: list[dict[str, Any]] = []
    for rep in range(runner.plan.reps):
        for split in runs:
            ranks = _load(runner, f"load hqq 2 ranks, split {split} (rep {rep + 1})", model, 2, "hqq", split=split)
            runs[split].append(max(r["total_s"] for r in ranks))
            if split and rep == 0:
                first = ranks
    rows.append(row("loading", "load_wall_s_hqq_split",
                    "HQQ 4-bit, FSDP2: wall time to load + quantize + shard (slowest rank)", "s", "lower",
                    runs[True], runs[False], ours_label="qlora-fsdp, 2 ranks, each quantizes its share of the weights",
                    peer_label="the same, every rank quantizing every weight"))  # fmt: skip
    return first


def _world_sizes(runner: Runner, model: Path, loads: dict[tuple[int, str], list], rows: list, details: dict) -> None:
    """Section 2: what each rank holds after full_shard wrapping at 1, 2 and 4 ranks, per FSDP version and backend."""
    peer, section = details["quantized_model_bytes"]["peer"], "memory vs world size"
    details["world_sizes"] = {}
    for version, quant in WORLD_COMBOS:
        slug, f = f"fsdp{version}_{quant}", f"FSDP{version} {quant}"
        kw = {"ours_label": f"qlora-fsdp FSDP{version} full_shard, {quant}, {runner.plan.precision}",
              "peer_label": PEER_REPLICATED}  # fmt: skip
        held = details["world_sizes"][slug] = {}
        for n in runner.plan.world_sizes:  # 1 rank first: the efficiency's reference
            ranks = (loads[(version, quant)] if n == 2 and (version, quant) in loads  # section 1's runs
                     else _load(runner, f"load {slug} {n} rank(s)", model, version, quant, nproc=n))  # fmt: skip
            held[n] = {k: [r[k] for r in ranks] for k in ("param_shard_bytes", "replicated_state_bytes",
                                                          "resident_bytes")}  # fmt: skip
            params, resident = max(held[n]["param_shard_bytes"]), max(held[n]["resident_bytes"])
            rows += [row(section, f"param_shard_bytes_per_rank_{slug}_n{n}", f"{f}, {n} rank(s): parameter bytes per "
                         "rank (largest rank)", "bytes", "lower", [params], [peer["params"]], **kw),
                     row(section, f"resident_bytes_per_rank_{slug}_n{n}", f"{f}, {n} rank(s): parameters + replicated "
                         "quant state + buffers", "bytes", "lower", [resident], [peer["total"]], **kw)]  # fmt: skip
            if n > 1:
                one = max(held[1]["resident_bytes"])
                rows.append(row(section, f"resident_efficiency_{slug}_n{n}", f"{f}, {n} ranks: (resident bytes at 1 "
                                f"rank / {n}) / resident bytes per rank; 1.0 = everything sharded, peer 1/{n}", "x",
                                "higher", [(one / n) / resident], [1.0 / n], **kw))  # fmt: skip


def _training(runner: Runner, model: Path, rows: list, details: dict) -> None:
    """Section 3: tokens/s and peak RSS of our CLI (bnb, hqq; 1 and 2 ranks) against HF + PEFT."""
    p, skip = runner.plan, runner.plan.warmup_steps
    peer_tps, peer_rss = [], []
    ours, ours_rss = ({key: [] for key, *_ in p.train_runs} for _ in range(2))
    peer_args = {"model": str(model), "precision": p.precision, "lora_rank": p.lora_rank, "lora_alpha": p.lora_alpha,
                 "batch_size": p.batch_size, "context_length": p.context_length,
                 "steps": p.warmup_steps + p.measured_steps, "checkpointing": p.gradient_checkpointing}  # fmt: skip
    for rep in range(p.reps):
        record = runner.worker(f"train peer (rep {rep + 1})", "train_peer", peer_args)[0]
        peer_tps.append(median([s["tokens_per_s"] for s in record["steps"][skip:]]))
        peer_rss.append(record["peak_rss_bytes"])
        for key, quant, nproc, version in p.train_runs:
            what = f"train ours {quant} x{nproc} FSDP{version} (rep {rep + 1})"
            metrics, peaks = train_cli(runner, what, model, quant, nproc=nproc, version=version)
            ours[key].append(median([m["tokens_per_s"] for m in metrics[skip:]]))
            ours_rss[key].append(max(peaks))
    shape = f"batch {p.batch_size} x {p.context_length}, LoRA r{p.lora_rank} on all linears"
    note = f"tokens/s: median of steps {skip + 1}-{skip + p.measured_steps} of each run, then over {p.reps} run(s)"
    for key, quant, nproc, version in p.train_runs:
        kind = "bnb nf4" if quant == "bnb" else "hqq 4-bit"
        layout = (f"1 process x {p.threads} threads" if nproc == 1
                  else f"{nproc} ranks x {max(1, p.threads // nproc)} thread(s)")  # fmt: skip
        label = f"qlora-fsdp CLI{' (torchrun)' if nproc > 1 else ''} FSDP{version}, {kind}, {layout}"
        kw = {"ours_label": f"{label}; {shape}", "peer_label": f"{PEER_TRAIN} x {p.threads} threads", "note": note}
        rows += [row("training", f"tokens_per_s_{key}", f"tokens/s, {kind}, {layout}, FSDP{version}", "tokens/s",
                     "higher", ours[key], peer_tps, **kw),
                 row("training", f"train_peak_rss_{key}_bytes", f"peak RSS while training (largest rank), {kind}, "
                     f"{layout}, FSDP{version}", "bytes", "lower", ours_rss[key], peer_rss, **kw)]  # fmt: skip
    details["training"] = {"peer_tokens_per_s_runs": peer_tps, "ours_tokens_per_s_runs": ours}


def _packing(runner: Runner, model: Path, rows: list, details: dict) -> None:
    """--suite cpu-packing: label tokens/s and row efficiency, --packing true against false, 2 ranks."""
    p = runner.plan
    figures: dict[bool, dict[str, list[float]]] = {k: {"label_tps": [], "efficiency": []} for k in (True, False)}
    for rep in range(p.reps):
        for packing in (False, True):
            what = f"train {'packed' if packing else 'unpacked'} bnb x2 (rep {rep + 1})"
            steps = train_cli(runner, what, model, "bnb", nproc=2, version=2, dataset=harness.WORDS, dataset_samples=0,
                              packing=packing)[0][p.warmup_steps :]  # fmt: skip
            seconds = sum(m["tokens"] / m["tokens_per_s"] for m in steps)
            figures[packing]["label_tps"].append(sum(m["label_tokens"] for m in steps) / seconds)
            figures[packing]["efficiency"].append(median([m["packing_efficiency"] for m in steps]))
    shape = f"data/alpaca_tiny.jsonl, batch {p.batch_size} x {p.context_length}, 2 ranks, bnb, FSDP2"
    kw = {"ours_label": f"--packing true; {shape}", "peer_label": "--packing false (the same CLI)",
          "note": f"steps {p.warmup_steps + 1}-{p.warmup_steps + p.measured_steps} of each run, median over "
                  f"{p.reps}"}  # fmt: skip
    rows += [row("packing", "label_tokens_per_s_2ranks", "label tokens/s, 2 ranks", "tokens/s", "higher",
                 figures[True]["label_tps"], figures[False]["label_tps"], **kw),
             row("packing", "packing_efficiency", "real tokens / row tokens", "ratio", "higher",
                 figures[True]["efficiency"], figures[False]["efficiency"], **kw)]  # fmt: skip
    details["packing"] = {"packed": figures[True], "unpacked": figures[False]}


def _loss(runner: Runner, model: Path, cache: Path, rows: list, details: dict) -> None:
    """--suite cpu-loss: chunked against whole logits; memory is what vocabulary 128256 adds over 512."""
    p = runner.plan
    peaks: dict[tuple[int, int], list[int]] = {}
    models = {vocab: runner.model({**LOSS_MODEL, "vocab_size": vocab}, cache) for vocab in LOSS_VOCABS}

    def measure(chunk: int, rep: int) -> float:
        for vocab, small in models.items():
            what = f"loss memory, vocabulary {vocab}, --loss_chunk_tokens {chunk} (rep {rep + 1})"
            _, rss = train_cli(runner, what, small, "bnb", nproc=1, version=2, loss_chunk_tokens=chunk, **LOSS_SHAPE)
            peaks.setdefault((vocab, chunk), []).append(rss[0])
        metrics, _ = train_cli(runner, f"loss speed, --loss_chunk_tokens {chunk} (rep {rep + 1})", model, "bnb",
                               nproc=1, version=2, loss_chunk_tokens=chunk)  # fmt: skip
        return median([m["tokens_per_s"] for m in metrics[p.warmup_steps :]])

    speed = alternating(p.reps, (LOSS_CHUNK, 0), measure)
    small_vocab, large_vocab = LOSS_VOCABS
    growth = {c: [b - s for b, s in zip(peaks[(large_vocab, c)], peaks[(small_vocab, c)], strict=True)]
              for c in (LOSS_CHUNK, 0)}  # fmt: skip
    shape = f"hidden {LOSS_MODEL['hidden_size']}, {LOSS_MODEL['num_layers']} layers, batch 1 x 2048, 1 process, bnb"
    kw = {"ours_label": f"--loss_chunk_tokens {LOSS_CHUNK}", "peer_label": "--loss_chunk_tokens 0 (whole logits)"}
    rows.append(row("loss", "loss_peak_rss_growth_bytes", f"peak RSS at vocabulary {large_vocab} minus at "
                    f"{small_vocab} ({shape})", "bytes", "lower", growth[LOSS_CHUNK], growth[0], **kw))  # fmt: skip
    rows += [row("loss", f"loss_peak_rss_vocab{v}_bytes", f"peak RSS at vocabulary {v} ({shape})", "bytes", "lower",
                 peaks[(v, LOSS_CHUNK)], peaks[(v, 0)], **kw) for v in LOSS_VOCABS]  # fmt: skip
    layout = f"batch {p.batch_size} x {p.context_length}, 1 process x {p.threads} threads, bnb"
    rows.append(row("loss", "loss_tokens_per_s", f"tokens/s on the suite's model ({layout})", "tokens/s", "higher",
                    speed[LOSS_CHUNK], speed[0], **kw))  # fmt: skip
    details["loss"] = {"peak_rss": {f"{v}/{c}": r for (v, c), r in peaks.items()}, "tokens_per_s": speed}


def _quality(runner: Runner, model: Path, rows: list, details: dict) -> None:
    """Section 4: stored bits per parameter and dequantization error per format, on real weight matrices."""
    n = harness.read_json(model / "config.json")["num_hidden_layers"]
    layers = sorted({0, n // 2, n - 1})
    record = runner.worker("quantization quality", "quant_quality", {"model": str(model), "layers": layers,
                           "formats": [{"name": name, "config": cfg} for _, name, cfg in FORMATS]})[0]  # fmt: skip
    details["quality"] = {"layers": [f"model.layers.{i}" for i in layers], "matrices": record["matrices"],
                          "params": record["params"]}  # fmt: skip
    kw = {"ours_label": "qlora_fsdp.quant backend, uint8 storage, bf16 compute",
          "peer_label": "library called directly",
          "note": f"{record['matrices']} matrices of layers {layers}, {record['params']:,} weights"}  # fmt: skip
    for slug, name, _ in FORMATS:
        sides = record["formats"][name]
        rows += [row("quantization", f"{metric}_{slug}", f"{name}: {figure}", unit, "lower", [sides["ours"][metric]],
                     [sides["reference"][metric]], **kw) for metric, figure, unit in (
            ("bits_per_param", "stored bits per parameter (packed + quant state)", "bits"),
            ("mean_abs_error", "mean absolute error of the dequantized weights", "abs"),
            ("max_abs_error", "max absolute error of the dequantized weights", "abs"))]  # fmt: skip
