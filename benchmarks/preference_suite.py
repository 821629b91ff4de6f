"""The preference suite (--suite cpu-preference): a DPO/IPO/ORPO/SimPO step's parameter bytes, step peaks (RSS and
profiled tensor bytes) and step time against SFT over the very same sequences, 2 ranks, every prompt and reply of a
fixed token count so no batch is padded. The issue's bar: a DPO step's peak at most 1.15x SFT's.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import harness, report
from benchmarks.harness import Runner, Settings, alternating, brief, keyed_rows, llama, median
from benchmarks.report import fmt

OBJECTIVES = ("dpo", "ipo", "orpo", "simpo")
"""The preference objectives the suite can run; each is compared with the same repetition's SFT run."""
REFERENCE = ("dpo", "ipo")
"""Those with a reference forward in every step."""
PEAK_BAR = 1.15
"""The issue's bound on a DPO step's peak over an SFT step's."""
PEAKS = ("rss", "tensor")
FULL_MODEL = llama(512, 8, 1408, 8, 8, 8192, 2)
"""34M parameters: at 2 ranks x 8 sequences of 384 tokens a step's tensors are mostly activations and logits."""
KEEP = ("step", "loss", "tokens", "label_tokens", "tokens_per_s", "packing_efficiency", "peak_memory_bytes_per_rank",
        "rewards/accuracies", "rewards/margins")  # fmt: skip


@dataclass
class PreferencePlan(Settings):
    model: dict[str, int]
    reps: int
    pairs_per_rank: int
    """--batch_size of the preference runs (B pairs: 2B sequences); SFT runs 2B rows."""
    prompt_tokens: int
    """Tokens of every prompt as the template frames it (--prompt_style alpaca, the default)."""
    reply_tokens: int
    """Tokens of every reply (chosen and rejected alike), before the EOS the trainer appends."""
    steps: int
    """Steps 1 to steps-1 give the RSS peak, 2 to steps-1 the step time, the last the tensor peak (profiled)."""
    objectives: tuple[str, ...] = OBJECTIVES
    nproc: int = 2
    seed: int = 0

    @property
    def sequence_tokens(self) -> int:
        """Prompt + reply + EOS (the tokenizer adds no BOS of its own: checked when writing data)."""
        return self.prompt_tokens + self.reply_tokens + 1

    @property
    def pairs(self) -> int:
        """Pairs in the file: one epoch of the run, so SFT trains every sequence DPO does."""
        return self.nproc * self.pairs_per_rank * self.steps

    def check(self) -> None:
        """Unpadded batches, and a step on each side of every measure."""
        if self.sequence_tokens % 8:
            raise ValueError(f"a sequence of {self.sequence_tokens} tokens would be padded to a multiple of 8")
        if self.steps < 3:
            raise ValueError("--max_steps must be >= 3: step 1 (one-time costs), a timed step, the profiled last step")


def plan(*, quick: bool, objectives: tuple[str, ...] | None = None, **launch: Any) -> PreferencePlan:
    """The full suite (34M model, 4 objectives) or the quick one (DPO alone); peaks are memory: no retry."""
    p = (PreferencePlan(dict(harness.QUICK_MODEL), reps=1, pairs_per_rank=1, prompt_tokens=40, reply_tokens=23,
                        steps=3, objectives=("dpo",), quick=True, launch_timeout_s=180.0) if quick else
         PreferencePlan(dict(FULL_MODEL), reps=1, pairs_per_rank=4, prompt_tokens=95, reply_tokens=288, steps=4,
                        retries=0))  # fmt: skip
    if objectives is not None:
        p.objectives = harness.choose("--objectives", objectives, OBJECTIVES)
    return p.configure(**launch)


class Texts:
    """Texts of an exact token count in the model's tokenizer, from the bundled data's words (seeded)."""

    def __init__(self, tokenizer_file: Path, seed: int) -> None:
        self.tokenizer, self.cost = harness.word_tokens(tokenizer_file)
        self.words = [w for w, c in self.cost.items() if 1 <= c <= 3]
        self.ones = [w for w in self.words if self.cost[w] == 1 and self.count(w) == 1]
        if not self.ones:
            raise RuntimeError(f"{tokenizer_file}: no word of the bundled data is one token; cannot fix lengths")
        self.rng = random.Random(seed)

    def count(self, text: str, *, special: bool = False) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=special).ids)

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
            if self.count(frame(" ".join(picked))) == tokens:
                return " ".join(picked)
        raise RuntimeError(f"no text of exactly {tokens} tokens in 50 draws")


