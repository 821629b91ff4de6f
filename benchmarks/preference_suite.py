"""The preference suite (--suite cpu-preference): a preference step's memory and time against SFT's, same tokens.

The issue's acceptance: resident parameter bytes per rank identical to SFT's on the same model, and a DPO step's
peak at most 1.15x an SFT step's over the same tokens (chosen and rejected together). Each run is our real CLI on
2 ranks (`torchrun train.py --quant bnb`, FSDP2, gradient checkpointing at its default), a job of its own:

- DPO (`--objective dpo`; IPO, ORPO and SimPO beside it) at `--batch_size B` pairs per rank, i.e. 2B sequences in
  one forward, plus DPO's and IPO's reference forward (adapters off, no_grad);
- SFT at `--batch_size 2B` rows of a prompt/completion file whose rows are those very sequences (each pair's chosen
  and rejected sides), so every step trains the same tokens: checked on metrics.jsonl's `tokens`/`label_tokens`.

Every prompt and every reply has one fixed token count (the model's own tokenizer, checked text by text), and a
sequence is a multiple of 8 tokens, so no batch is padded and both objectives run batches of one shape.

A step's peak, two ways (a CPU has no allocator high-water mark of its own):
- RSS: per rank, the largest RSS during a step less the RSS just before step 1 (benchmarks/step_probe.py resets
  VmHWM there and after every step), the largest over steps 1 to S-1 and over ranks;
- tensor bytes: the trainer's own profiler (`--profile true`) over the last step S alone; its memory events count
  the bytes of the tensors torch allocated since the step began and has not freed, the counterpart of CUDA's
  `max_memory_allocated` less the memory before the step. Kept out of the other steps: the profiler's own buffers
  grow RSS by gigabytes over a few steps, and it slows the step down.
Step time: a step's tokens / tokens_per_s, the median of steps 2 to S-1. Each figure stands beside SFT's from the
same repetition (the peer column); the order of the runs is reversed in every other repetition.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, base_env, median, read_json, run_metrics
from benchmarks.cpu_suite import (
    CpuPlan,
    LaunchSettings,
    Runner,
    ensure_model,
    launch_conditions,
    launches_markdown,
    model_record,
)
from benchmarks.data_suite import _shell
from benchmarks.report import fmt, render
from benchmarks.rows import row

OBJECTIVES = ("dpo", "ipo", "orpo", "simpo")
"""The preference objectives the suite can run; each is compared with the same repetition's SFT run."""
REFERENCE = ("dpo", "ipo")
"""Those with a reference forward in every step."""
PEAK_BAR = 1.15
"""The issue's bound on a DPO step's peak over an SFT step's."""
PEAKS = ("rss", "tensor")
"""The two step-peak measures (see the module docstring)."""
WORD_SOURCE = REPO_ROOT / "data" / "alpaca_tiny.jsonl"
FULL_MODEL = dict(hidden_size=512, num_layers=8, intermediate_size=1408, num_heads=8, num_kv_heads=8, vocab_size=8192,
                  num_shards=2)  # fmt: skip
"""34M parameters: at 2 ranks x 8 sequences of 384 tokens, a step's tensors are mostly activations and logits
(the quantized weights are 16 MiB per rank, the adapters and their AdamW state a few MiB)."""
QUICK_MODEL = dict(hidden_size=256, num_layers=2, intermediate_size=512, num_heads=4, num_kv_heads=4, vocab_size=512,
                   num_shards=2)  # fmt: skip
"""cpu_suite's quick model (the same directory under --cache)."""


@dataclass
class PreferencePlan(LaunchSettings):
    """Sizes and repetitions of one preference suite run."""

    model: dict[str, int]
    """scripts/make_tiny_model.py size flags."""
    reps: int
    pairs_per_rank: int
    """--batch_size of the preference runs (B pairs: 2B sequences); SFT runs 2B rows."""
    prompt_tokens: int
    """Tokens of every prompt as the template frames it (--prompt_style alpaca, the default)."""
    reply_tokens: int
    """Tokens of every reply (chosen and rejected alike), before the EOS the trainer appends."""
    steps: int
    """--max_steps: steps 1 to steps-1 give the RSS peak (step 1 also the one-time costs), 2 to steps-1 the step
    time, the last the tensor peak (profiled)."""
    objectives: tuple[str, ...] = OBJECTIVES
    nproc: int = 2
    lora_rank: int = 16
    lora_alpha: float = 32.0
    seed: int = 0
    retries: int = field(default=0, kw_only=True)
    """No re-measuring on contention: the byte counts cannot change, the peaks are memory that other processes'
    CPU use does not move, and step time is informative here; results.md lists every launch's contention."""

    @property
    def sequence_tokens(self) -> int:
        """One sequence: prompt + reply + EOS (the tokenizer adds no BOS of its own: checked when writing data)."""
        return self.prompt_tokens + self.reply_tokens + 1

    @property
    def pairs(self) -> int:
        """Pairs in the file: one epoch of the run, so SFT trains every sequence DPO does."""
        return self.nproc * self.pairs_per_rank * self.steps


