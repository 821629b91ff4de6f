"""The preference suite (--suite cpu-preference): a preference step's memory and time against SFT's, same tokens.

The issue's acceptance: resident parameter bytes per rank identical to SFT's on the same model, and a DPO step's
peak at most 1.15x an SFT step's over the same tokens (chosen and rejected together). Each run is our real CLI on
2 ranks (`torchrun train.py --quant bnb`, FSDP2, gradient checkpointing at its default), in a job of its own:

- DPO (`--objective dpo`, and IPO, ORPO, SimPO beside it) at `--batch_size B` pairs per rank, i.e. 2B sequences in
  one forward, plus DPO's and IPO's reference forward (adapters off, no_grad);
- SFT at `--batch_size 2B` rows on a prompt/completion file whose rows are those very sequences (each pair's chosen
  and rejected sides), so every step trains the same tokens: checked on metrics.jsonl's `tokens`/`label_tokens`.

Every prompt and every reply has one fixed token count (the model's own tokenizer, checked row by row), and the
sequences are a multiple of 8 tokens, so no batch has padding and both objectives see batches of the same shape.

A step's peak on a CPU: the largest RSS during the step less the RSS just before the first step, per rank
(benchmarks/step_probe.py resets VmHWM there and after every step), the largest over steps and ranks. Step time:
a step's tokens / tokens_per_s, the median over the steps after the first. Each figure stands beside SFT's from the
same repetition (the peer column); the objectives' order alternates between repetitions.
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

from benchmarks.common import REPO_ROOT, base_env, median, read_json
from benchmarks.cpu_suite import (
    CpuPlan,
    LaunchSettings,
    Runner,
    _parameters,
    ensure_model,
    launch_conditions,
    launches_markdown,
)
from benchmarks.data_suite import _shell
from benchmarks.report import fmt, render
from benchmarks.rows import row

OBJECTIVES = ("dpo", "ipo", "orpo", "simpo")
"""The preference objectives the suite can run; each is compared with the same SFT run."""
REFERENCE = ("dpo", "ipo")
"""Those with a reference forward in every step."""
PEAK_BAR = 1.15
"""The issue's bound on a DPO step's peak over an SFT step's."""
WORD_SOURCE = REPO_ROOT / "data" / "alpaca_tiny.jsonl"
# A Llama whose activations are a good part of a step's memory on 2 ranks: hidden 512, 8 layers, vocabulary 8192.
FULL_MODEL = dict(hidden_size=512, num_layers=8, intermediate_size=1408, num_heads=8, num_kv_heads=8, vocab_size=8192,
                  num_shards=2)  # fmt: skip
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
    """Tokens of every prompt as the template frames it (--prompt_style alpaca)."""
    reply_tokens: int
    """Tokens of every reply (chosen and rejected alike), before the EOS the trainer appends."""
    steps: int
    objectives: tuple[str, ...] = OBJECTIVES
    skip_steps: int = 1
    """Step time is the median over the steps after these (step 1 holds one-time costs)."""
    nproc: int = 2
    lora_rank: int = 16
    lora_alpha: float = 32.0
    seed: int = 0
    retries: int = field(default=0, kw_only=True)
    """No re-measuring on contention: the byte counts cannot change and the peaks are per-process high-water marks
    that other processes' CPU use does not move; results.md lists every launch with the cores others took."""

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
    """The full suite (hidden 512, 8 layers, 2 ranks x 4 pairs of 512 tokens, the four objectives; about 6 minutes
    on a busy 2-core machine with --reps 1) or the quick one the test runs (cpu_suite's quick model, DPO alone)."""
    if quick:
        p = PreferencePlan(dict(QUICK_MODEL), reps=1, pairs_per_rank=1, prompt_tokens=40, reply_tokens=23, steps=2,
                           objectives=("dpo",), quick=True)  # fmt: skip
        p.idle_wait_s, p.launch_timeout_s = 0.0, 180.0
    else:
        p = PreferencePlan(dict(FULL_MODEL), reps=1, pairs_per_rank=4, prompt_tokens=127, reply_tokens=384, steps=3)
    if objectives is not None:
        unknown = sorted(set(objectives) - set(OBJECTIVES))
        if unknown or not objectives:
            raise ValueError(f"--objectives: choose from {', '.join(OBJECTIVES)} (got {','.join(objectives) or 'nothing'})")
        p.objectives = tuple(dict.fromkeys(objectives))
    if p.sequence_tokens % 8:
        raise ValueError(f"a sequence of {p.sequence_tokens} tokens would be padded to a multiple of 8")
    p.set_launch(threads=threads, precision=precision, idle_wait_s=idle_wait_s)
    if reps is not None:
        p.reps = reps
    return p