def write_datasets(plan: PreferencePlan, model: Path, out: Path) -> dict[str, Any]:
    """The preference file and its SFT twin (each side a prompt/completion row, prompts framed alike)."""
    from qlora_fsdp.data.formats import format_prompt  # torch-free: the template the trainer frames prompts with

    texts = Texts(model / "tokenizer.json", plan.seed)
    if prefix := texts.count("Hello world", special=True) - texts.count("Hello world"):
        raise RuntimeError(f"{model}: the tokenizer adds {prefix} token(s) itself; sequence_tokens counts 0")
    pairs, sft = [], []
    for _ in range(plan.pairs):
        prompt = texts.text(plan.prompt_tokens, frame=format_prompt)
        chosen = rejected = texts.text(plan.reply_tokens)
        while rejected == chosen:  # the loader drops identical pairs
            rejected = texts.text(plan.reply_tokens)
        pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
        sft += [{"prompt": format_prompt(prompt), "completion": side} for side in (chosen, rejected)]
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("pairs", pairs), ("sft", sft)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"pairs": len(pairs), "sft_rows": len(sft), "prompt_tokens": plan.prompt_tokens,
            "reply_tokens": plan.reply_tokens, "sequence_tokens": plan.sequence_tokens,
            "files": {k: str(out / f"{k}.jsonl") for k in ("pairs", "sft")},
            "words": f"{len(texts.words)} words of data/alpaca_tiny.jsonl (1-3 tokens each), seed {plan.seed}",
            }  # fmt: skip


def rss_growth(run: dict[str, Any]) -> list[list[int]]:
    """Per rank, each step's peak RSS less the RSS just before step 1 (the profiled last step included)."""
    return [[s["peak_rss_bytes"] - r["baseline_rss_bytes"] for s in r["steps"]] for r in run["ranks"]]


def summary(run: dict[str, Any], steps: int) -> dict[str, Any]:
    """A run's resident bytes, step peaks, step time (steps 2 to S-1) and every step's tokens."""
    m = run["metrics"]
    return {"param_bytes_per_rank": m[0]["param_bytes_per_rank"], **harness.step_peaks(run, steps),
            "rss_peak_growth_step1_bytes": max(g[0] for g in rss_growth(run)),
            "baseline_rss_bytes": [r["baseline_rss_bytes"] for r in run["ranks"]],
            "step_s": median([x["tokens"] / x["tokens_per_s"] for x in m[1 : steps - 1]]),
            "tokens": [x["tokens"] for x in m], "label_tokens": [x["label_tokens"] for x in m]}  # fmt: skip


def train(runner: Runner, model: Path, name: str, data: dict[str, Any], rep: int) -> dict[str, Any]:
    """One 2-rank run of an objective (SFT: the same sequences as rows); every step checked full and unpadded."""
    p, sft = runner.plan, name == "sft"
    batch, sequences = (2 if sft else 1) * p.pairs_per_rank, p.nproc * 2 * p.pairs_per_rank
    what = f"{name} x{p.nproc} ranks, batch {batch} {'rows' if sft else 'pairs'} (rep {rep + 1})"
    run = runner.profiled(what, f"train-{name}", nproc=p.nproc, steps=p.steps, model=model, objective=name,
                          dataset=data["files"]["sft" if sft else "pairs"], context_length=p.sequence_tokens,
                          batch_size=batch, seed=p.seed,
                          fills=(sequences * p.sequence_tokens, sequences * (p.reply_tokens + 1), 1.0))  # fmt: skip
    return {"objective": name, "batch_size": batch, **run}


def run(p: PreferencePlan, *, cache: Path, model: Path | None = None) -> dict[str, Any]:
    with harness.session(p, "pref") as runner:
        model_dir = runner.model(p.model, cache)
        data = write_datasets(p, model_dir, runner.work / "data")
        print(f"{p.reps} x SFT and {', '.join(p.objectives)}: {p.nproc} ranks x {p.pairs_per_rank} pairs "
              f"({2 * p.pairs_per_rank} sequences) of {p.sequence_tokens} tokens, {p.steps} steps")  # fmt: skip
        runs = alternating(p.reps, ("sft", *p.objectives), lambda name, rep: train(runner, model_dir, name, data, rep))
        rows, details = _rows(p, runs)
        details["runs"] = {k: [{**brief(r, KEEP), "rss_growth_bytes_per_rank_step": rss_growth(r)} for r in v]
                           for k, v in runs.items()}  # fmt: skip
        return runner.results("cpu-preference", rows, details, {
            "sequence_tokens": p.sequence_tokens, "pairs": p.pairs,
            "our_training": f"torchrun --nproc_per_node {p.nproc} train.py --quant bnb, FSDP2 full_shard, gradient "
                            f"checkpointing (the default), LoRA r{p.lora_rank} on every linear but the head, "
                            f"--max_steps {p.steps} (--profile true on step {p.steps}), each objective's settings at "
                            "their defaults",
            "peaks": f"RSS: per rank, the largest RSS during a step less the RSS just before step 1 (VmHWM reset "
                     f"there and after every step by benchmarks/probe.py), largest of steps 1-{p.steps - 1} and of "
                     f"the ranks; tensor bytes: the largest 'Total Allocated' of the profiler's CPU memory events "
                     f"over step {p.steps}, largest rank",
        }, model=harness.model_record(model_dir, p.model),
           data={k: v for k, v in data.items() if k != "files"})  # fmt: skip