def plan(
    *,
    quick: bool,
    threads: int,
    reps: int | None,
    idle_wait_s: float | None,
    precision: str | None = None,
    objectives: tuple[str, ...] | None = None,
) -> PreferencePlan:
    """The full suite (hidden 512, 8 layers; 2 ranks x 4 pairs of 384-token sequences, 4 steps; the four
    objectives; about 7 minutes on a busy 2-core machine) or the quick one the test runs (cpu_suite's quick model,
    2 ranks x 1 pair of 64 tokens, 3 steps, DPO alone; about a minute)."""
    if quick:
        p = PreferencePlan(dict(QUICK_MODEL), reps=1, pairs_per_rank=1, prompt_tokens=40, reply_tokens=23, steps=3,
                           objectives=("dpo",), quick=True)  # fmt: skip
        p.idle_wait_s, p.launch_timeout_s = 0.0, 180.0
    else:
        p = PreferencePlan(dict(FULL_MODEL), reps=1, pairs_per_rank=4, prompt_tokens=95, reply_tokens=288, steps=4)
    if objectives is not None:
        unknown = sorted(set(objectives) - set(OBJECTIVES))
        if unknown or not objectives:
            got = ",".join(objectives) or "nothing"
            raise ValueError(f"--objectives: choose from {', '.join(OBJECTIVES)} (got {got})")
        p.objectives = tuple(dict.fromkeys(objectives))
    p.set_launch(threads=threads, precision=precision, idle_wait_s=idle_wait_s)
    if reps is not None:
        p.reps = reps
    check_plan(p)
    return p


def check_plan(p: PreferencePlan) -> None:
    """What the measurement needs of the sizes: unpadded batches, and a step on each side of every measure."""
    if p.sequence_tokens % 8:
        raise ValueError(f"a sequence of {p.sequence_tokens} tokens would be padded to a multiple of 8")
    if p.steps < 3:
        raise ValueError("--max_steps must be >= 3: step 1 (one-time costs), a timed step, the profiled last step")


# ---------------------------------------------------------------------------------------------------------------
# The data: every prompt and every reply of one token count
# ---------------------------------------------------------------------------------------------------------------


class Texts:
    """Texts of an exact token count in the model's tokenizer, from the bundled data's words (seeded)."""

    def __init__(self, tokenizer_file: Path, seed: int) -> None:
        from tokenizers import Tokenizer  # the Rust library alone: the harness stays without torch

        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        words: set[str] = set()
        for line in WORD_SOURCE.read_text().splitlines():
            if line.strip():
                for value in json.loads(line).values():
                    words.update(re.findall(r"[A-Za-z]+", str(value)))
        self.cost = {w: self.count(" " + w) for w in sorted(words)}
        self.words = [w for w, c in self.cost.items() if 1 <= c <= 3]
        self.ones = [w for w in self.words if self.cost[w] == 1 and self.count(w) == 1]
        if not self.ones:
            raise RuntimeError(f"{tokenizer_file}: no word of the bundled data is one token; cannot fix lengths")
        self.rng = random.Random(seed)

    def count(self, text: str, *, special: bool = False) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=special).ids)

    def prefix(self) -> int:
        """Tokens the tokenizer puts before a text of its own accord (formats.special_prefix's probe)."""
        return self.count("Hello world", special=True) - self.count("Hello world")

    def text(self, tokens: int, *, frame: Callable[[str], str] = lambda s: s) -> str:
        """Words whose `frame`d text is exactly `tokens` tokens: drawn at random, ended with one-token words."""
        target = tokens - (self.count(frame(self.ones[0])) - 1)
        if target < 1:
            raise ValueError(f"{tokens} tokens leave no room for a word in the frame")
        for _ in range(50):
            picked: list[str] = []
            estimate = 0  # the costs after a space add up (the pre-tokenizer splits at spaces); checked below
            while target - estimate > 3:
                picked.append(self.rng.choice(self.words))
                estimate += self.cost[picked[-1]]
            while self.count(" ".join(picked)) < target:
                picked.append(self.rng.choice(self.ones))
            body = " ".join(picked)
            if self.count(frame(body)) == tokens:
                return body
        raise RuntimeError(f"no text of exactly {tokens} tokens in 50 draws")