# ---------------------------------------------------------------------------------------------------------------
# The data: every prompt and every reply of one token count
# ---------------------------------------------------------------------------------------------------------------


class _Texts:
    """Texts of an exact token count in the model's tokenizer, from the bundled data's words (seeded)."""

    def __init__(self, tokenizer_file: Path, seed: int) -> None:
        from tokenizers import Tokenizer  # the Rust library alone: the harness stays without torch

        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        words: set[str] = set()
        for line in WORD_SOURCE.read_text().splitlines():
            if line.strip():
                for value in json.loads(line).values():
                    words.update(re.findall(r"[A-Za-z]+", str(value)))
        # Words of 1-3 tokens after a space; the text's first word has no space before it.
        self.cost = {w: self.count(" " + w) for w in sorted(words)}
        self.words = [w for w, c in self.cost.items() if 1 <= c <= 3]
        self.ones = [w for w in self.words if self.cost[w] == 1 and self.count(w) == 1]
        if not self.ones:
            raise RuntimeError(f"{tokenizer_file}: no word of the bundled data is one token; cannot fix lengths")
        self.rng = random.Random(seed)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def prefix(self) -> int:
        """Tokens the tokenizer puts before a text of its own accord (formats.special_prefix's probe)."""
        probe = "Hello world"
        return self.count_special(probe) - self.count(probe)

    def count_special(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def text(self, tokens: int, *, frame: Callable[[str], str] = lambda s: s) -> str:
        """Words whose `frame`d text is `tokens` tokens: drawn at random, ended with one-token words, checked."""
        overhead = self.count(frame(self.ones[0])) - 1
        target = tokens - overhead
        if target < 1:
            raise ValueError(f"{tokens} tokens leave no room for a word in the frame ({overhead} tokens)")
        for _ in range(50):
            picked: list[str] = []
            estimate = 0  # words' costs after a space add up (the pre-tokenizer splits at spaces); checked below
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
    """The preference file (prompt/chosen/rejected) and its SFT twin (each side as a prompt/completion row, the
    prompt framed as the preference rows' are), every prompt and reply of the plan's token counts."""
    from qlora_fsdp.data.formats import format_prompt  # torch-free: the templates the trainer frames prompts with

    texts = _Texts(model / "tokenizer.json", plan.seed)
    if texts.prefix():
        raise RuntimeError(f"{model}: the tokenizer adds {texts.prefix()} token(s) of its own; sequence_tokens assumes 0")
    pairs, sft = [], []
    for _ in range(plan.pairs):
        prompt = texts.text(plan.prompt_tokens, frame=format_prompt)
        chosen = texts.text(plan.reply_tokens)
        rejected = chosen
        while rejected == chosen:  # identical pairs are dropped by the loader
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


class PreferenceRunner(Runner):
    """cpu_suite's Runner with this suite's command: train.py on 2 ranks under benchmarks/step_probe.py."""

    def __init__(self, plan: PreferencePlan, work: Path, log: Callable[[str], None]) -> None:
        super().__init__(plan, work, log)
        self.pref_plan = plan

    def train(self, what: str, model: Path, objective: str, dataset: Path, *, batch_size: int) -> dict[str, Any]:
        """One run: metrics.jsonl's records and every rank's per-step peaks (step_probe)."""
        p = self.pref_plan
        out = Path(self.result_path(f"train-{objective}"))
        flags = {
            "model": model, "quant": "bnb", "precision": p.precision, "objective": objective, "dataset": dataset,
            "dataset_cache_dir": self.work / "tokenized", "dataset_num_proc": 1, "context_length": p.sequence_tokens,
            "batch_size": batch_size, "lora_rank": p.lora_rank, "lora_alpha": p.lora_alpha, "lora_dropout": 0.0,
            "lora_target_modules": "all", "max_steps": p.steps, "lr": 1e-5, "seed": p.seed, "log_to": "stdout",
            "save_model": "false", "device": "cpu", "output_dir": out,
        }  # fmt: skip
        args = ["-m", "benchmarks.step_probe", str(REPO_ROOT / "train.py"), *(f"--{k}={v}" for k, v in flags.items())]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={p.nproc}", *args]
        env = base_env(max(1, p.threads // p.nproc))
        probe = f"{out}.steps"
        env["BENCH_STEP_RSS_FILE"] = probe

        def metrics() -> list[dict[str, Any]]:
            path = out / "metrics.jsonl"
            return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []

        def reset() -> None:
            shutil.rmtree(out, ignore_errors=True)
            for r in range(p.nproc):
                Path(f"{probe}.rank{r}.json").unlink(missing_ok=True)

        result = self._go(what, [cmd], [env], reset=reset, finished=lambda: len(metrics()) == p.steps)
        records = metrics()
        if len(records) != p.steps:
            raise RuntimeError(f"{what}: {len(records)} metrics records, expected {p.steps}:\n{result.log}")
        ranks = [read_json(f"{probe}.rank{r}.json") for r in range(p.nproc)]
        for r in ranks:
            if not r["reset"] or r["baseline_rss_bytes"] is None or len(r["steps"]) != p.steps:
                raise RuntimeError(f"{what}: rank {r['rank']}'s peak probe did not measure every step: {r}")
        return {
            "objective": objective,
            "batch_size": batch_size,
            "command": _shell(cmd),
            "wall_s": result.wall_s,
            "foreign_cores": result.foreign_cores,
            "metrics": records,
            "ranks": ranks,
        }


def _growth(run: dict[str, Any]) -> list[list[int]]:
    """Per rank, each step's peak RSS less the RSS just before step 1."""
    return [[s["peak_rss_bytes"] - r["baseline_rss_bytes"] for s in r["steps"]] for r in run["ranks"]]


def _summary(run: dict[str, Any], skip: int) -> dict[str, Any]:
    """A run's figures: resident bytes, the step peak (largest rank, largest step), step time, tokens per step."""
    m = run["metrics"]
    growth = _growth(run)
    return {
        "param_bytes_per_rank": m[0]["param_bytes_per_rank"],
        "peak_growth_bytes": max(max(g) for g in growth),
        "peak_growth_step1_bytes": max(g[0] for g in growth),
        "peak_rss_bytes": max(s["peak_rss_bytes"] for r in run["ranks"] for s in r["steps"]),
        "baseline_rss_bytes": [r["baseline_rss_bytes"] for r in run["ranks"]],
        "step_s": median([x["tokens"] / x["tokens_per_s"] for x in m[skip:]]),
        "tokens": [x["tokens"] for x in m],
        "label_tokens": [x["label_tokens"] for x in m],
    }


def _brief(run: dict[str, Any]) -> dict[str, Any]:
    """A run's record for results.json: the probe's per-rank steps, and of each metrics record what matters here."""
    keep = ("step", "loss", "tokens", "label_tokens", "tokens_per_s", "packing_efficiency", "peak_memory_bytes_per_rank",
            "rewards/accuracies", "rewards/margins")  # fmt: skip
    out = {k: v for k, v in run.items() if k != "metrics"}
    out["steps"] = [{k: x[k] for k in keep if k in x} for x in run["metrics"]]
    out["peak_growth_bytes_per_rank_step"] = _growth(run)
    return out


def _check_tokens(plan: PreferencePlan, runs: dict[str, dict[str, Any]]) -> None:
    """Every run trained the same tokens at every step, unpadded: 2B sequences of sequence_tokens per rank."""
    p = plan
    expected = p.nproc * 2 * p.pairs_per_rank * p.sequence_tokens
    expected_labels = p.nproc * 2 * p.pairs_per_rank * (p.reply_tokens + 1)
    for name, run in runs.items():
        s = _summary(run, p.skip_steps)
        if set(s["tokens"]) != {expected} or set(s["label_tokens"]) != {expected_labels}:
            raise RuntimeError(f"{name}: tokens {s['tokens']} / label tokens {s['label_tokens']} per step, expected "
                               f"{expected} / {expected_labels} at every step")  # fmt: skip
        if any(x["packing_efficiency"] != 1.0 for x in run["metrics"]):
            raise RuntimeError(f"{name}: padded batches ({[x['packing_efficiency'] for x in run['metrics']]})")


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
    rows: list[dict[str, Any]] = []
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
            _check_tokens(p, {name: r[rep] for name, r in runs.items()})
        launches = runner.launches
    details = _rows(p, runs, rows)
    return {
        "suite": "cpu-preference",
        "quick": p.quick,
        "model": {"path": str(model), "parameters": _parameters(model), "shards": len(list(model.glob("*.safetensors"))),
                  "sizes": p.model},  # fmt: skip
        "data": {k: v for k, v in data.items() if k != "files"},
        "settings": {
            **asdict(p),
            "sequence_tokens": p.sequence_tokens,
            "pairs": p.pairs,
            "training": f"torchrun --nproc_per_node {p.nproc} train.py --quant bnb --precision {p.precision}, FSDP2 "
            f"full_shard, gradient checkpointing (the default), LoRA r{p.lora_rank} on every linear but the head, "
            f"--max_steps {p.steps}; objectives' own settings at their defaults",
            "threads": f"OMP_NUM_THREADS={max(1, p.threads // p.nproc)} per rank",
            "peak": "per rank, the largest RSS during a step (VmHWM reset before step 1 and after each step by "
            "benchmarks/step_probe.py) less the RSS just before step 1; the largest over steps and ranks",
        },
        "rows": rows,
        "details": {**details, "runs": {k: [_brief(r) for r in v] for k, v in runs.items()}},
        "conditions": {"build_model_s": round(build_s, 1), **launch_conditions(launches)},
        "wall_time_s": time.perf_counter() - suite_start,
    }


def _rows(p: PreferencePlan, runs: dict[str, list[dict[str, Any]]], rows: list) -> dict[str, Any]:
    """Each objective's rows against SFT's; returns the acceptance record and each run's summary."""
    summaries = {k: [_summary(r, p.skip_steps) for r in v] for k, v in runs.items()}
    sft = summaries["sft"]
    shape = (f"{p.nproc} ranks, FSDP2, bnb, {p.precision}, gradient checkpointing; per rank {p.pairs_per_rank} "
             f"pairs = {2 * p.pairs_per_rank} sequences of {p.sequence_tokens} tokens a step")  # fmt: skip
    peer = f"--objective sft, batch {2 * p.pairs_per_rank} rows: the same sequences as prompt/completion rows"
    note = (f"peak: largest RSS during a step less the RSS before step 1, largest rank and step; step time: median "
            f"of steps {p.skip_steps + 1}-{p.steps}; {p.reps} repetition(s), medians")  # fmt: skip
    acceptance = []
    for name in p.objectives:
        ours = summaries[name]
        extra = " + reference forward (adapters off, no_grad)" if name in REFERENCE else ""
        kw = {"ours_label": f"--objective {name}, batch {p.pairs_per_rank} pairs{extra}; {shape}", "peer_label": peer,
              "note": note}  # fmt: skip
        sec = name.upper()
        rows.append(row(sec, f"param_bytes_per_rank_{name}", f"{name}: resident parameter bytes per rank (largest)",
                        "bytes", "lower", [max(s["param_bytes_per_rank"]) for s in ours],
                        [max(s["param_bytes_per_rank"]) for s in sft], **kw))  # fmt: skip
        rows.append(row(sec, f"step_peak_growth_{name}_bytes", f"{name}: a step's peak RSS over the RSS before step 1",
                        "bytes", "lower", [s["peak_growth_bytes"] for s in ours], [s["peak_growth_bytes"] for s in sft],
                        **kw))  # fmt: skip
        rows.append(row(sec, f"step_peak_rss_{name}_bytes", f"{name}: a step's peak RSS (whole process)", "bytes",
                        "lower", [s["peak_rss_bytes"] for s in ours], [s["peak_rss_bytes"] for s in sft],
                        **kw))  # fmt: skip
        rows.append(row(sec, f"step_time_s_{name}", f"{name}: seconds per step, steps {p.skip_steps + 1}-{p.steps}",
                        "s", "lower", [s["step_s"] for s in ours], [s["step_s"] for s in sft], **kw))  # fmt: skip
        same = all(o["param_bytes_per_rank"] == s["param_bytes_per_rank"] for o, s in zip(ours, sft, strict=True))
        peak_ratio = rows[-3]["ratio"]
        acceptance.append({
            "objective": name,
            "param_bytes_identical": same,
            "peak_ratio": peak_ratio,
            "peak_bar": PEAK_BAR if name == "dpo" else None,
            "passed": same and (peak_ratio <= PEAK_BAR if name == "dpo" else True),
        })  # fmt: skip
    return {"acceptance": acceptance, "summaries": summaries}


def render_preference(results: dict[str, Any]) -> str:
    """report.render's tables, then the acceptance checks, the model and data, and the launches."""
    lines = [render(results).rstrip("\n")]
    details = results.get("details", {})
    if details.get("acceptance"):
        lines += ["", "### Acceptance", ""]
        for a in details["acceptance"]:
            bar = f" (bar {a['peak_bar']:.2f}x: {'pass' if a['passed'] else 'FAIL'})" if a["peak_bar"] else ""
            lines.append(f"- {a['objective']}: parameter bytes per rank {'identical to' if a['param_bytes_identical'] else 'DIFFERENT from'} "
                         f"SFT's; step peak {a['peak_ratio']:.3f}x SFT's{bar}.")  # fmt: skip
    model, data, s = results.get("model"), results.get("data"), results.get("settings", {})
    if model and data:
        m = model["sizes"]
        lines += ["", "### Model and data", "",
                  f"- Random Llama (scripts/make_tiny_model.py): hidden {m['hidden_size']}, {m['num_layers']} layers, "
                  f"intermediate {m['intermediate_size']}, {m['num_heads']} heads, vocabulary {m['vocab_size']}.",
                  f"- {data['pairs']} pairs, every prompt {data['prompt_tokens']} tokens (alpaca-framed), every reply "
                  f"{data['reply_tokens']} + EOS: sequences of {data['sequence_tokens']} tokens, no padding; the SFT "
                  f"file holds the {data['sft_rows']} sides as prompt/completion rows ({data['words']}).",
                  f"- {s.get('training', '')}.", f"- Peak: {s.get('peak', '')}."]  # fmt: skip
        base = [b for runs in details.get("summaries", {}).values() for r in runs for b in r["baseline_rss_bytes"]]
        if base:
            lines.append(f"- RSS just before step 1: {fmt(min(base), 'bytes')} to {fmt(max(base), 'bytes')} per rank.")
    lines += launches_markdown(results)
    return "\n".join(lines) + "\n"