def _rows(p: PreferencePlan, runs: dict[str, list[dict[str, Any]]]) -> tuple[list[dict], dict[str, Any]]:
    """Each objective's rows against SFT's, and the acceptance record and every run's summary."""
    summaries = {k: [summary(r, p.steps) for r in v] for k, v in runs.items()}
    # The figures by row key: the largest rank's parameter bytes, the step time under its row's name.
    flat = {k: [{**s, "param_bytes_per_rank": max(s["param_bytes_per_rank"]), "step_time_s": s["step_s"]} for s in v]
            for k, v in summaries.items()}  # fmt: skip
    shape = (f"{p.nproc} ranks, FSDP2, bnb, {p.precision}, gradient checkpointing; per rank {p.pairs_per_rank} "
             f"pairs = {2 * p.pairs_per_rank} sequences of {p.sequence_tokens} tokens a step")  # fmt: skip
    last = p.steps - 1
    figures = (
        ("param_bytes_per_rank", "resident parameter bytes per rank (largest rank)", "bytes", "lower"),
        ("rss_peak_growth_bytes", "a step's peak RSS less the RSS before step 1", "bytes", "lower"),
        ("tensor_peak_bytes", "a step's peak of live tensor bytes above the step's start", "bytes", "lower"),
        ("peak_rss_bytes", "a step's peak RSS, whole process", "bytes", "lower"),
        ("step_time_s", f"seconds per step, steps 2-{last}", "s", "lower"),
    )
    rows, acceptance = [], []
    for name in p.objectives:
        ours, sft = summaries[name], summaries["sft"]
        extra = " + a reference forward (adapters off, no_grad)" if name in REFERENCE else ""
        kw = {"ours_label": f"--objective {name}, batch {p.pairs_per_rank} pairs{extra}; {shape}",
              "peer_label": f"--objective sft, batch {2 * p.pairs_per_rank} rows: the same sequences as "
                            "prompt/completion rows",
              "note": f"RSS peak: steps 1-{last}; tensor peak: step {p.steps} (profiled); step time: median of steps "
                      f"2-{last}; {p.reps} repetition(s), medians"}  # fmt: skip
        made = keyed_rows(name.upper(), figures, flat[name], flat["sft"], suffix=f"_{name}", prefix=f"{name}: ", **kw)
        rows += made.values()
        identical = all(o["param_bytes_per_rank"] == s["param_bytes_per_rank"] for o, s in zip(ours, sft, strict=True))
        bar = PEAK_BAR if name == "dpo" else None
        ratios = {"rss": made["rss_peak_growth_bytes"]["ratio"], "tensor": made["tensor_peak_bytes"]["ratio"]}
        passed = identical and (bar is None or all(r <= bar for r in ratios.values()))
        acceptance.append({"objective": name, "param_bytes_identical": identical, "peak_ratio": ratios,
                           "peak_bar": bar, "passed": passed})  # fmt: skip
    return rows, {"acceptance": acceptance, "summaries": summaries}


def render(results: dict[str, Any]) -> str:
    """The tables, then the acceptance checks, the data and the measures."""
    details, data, s = results.get("details", {}), results.get("data"), results.get("settings", {})
    lines = report.acceptance("Acceptance", [
        f"- {a['objective']}: parameter bytes per rank "
        f"{'identical to' if a['param_bytes_identical'] else 'DIFFERENT from'} SFT's; step peak / SFT's: RSS "
        f"{a['peak_ratio']['rss']:.3f}x, tensor bytes {a['peak_ratio']['tensor']:.3f}x"
        + (f" (bar {a['peak_bar']:.2f}x: {report.verdict(a['passed'])})" if a["peak_bar"] else "") + "."
        for a in details.get("acceptance") or []])  # fmt: skip
    if data:
        lines += ["", "### Data and measures", "",
                  f"- {data['pairs']} pairs, every prompt {data['prompt_tokens']} tokens (alpaca-framed), every reply "
                  f"{data['reply_tokens']} + EOS: sequences of {data['sequence_tokens']} tokens, no padding; the SFT "
                  f"file holds the {data['sft_rows']} sides as prompt/completion rows ({data['words']}).",
                  f"- Step peaks: {s.get('peaks', '')}."]  # fmt: skip
        if base := [b for v in details.get("summaries", {}).values() for x in v for b in x["baseline_rss_bytes"]]:
            lines.append(f"- RSS just before step 1: {fmt(min(base), 'bytes')} to {fmt(max(base), 'bytes')} per rank.")
    return report.render(results, lines)