def write_datasets(plan: PreferencePlan, model: Path, out: Path) -> dict[str, Any]:
    """The preference file (prompt/chosen/rejected) and its SFT twin (each side a prompt/completion row, the prompt
    framed as the trainer frames the pairs' prompts), every prompt and reply of the plan's token counts."""
    from qlora_fsdp.data.formats import format_prompt  # torch-free: the template the trainer frames prompts with

    texts = Texts(model / "tokenizer.json", plan.seed)
    if texts.prefix():
        raise RuntimeError(f"{model}: the tokenizer adds {texts.prefix()} token(s) itself; sequence_tokens counts 0")
    pairs, sft = [], []
    for _ in range(plan.pairs):
        prompt = texts.text(plan.prompt_tokens, frame=format_prompt)
        chosen = rejected = texts.text(plan.reply_tokens)
        while rejected == chosen:  # the loader drops identical pairs
            rejected = texts.text(plan.reply_tokens)
        pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
        framed = format_prompt(prompt)
        sft += [{"prompt": framed, "completion": chosen}, {"prompt": framed, "completion": rejected}]
    out.mkdir(parents=True, exist_ok=True)
    files = {"pairs": out / "pairs.jsonl", "sft": out / "sft.jsonl"}
    for name, rows in (("pairs", pairs), ("sft", sft)):
        files[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "pairs": len(pairs),
        "sft_rows": len(sft),
        "prompt_tokens": plan.prompt_tokens,
        "reply_tokens": plan.reply_tokens,
        "sequence_tokens": plan.sequence_tokens,
        "files": {k: str(v) for k, v in files.items()},
        "words": f"{len(texts.words)} words of data/alpaca_tiny.jsonl (1-3 tokens each), seed {plan.seed}",
    }


# ---------------------------------------------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------------------------------------------


def tensor_peak(trace: Path) -> tuple[int, int]:
    """(the largest "Total Allocated" of a Chrome trace's CPU memory events, how many there were).

    While the profiler runs, torch's CPU allocator counts the bytes of the tensors allocated since it started and
    not freed since; a tensor from before, freed meanwhile, is not subtracted (the step's input batch, here).
    """
    events = [e["args"] for e in read_json(trace)["traceEvents"] if e.get("name") == "[memory]"]
    cpu = [a["Total Allocated"] for a in events if a.get("Device Type") == 0]
    if not cpu:
        raise RuntimeError(f"{trace}: no CPU memory events (was the profiler run with profile_memory?)")
    return max(cpu), len(cpu)


def probed_train(
    runner: Runner, what: str, out: Path, flags: dict[str, Any], *, nproc: int, steps: int, threads: int
) -> tuple[list[str], Any, list[dict[str, Any]], list[dict[str, Any]]]:
    """train.py with `flags` (the profiler over the last of `steps` steps among them) on `nproc` ranks under
    benchmarks/step_probe.py, through `runner`'s launch: (the command, the launch's result, metrics.jsonl's records,
    per rank the probe's per-step RSS and the last step's tensor peak). Raises where a step or a rank's record is
    missing."""
    args = ["-m", "benchmarks.step_probe", str(REPO_ROOT / "train.py"), *(f"--{k}={v}" for k, v in flags.items())]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    env = base_env(max(1, threads // nproc))
    probe = f"{out}.steps"
    env["BENCH_STEP_RSS_FILE"] = probe

    def reset() -> None:
        shutil.rmtree(out, ignore_errors=True)
        for r in range(nproc):
            Path(f"{probe}.rank{r}.json").unlink(missing_ok=True)

    result = runner._go(what, [cmd], [env], reset=reset, finished=lambda: len(run_metrics(out)) == steps)
    records = run_metrics(out)
    if len(records) != steps:
        raise RuntimeError(f"{what}: {len(records)} metrics records, expected {steps}:\n{result.log}")
    missing = [r for r in range(nproc) if not Path(f"{probe}.rank{r}.json").is_file()]
    if missing:
        raise RuntimeError(f"{what}: no step_probe record from rank(s) {missing}:\n{result.log}")
    ranks = [read_json(f"{probe}.rank{r}.json") for r in range(nproc)]
    for r in ranks:
        if not r["reset"] or r["baseline_rss_bytes"] is None or len(r["steps"]) != steps:
            raise RuntimeError(f"{what}: rank {r['rank']}'s probe did not measure every step: {r}")
        trace = out / "profile" / f"trace-rank{r['rank']}.json"
        r["tensor_peak_bytes"], r["memory_events"] = tensor_peak(trace)
        trace.unlink()  # tens of MB a rank on the full model, hundreds at long context
    return cmd, result, records, ranks


class PreferenceRunner(Runner):
    """cpu_suite's Runner with this suite's command: train.py on 2 ranks under benchmarks/step_probe.py."""

    def __init__(self, plan: PreferencePlan, work: Path, log: Callable[[str], None]) -> None:
        super().__init__(plan, work, log)
        self.pref_plan = plan

    def train(self, what: str, model: Path, objective: str, dataset: Path, *, batch_size: int) -> dict[str, Any]:
        """One run: metrics.jsonl's records, and per rank the probe's per-step RSS and the last step's tensor peak."""
        p = self.pref_plan
        out = Path(self.result_path(f"train-{objective}"))
        flags = {
            "model": model, "quant": "bnb", "precision": p.precision, "objective": objective, "dataset": dataset,
            "dataset_cache_dir": self.work / "tokenized", "dataset_num_proc": 1, "context_length": p.sequence_tokens,
            "batch_size": batch_size, "lora_rank": p.lora_rank, "lora_alpha": p.lora_alpha, "lora_dropout": 0.0,
            "lora_target_modules": "all", "max_steps": p.steps, "lr": 1e-5, "seed": p.seed, "log_to": "stdout",
            "save_model": "false", "device": "cpu", "output_dir": out,
            "profile": "true", "profile_steps": f"{p.steps},{p.steps}",
        }  # fmt: skip
        cmd, result, records, ranks = probed_train(self, what, out, flags, nproc=p.nproc, steps=p.steps,
                                                    threads=p.threads)  # fmt: skip
        return {
            "objective": objective,
            "batch_size": batch_size,
            "command": _shell(cmd),
            "wall_s": result.wall_s,
            "foreign_cores": result.foreign_cores,
            "metrics": records,
            "ranks": ranks,
        }


def rss_growth(run: dict[str, Any]) -> list[list[int]]:
    """Per rank, each step's peak RSS less the RSS just before step 1 (the profiled last step included)."""
    return [[s["peak_rss_bytes"] - r["baseline_rss_bytes"] for s in r["steps"]] for r in run["ranks"]]


def summary(run: dict[str, Any], steps: int) -> dict[str, Any]:
    """A run's figures: resident bytes, the two step peaks (largest rank; RSS: largest of steps 1 to S-1), the
    step time (median of steps 2 to S-1) and the tokens of every step."""
    m = run["metrics"]
    growth = [g[: steps - 1] for g in rss_growth(run)]
    return {
        "param_bytes_per_rank": m[0]["param_bytes_per_rank"],
        "rss_peak_growth_bytes": max(max(g) for g in growth),
        "rss_peak_growth_step1_bytes": max(g[0] for g in growth),
        "tensor_peak_bytes": max(r["tensor_peak_bytes"] for r in run["ranks"]),
        "peak_rss_bytes": max(s["peak_rss_bytes"] for r in run["ranks"] for s in r["steps"][: steps - 1]),
        "baseline_rss_bytes": [r["baseline_rss_bytes"] for r in run["ranks"]],
        "step_s": median([x["tokens"] / x["tokens_per_s"] for x in m[1 : steps - 1]]),
        "tokens": [x["tokens"] for x in m],
        "label_tokens": [x["label_tokens"] for x in m],
    }


def _brief(run: dict[str, Any]) -> dict[str, Any]:
    """A run's record for results.json: the probe's per-rank records, and of each step what matters here."""
    keep = ("step", "loss", "tokens", "label_tokens", "tokens_per_s", "packing_efficiency",
            "peak_memory_bytes_per_rank", "rewards/accuracies", "rewards/margins")  # fmt: skip
    out = {k: v for k, v in run.items() if k != "metrics"}
    out["steps"] = [{k: x[k] for k in keep if k in x} for x in run["metrics"]]
    out["rss_growth_bytes_per_rank_step"] = rss_growth(run)
    return out


def check_tokens(p: PreferencePlan, runs: dict[str, dict[str, Any]]) -> None:
    """Every run trained the same tokens at every step, unpadded: 2B sequences of sequence_tokens per rank."""
    tokens = p.nproc * 2 * p.pairs_per_rank * p.sequence_tokens
    labels = p.nproc * 2 * p.pairs_per_rank * (p.reply_tokens + 1)  # each reply and its EOS
    for name, run in runs.items():
        got = [(x["tokens"], x["label_tokens"], x["packing_efficiency"]) for x in run["metrics"]]
        if any(g != (tokens, labels, 1.0) for g in got):
            raise RuntimeError(f"{name}: (tokens, label tokens, packing efficiency) per step {got}, expected "
                               f"({tokens}, {labels}, 1.0) at every step")  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# The suite
# ---------------------------------------------------------------------------------------------------------------


def run_preference_suite(plan: PreferencePlan, *, cache: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every run of the preference suite; returns results.json's content."""
    p = plan
    suite_start = time.perf_counter()
    model_plan = CpuPlan(p.model, reps=1, batch_size=1, context_length=1, warmup_steps=0, measured_steps=0,
                         threads=p.threads, launch_timeout_s=p.launch_timeout_s)  # fmt: skip
    model = ensure_model(model_plan, cache)
    build_s = time.perf_counter() - suite_start
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in ("sft", *p.objectives)}
    with tempfile.TemporaryDirectory(prefix="bench-pref-") as tmp:
        work = Path(tmp)
        data = write_datasets(p, model, work / "data")
        runner = PreferenceRunner(p, work, log)
        log(f"{p.reps} x SFT and {', '.join(p.objectives)}: {p.nproc} ranks x {p.pairs_per_rank} pairs "
            f"({2 * p.pairs_per_rank} sequences) of {p.sequence_tokens} tokens, {p.steps} steps")  # fmt: skip
        for rep in range(p.reps):
            order = ("sft", *p.objectives) if rep % 2 == 0 else (*reversed(p.objectives), "sft")
            for name in order:
                sft = name == "sft"
                dataset = Path(data["files"]["sft" if sft else "pairs"])
                batch = 2 * p.pairs_per_rank if sft else p.pairs_per_rank
                what = f"{name} x{p.nproc} ranks, batch {batch} {'rows' if sft else 'pairs'} (rep {rep + 1})"
                runs[name].append(runner.train(what, model, name, dataset, batch_size=batch))
            check_tokens(p, {name: r[rep] for name, r in runs.items()})
        launches = runner.launches
    rows: list[dict[str, Any]] = []
    details = _rows(p, runs, rows)
    return {
        "suite": "cpu-preference",
        "quick": p.quick,
        "model": model_record(model, p.model),
        "data": {k: v for k, v in data.items() if k != "files"},
        "settings": {
            **asdict(p),
            "sequence_tokens": p.sequence_tokens,
            "pairs": p.pairs,
            "precision": f"--precision {p.precision}",
            "threads": f"OMP_NUM_THREADS={max(1, p.threads // p.nproc)} per rank",
            "our_training": f"torchrun --nproc_per_node {p.nproc} train.py --quant bnb, FSDP2 full_shard, gradient "
            f"checkpointing (the default), LoRA r{p.lora_rank} on every linear but the head, --max_steps {p.steps} "
            f"(--profile true on step {p.steps}), each objective's settings at their defaults",
            "peaks": f"RSS: per rank, the largest RSS during a step less the RSS just before step 1 (VmHWM reset "
            f"there and after every step by benchmarks/step_probe.py), largest of steps 1-{p.steps - 1} and of the "
            f"ranks; tensor bytes: the largest 'Total Allocated' of the profiler's CPU memory events over step "
            f"{p.steps}, largest rank",
        },
        "rows": rows,
        "details": {**details, "runs": {k: [_brief(r) for r in v] for k, v in runs.items()}},
        "conditions": {"build_model_s": round(build_s, 1), **launch_conditions(launches)},
        "wall_time_s": time.perf_counter() - suite_start,
    }


def _rows(p: PreferencePlan, runs: dict[str, list[dict[str, Any]]], rows: list) -> dict[str, Any]:
    """Each objective's rows against SFT's; returns the acceptance record and every run's summary."""
    summaries = {k: [summary(r, p.steps) for r in v] for k, v in runs.items()}
    sft = summaries["sft"]
    shape = (f"{p.nproc} ranks, FSDP2, bnb, {p.precision}, gradient checkpointing; per rank {p.pairs_per_rank} "
             f"pairs = {2 * p.pairs_per_rank} sequences of {p.sequence_tokens} tokens a step")  # fmt: skip
    peer = f"--objective sft, batch {2 * p.pairs_per_rank} rows: the same sequences as prompt/completion rows"
    last = p.steps - 1
    note = (f"RSS peak: steps 1-{last}; tensor peak: step {p.steps} (profiled); step time: median of steps 2-{last}; "
            f"{p.reps} repetition(s), medians")  # fmt: skip
    figures = (
        ("param_bytes_per_rank", "resident parameter bytes per rank (largest rank)", "bytes",
         lambda s: max(s["param_bytes_per_rank"])),
        ("rss_peak_growth_bytes", "a step's peak RSS less the RSS before step 1", "bytes",
         lambda s: s["rss_peak_growth_bytes"]),
        ("tensor_peak_bytes", "a step's peak of live tensor bytes above the step's start", "bytes",
         lambda s: s["tensor_peak_bytes"]),
        ("peak_rss_bytes", "a step's peak RSS, whole process", "bytes", lambda s: s["peak_rss_bytes"]),
        ("step_time_s", f"seconds per step, steps 2-{last}", "s", lambda s: s["step_s"]),
    )  # fmt: skip
    acceptance = []
    for name in p.objectives:
        ours = summaries[name]
        extra = " + a reference forward (adapters off, no_grad)" if name in REFERENCE else ""
        kw = {"ours_label": f"--objective {name}, batch {p.pairs_per_rank} pairs{extra}; {shape}",
              "peer_label": peer, "note": note}  # fmt: skip
        made = {}
        for key, figure, unit, value in figures:
            made[key] = row(name.upper(), f"{key}_{name}", f"{name}: {figure}", unit, "lower",
                            [value(s) for s in ours], [value(s) for s in sft], **kw)  # fmt: skip
            rows.append(made[key])
        identical = all(o["param_bytes_per_rank"] == s["param_bytes_per_rank"] for o, s in zip(ours, sft, strict=True))
        bar = PEAK_BAR if name == "dpo" else None
        ratios = {m: made[f"{m}_peak_growth_bytes" if m == "rss" else "tensor_peak_bytes"]["ratio"] for m in PEAKS}
        acceptance.append({
            "objective": name,
            "param_bytes_identical": identical,
            "peak_ratio": ratios,
            "peak_bar": bar,
            "passed": identical and (bar is None or all(r <= bar for r in ratios.values())),
        })  # fmt: skip
    return {"acceptance": acceptance, "summaries": summaries}


def render_preference(results: dict[str, Any]) -> str:
    """report.render's tables, then the acceptance checks, the model and data, and the launches."""
    lines = [render(results).rstrip("\n")]
    details = results.get("details", {})
    if details.get("acceptance"):
        lines += ["", "### Acceptance", ""]
        for a in details["acceptance"]:
            same = "identical to" if a["param_bytes_identical"] else "DIFFERENT from"
            r = a["peak_ratio"]
            bar = f" (bar {a['peak_bar']:.2f}x: {'pass' if a['passed'] else 'FAIL'})" if a["peak_bar"] else ""
            lines.append(f"- {a['objective']}: parameter bytes per rank {same} SFT's; step peak / SFT's: RSS "
                         f"{r['rss']:.3f}x, tensor bytes {r['tensor']:.3f}x{bar}.")  # fmt: skip
    data, s = results.get("data"), results.get("settings", {})
    if data:
        lines += ["", "### Data and measures", "",
                  f"- {data['pairs']} pairs, every prompt {data['prompt_tokens']} tokens (alpaca-framed), every reply "
                  f"{data['reply_tokens']} + EOS: sequences of {data['sequence_tokens']} tokens, no padding; the SFT "
                  f"file holds the {data['sft_rows']} sides as prompt/completion rows ({data['words']}).",
                  f"- Step peaks: {s.get('peaks', '')}."]  # fmt: skip
        base = [b for v in details.get("summaries", {}).values() for x in v for b in x["baseline_rss_bytes"]]
        if base:
            lines.append(f"- RSS just before step 1: {fmt(min(base), 'bytes')} to {fmt(max(base), 'bytes')} per rank.")
    lines += launches_markdown(results)
    return "\n".join(lines) + "\n"
