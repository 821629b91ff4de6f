"""GRPO: completions sampled from the model being trained and scored by reward functions, and the policy loss on them,
as TRL's GRPOTrainer computes both.

Before a micro-batch's forward, `prepare` turns its prompts into a batch of completions (Rollout): --num_generations per
prompt, sampled through the sharded model or with its weights gathered first (qlora_fsdp.objectives.sampling), scored by
the reward functions (objectives/rewards.py), their weighted sum compared within each prompt's group: advantage =
(reward - the group's mean) / (the group's, or the whole batch's over every rank, standard deviation + 1e-4), or not
divided (--scale_rewards none); a completion no function scored has advantage 0. Each rank samples whole groups.

The loss's batch holds completions (prompt then completion, the completion's tokens labelled), each with its
advantage, and optionally the per-token log-probs the completion was sampled under (`old_logps`, when a generation
serves several steps) and the reference's (`ref_logps`, computed once per generation; without them the reference
forward runs here, the model with its adapters off). With the ratio c = pi / pi_old per token:
- grpo, bnpo, dr_grpo, dapo: -min(c x A, clip(c, 1 - epsilon, 1 + epsilon_high) x A);
- cispo: -min(c, epsilon_high) x A x log pi, the clipped ratio without gradient;
plus beta x c x (exp(ref - log pi) - (ref - log pi) - 1) when beta > 0: the k3 estimate of the KL to the reference,
weighted by the ratio as TRL does by default (use_bias_correction_kl: the unbiased reverse-KL gradient; the ratio
is differentiable, so this changes the gradient even where it is 1).

How the per-token losses add up (TRL's, made exact across ranks): grpo averages each completion's tokens, then the
completions; dr_grpo sums tokens and divides by the completions x --max_completion_length; bnpo, dapo and cispo divide
the tokens' sum by the step's completion tokens over every rank (TRL's bnpo divides each rank's micro-batch by its own;
its dapo and cispo by the whole step's, as here). Each is a sum divided by a count of the whole step, so N ranks x batch
B equal 1 rank x batch N*B.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from qlora_fsdp.data import IGNORE_INDEX, target_mask
from qlora_fsdp.data.formats import pad_token_id
from qlora_fsdp.data.prompts import PROMPT_INDEX, Prompt, prompt_loader
from qlora_fsdp.data.rows import collate
from qlora_fsdp.errors import UserError
from qlora_fsdp.objectives.base import Forward, Objective
from qlora_fsdp.objectives.loss import LossRequest, Reduction
from qlora_fsdp.objectives.reference import reference_logps
from qlora_fsdp.objectives.rewards import Reward, load_rewards, score
from qlora_fsdp.objectives.sampling import Sampled, SamplingParams, sample
from qlora_fsdp.objectives.setup import ObjectiveRun, Setting, Setup, Trainee
from qlora_fsdp.objectives.specs import GRPO_LOSS_TYPES, ObjectiveSpec
from qlora_fsdp.parallel.distributed import DistEnv

COMPLETIONS_FILE = "completions.jsonl"
ADVANTAGES, OLD_LOGPS, REF_LOGPS = "advantages", "old_logps", "ref_logps"
"""A batch's keys: [rows] advantages; [rows, width - 1] per-token log-probs aligned with labels[:, 1:]."""
REWARDS, TRUNCATED, ZERO_STD, SAMPLING_S, ENTROPY = "rewards", "truncated", "zero_std", "sampling_s", "entropy"
"""A sampled batch's keys: [rows, functions] rewards (NaN: not scored); [rows] completions that hit the length
limit; [rows] completions whose group's (or batch's) rewards did not vary; [] the seconds its sampling took; [rows]
the sum of each completion's per-token entropies of the distribution it was sampled from."""
_SUMS = ("tokens", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
_EXTREMES = ("micro_batches", "clip_ratio/low_min", "clip_ratio/high_max")
"""Per micro-batch, the least low-clipped and the most high-clipped completion of every rank's (each rank adds the
same value, so their sum over ranks and micro-batches divided by micro_batches' is TRL's mean over micro-batches)."""
_ROLLOUT_SUMS = ("rows", "length", "clipped", "zero_std", "sampling_s", "entropy", "reward_sum", "reward_sq",
                 "reward_n")  # fmt: skip


@dataclass(frozen=True)
class RolloutSettings:
    """The flags' part of a rollout: how many completions each prompt gets, how they are drawn, how their rewards
    become advantages and how long a generation serves."""

    sampling: SamplingParams
    num_generations: int
    """Completions per prompt: a group, whose rewards are compared with each other."""
    seed: int
    """The run's seed; each completion's generator is seeded from it, the step, the prompt and the completion's
    number."""
    context_length: int
    """--context_length: a batch of prompts with their completions is padded to its longest row, not beyond it."""
    scale_rewards: str = "group"
    """Advantages divided by the group's reward standard deviation, the batch's ("batch"), or not ("none")."""
    num_iterations: int = 1
    """Optimizer steps each generation serves: steps 1, 1 + n, 1 + 2n... sample; the steps between reuse their
    completions (the loader repeats their prompts), with the log-probs the policy gave them when they were sampled."""


@dataclass(frozen=True)
class Rollout:
    """What sampling and scoring a batch of prompts takes: the settings, and what the run builds for them."""

    settings: RolloutSettings
    prompts: list[Prompt]
    """The dataset's prompts, by the index the loader's batches hold."""
    rewards: list[Reward]
    tokenizer: Any
    """Decodes completions for the reward functions."""
    env: DistEnv
    """Every rank's completions are scored together: a group's advantages compare it with the others' too."""
    on_samples: Callable[[int, list[dict[str, Any]]], None] | None = None
    """Called on every rank with each micro-batch's step and its first group's prompt, completions and rewards."""
    gathered: Callable[[], contextlib.AbstractContextManager] | None = None
    """--generation_mode gathered: holds every unit's full weights while the rank samples on its own; None: sample
    through the sharded model, ranks in lockstep."""

    def metric_names(self) -> tuple[str, ...]:
        per_function = (f"rewards/{r.name}/{part}" for r in self.rewards for part in ("sum", "sq", "n"))
        return (*_ROLLOUT_SUMS, *per_function)


class GrpoObjective(Objective):
    """TRL's metrics, each a mean over the step's completion tokens: `kl` (when beta > 0) and the clip ratios
    (`clip_ratio/low_mean`, `/high_mean`, `/region_mean`; cispo's `cispo_clip_ratio`); TRL's `clip_ratio/low_min` and
    `/high_max`, the least low-clipped and most high-clipped completion of each micro-batch over every rank, averaged
    over micro-batches; with a rollout, TRL's reward and completion metrics, `entropy` (of the distributions the
    completion tokens were sampled from) and `sampling/tokens_per_s`, the completion tokens a rank samples per
    second (every rank's tokens over every rank's seconds of sampling)."""

    metric_names = (*_SUMS, *_EXTREMES)

    def __init__(self, forward: Forward, *, loss_type: str, beta: float, epsilon: float, epsilon_high: float,
                 max_completion_length: int, temperature: float = 1.0,
                 rollout: Rollout | None = None) -> None:  # fmt: skip
        if loss_type not in GRPO_LOSS_TYPES:
            raise ValueError(f"unknown GRPO loss type {loss_type!r}")
        self.forward, self.loss_type, self.beta = forward, loss_type, beta
        self.epsilon, self.epsilon_high, self.max_completion_length = epsilon, epsilon_high, max_completion_length
        self.rollout = rollout
        self.logps = LossRequest(Reduction.TOKENS, temperature=temperature)
        """Each completion token's negative log-prob at the sampling temperature: the forward the ratios compare."""
        self.prepared = 0
        """The last step a micro-batch was prepared for."""
        self.generation: dict[str, Any] = {}
        """With --num_iterations above 1, the current generation: its first step, and per micro-batch its prompts'
        indices and its prepared batch (what `state_dict` saves)."""
        if rollout is not None:
            self.metric_names = (*_SUMS, *_EXTREMES, *rollout.metric_names())

    def prepare(self, model: nn.Module, batch: dict[str, torch.Tensor], *, step: int,
                index: int = 0) -> dict[str, torch.Tensor]:  # fmt: skip
        """A batch of prompt indices -> the batch of their sampled, scored completions, or the completions sampled
        for them at the generation's first step (a batch of completions already, as tests give, stays as it is)."""
        if PROMPT_INDEX not in batch or self.rollout is None:
            return batch
        indices = batch[PROMPT_INDEX].tolist()
        first = step - (step - 1) % self.iterations
        self.prepared = step
        if step != first:
            held = self.generation
            if held.get("step") != first or held["prompts"][index] != indices:
                raise RuntimeError(f"step {step}, micro-batch {index}: no generation of step {first} for prompts "
                                   f"{indices} to reuse")  # fmt: skip
            return {**held["batches"][index], SAMPLING_S: torch.tensor(0.0)}  # nothing sampled at this step
        out = self._sample(model, indices, step)
        if self.iterations > 1:
            out = self._with_logps(model, out)
            if index == 0:
                self.generation = {"step": step, "prompts": [], "batches": []}
            self.generation["prompts"].append(indices)
            self.generation["batches"].append(out)
        return out

    @property
    def iterations(self) -> int:
        """Optimizer steps each generation serves (1 without a rollout)."""
        return self.rollout.settings.num_iterations if self.rollout is not None else 1

    def _with_logps(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch with the policy's per-token log-probs of its completions now, which the steps reusing it
        compare against (`old_logps`), and the reference's (computed once for the generation)."""
        with torch.no_grad():
            old = -self.forward(model, batch, self.logps)
            out = {**batch, OLD_LOGPS: old.float().cpu()}
            if self.beta:
                out[REF_LOGPS] = reference_logps(model, batch, forward=self.forward,
                                                 request=self.logps).float().cpu()  # fmt: skip
        return out

    def state_dict(self) -> dict[str, Any]:
        """The generation later steps will reuse; none once its last step has prepared (a checkpoint at a multiple
        of --num_iterations has no use for it)."""
        held = self.generation and self.prepared < self.generation["step"] + self.iterations - 1
        return dict(self.generation) if held else {}

    def load_state_dict(self, state: dict[str, Any], *, step: int) -> None:
        """A run resumed between the steps of one generation needs that generation back (check_resume_compatible
        has refused a layout other than the one that saved it)."""
        n = self.iterations
        if step % n == 0:
            return
        if state.get("step") != step + 1 - step % n:
            raise RuntimeError(f"the checkpoint of step {step} holds no generation of step {step + 1 - step % n}")
        self.generation, self.prepared = state, step

    def _sample(self, model: nn.Module, indices: list[int], step: int) -> dict[str, torch.Tensor]:
        """Sample, score and collate the completions of these prompts."""
        r = self.rollout
        assert r is not None
        settings, group = r.settings, r.settings.num_generations
        prompts = [r.prompts[i] for i in indices for _ in range(group)]
        started = time.perf_counter()
        seeds = [_seed(settings.seed, step, i, k) for i in indices for k in range(group)]
        sampled = self.draw(model, [p.ids for p in prompts], seeds=seeds)
        sampling_s = time.perf_counter() - started
        texts = r.tokenizer.batch_decode(sampled.completions, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] if p.conversational else t
                       for p, t in zip(prompts, texts, strict=True)]  # fmt: skip
        keys = sorted({key for p in prompts for key in p.columns})
        per_function = score(r.rewards, prompts=[p.text for p in prompts], completions=completions,
                             completion_ids=sampled.completions,
                             columns={key: [p.columns.get(key) for p in prompts] for key in keys},
                             step=step, env=r.env)  # fmt: skip
        weights = torch.tensor([reward.weight for reward in r.rewards], dtype=torch.float64)
        advantages, zero_std = group_advantages(per_function, weights, group, settings.scale_rewards,
                                                env=r.env)  # fmt: skip
        if r.on_samples is not None:
            names = [reward.name for reward in r.rewards]
            first = zip(prompts[:group], completions, per_function.tolist(), strict=False)
            r.on_samples(step, [{"prompt": p.text, "completion": c, "rewards": {
                name: None if math.isnan(v) else v for name, v in zip(names, row, strict=True)}}
                for p, c, row in first])  # fmt: skip
        items = [{"input_ids": p.ids + c, "labels": [IGNORE_INDEX] * len(p.ids) + c}
                 for p, c in zip(prompts, sampled.completions, strict=True)]  # fmt: skip
        out = collate(items, pad_id=settings.sampling.pad_id, context_length=settings.context_length,
                      pad_to_context=False)  # fmt: skip
        return out | {ADVANTAGES: advantages.float(), REWARDS: per_function, ZERO_STD: zero_std,
                      TRUNCATED: torch.tensor(sampled.truncated), SAMPLING_S: torch.tensor(sampling_s),
                      ENTROPY: torch.tensor([sum(row) for row in sampled.entropies], dtype=torch.float64)}  # fmt: skip

    def draw(self, model: nn.Module, prompts: list[list[int]], *, seeds: list[int]) -> Sampled:
        """The completions of `prompts` (token ids, each prompt once per completion, a group's in a row), row i drawn
        from the model being trained with a generator seeded by `seeds[i]`. Where completions come from, and only
        that: a subclass may return others (tests/plugins/fixed_grpo.py holds them fixed to compare whole runs with
        TRL's), and scoring, advantages and the loss stay as they are."""
        r = self.rollout
        assert r is not None
        with contextlib.nullcontext() if r.gathered is None else r.gathered():
            return sample(model, prompts, params=r.settings.sampling, device=self.forward.device,
                          autocast=self.forward.autocast, seeds=seeds, lockstep=r.gathered is None)  # fmt: skip

    def weights(self, batch: dict[str, torch.Tensor]) -> tuple[int, ...]:
        if self.loss_type in ("grpo", "dr_grpo"):
            return (batch["input_ids"].shape[0],)
        return (int(target_mask(batch["labels"]).sum()),)

    def loss_sum(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.forward.device
        mask = target_mask(batch["labels"]).to(device)
        logps = -self.forward(model, batch, self.logps)
        old = batch[OLD_LOGPS].to(device) if OLD_LOGPS in batch else logps.detach()
        advantages = batch[ADVANTAGES].to(device)[:, None]
        ratio = torch.exp(logps - old)
        if self.loss_type == "cispo":
            per_token = -torch.clamp(ratio, max=self.epsilon_high).detach() * advantages * logps
        else:
            clipped = torch.clamp(ratio, 1 - self.epsilon, 1 + self.epsilon_high)
            per_token = -torch.min(ratio * advantages, clipped * advantages)
        kl = torch.zeros_like(logps)
        if self.beta:
            reference = batch[REF_LOGPS].to(device) if REF_LOGPS in batch else reference_logps(
                model, batch, forward=self.forward, request=self.logps)  # fmt: skip
            gap = reference - logps
            kl = (torch.exp(gap) - gap - 1) * ratio  # TRL's use_bias_correction_kl, its default
            per_token = per_token + self.beta * kl
        summed = (per_token * mask).sum(-1)
        if self.loss_type == "grpo":
            loss = (summed / mask.sum(-1).clamp(min=1)).sum()
        elif self.loss_type == "dr_grpo":
            loss = summed.sum() / self.max_completion_length
        else:
            loss = summed.sum()
        with torch.no_grad():
            if self.loss_type == "cispo":
                low = high = (ratio > self.epsilon_high) & (advantages > 0)
            else:
                low = (ratio < 1 - self.epsilon) & (advantages < 0)
                high = (ratio > 1 + self.epsilon_high) & (advantages > 0)
            columns = (torch.ones_like(kl), kl, low, high, low | high)
            metrics = torch.cat([torch.stack([(column.double() * mask).sum() for column in columns]),
                                 _extremes(low, high, mask)])  # fmt: skip
            if self.rollout is not None:
                metrics = torch.cat([metrics, self._rollout_sums(batch, mask).to(metrics.device)])
        return loss.reshape(1), metrics

    def _rollout_sums(self, batch: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        """The sums TRL's sampling metrics are made of: completions, their tokens, those cut at the length limit,
        those without variation in their group, the seconds sampling took, then the weighted reward's and each
        function's sum, sum of squares and count of scored completions."""
        per_function = batch[REWARDS].double()
        weights = torch.tensor([r.weight for r in self.rollout.rewards], dtype=torch.float64)  # type: ignore[union-attr]
        total = (per_function * weights).nansum(1)
        total[per_function.isnan().all(1)] = math.nan
        parts = [float(len(total)), float(mask.sum()), float(batch[TRUNCATED].sum()), float(batch[ZERO_STD].sum()),
                 float(batch[SAMPLING_S]), float(batch[ENTROPY].sum())]  # fmt: skip
        for column in (total, *per_function.T):
            scored = column[~column.isnan()]
            parts += [float(scored.sum()), float((scored**2).sum()), float(len(scored))]
        return torch.tensor(parts, dtype=torch.float64)

    def logged(self, metric_sums: list[float], weights: list[float]) -> dict[str, float]:
        sums = dict(zip(self.metric_names, metric_sums, strict=True))
        tokens = max(sums["tokens"], 1.0)
        out = {name: sums[name] / tokens for name in _SUMS[1:]}
        out |= {name: sums[name] / max(sums["micro_batches"], 1.0) for name in _EXTREMES[1:]}
        if not self.beta:
            del out["kl"]
        if self.loss_type == "cispo":
            out = {"cispo_clip_ratio": out["clip_ratio/high_mean"], **({"kl": out["kl"]} if self.beta else {})}
        if self.rollout is None:
            return out
        rows = max(sums["rows"], 1.0)
        out |= {"reward": _mean(sums, "reward"), "reward_std": _std(sums, "reward"),
                "completions/mean_length": sums["length"] / rows, "completions/clipped_ratio": sums["clipped"] / rows,
                "frac_reward_zero_std": sums["zero_std"] / rows,
                "entropy": sums["entropy"] / max(sums["length"], 1.0)}  # fmt: skip
        if sums["sampling_s"] > 0:  # not at a step that reuses a generation (--num_iterations)
            out["sampling/tokens_per_s"] = sums["length"] / sums["sampling_s"]
        for reward in self.rollout.rewards:
            key = f"rewards/{reward.name}"
            out |= {f"{key}/mean": _mean(sums, key, "/"), f"{key}/std": _std(sums, key, "/")}
        return out


def group_advantages(per_function: torch.Tensor, weights: torch.Tensor, group: int, scale: str, *,
                     env: DistEnv) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(this rank's advantages, whether each one's group (or batch) had no variation): TRL's, the weighted sum of
    the rewards compared with its group's mean, over every rank's completions (a collective on the rank's
    device)."""
    local = len(per_function)
    everyone = per_function
    if dist.is_initialized():
        sent = per_function.to(env.device)  # NCCL takes CUDA tensors only, the outputs too
        parts = [torch.empty_like(sent) for _ in range(env.world_size)]
        dist.all_gather(parts, sent)
        everyone = torch.cat([p.cpu() for p in parts])
    rewards = (everyone * weights).nansum(1)
    rewards[everyone.isnan().all(1)] = math.nan
    grouped = rewards.view(-1, group)
    mean = grouped.nanmean(1).repeat_interleave(group)
    std = (_nanstd(grouped, dim=1).repeat_interleave(group) if scale != "batch"
           else _nanstd(rewards).expand_as(rewards))  # fmt: skip
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    mine = slice(env.rank * local, (env.rank + 1) * local)
    return torch.nan_to_num(advantages, nan=0.0)[mine], torch.isclose(std, torch.zeros_like(std))[mine]


def _extremes(low: torch.Tensor, high: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[1, the least low-clipped fraction, the most high-clipped fraction] of a completion's tokens over every rank's
    completions of this micro-batch (TRL's clip_ratio/low_min and high_max; a collective where ranks run)."""
    counts = mask.sum(-1).double().clamp(min=1)
    fractions = torch.stack([((low & mask).sum(-1) / counts).min(), -((high & mask).sum(-1) / counts).max()])
    if dist.is_initialized():
        dist.all_reduce(fractions, op=dist.ReduceOp.MIN)
    return torch.cat([fractions.new_ones(1), fractions * fractions.new_tensor([1.0, -1.0])])


def _nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation of the values that are not NaN, with Bessel's correction (NaN for fewer than 2)."""
    mean = values.nanmean(dim=dim, keepdim=True)
    count = (~values.isnan()).sum(dim=dim, keepdim=True)
    variance = ((values - mean) ** 2).nanmean(dim=dim, keepdim=True) * count / (count - 1)
    variance = torch.where(count > 1, variance, math.nan)
    return variance.sqrt().squeeze(dim) if dim is not None else variance.sqrt().reshape(())


def _mean(sums: dict[str, float], key: str, sep: str = "_") -> float:
    n = sums[f"{key}{sep}n"]
    return sums[f"{key}{sep}sum"] / n if n else math.nan


def _std(sums: dict[str, float], key: str, sep: str = "_") -> float:
    """The unbiased standard deviation from a sum, a sum of squares and a count (TRL's nanstd)."""
    n, total, squares = sums[f"{key}{sep}n"], sums[f"{key}{sep}sum"], sums[f"{key}{sep}sq"]
    return math.sqrt(max(squares - total * total / n, 0.0) / (n - 1)) if n > 1 else math.nan


def _seed(seed: int, step: int, prompt: int, k: int) -> int:
    """The generator seed of the k-th completion of a prompt (its dataset index) at a step."""
    digest = hashlib.blake2b(f"{seed}:{step}:{prompt}:{k}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class GrpoRun(ObjectiveRun):
    """Prompts instead of rows, reward functions found before the model loads, and a rollout that samples through
    the sharded model."""

    objective_class: type[GrpoObjective] = GrpoObjective
    """The objective `build` makes: a subclass of GrpoObjective may draw its completions otherwise (`draw`)."""

    def __init__(self, spec: ObjectiveSpec, setup: Setup) -> None:
        super().__init__(spec, setup)
        setting = setup.objective.setting
        self.rewards = load_rewards(setting("reward_funcs"), setting("reward_weights"))
        if setup.batching.images is not None:
            raise UserError(f"--objective {spec.name} does not train vision-language models yet")

    @classmethod
    def build(cls, setting: Setting, forward: Forward, *, rollout: Rollout | None = None, **_: object) -> Objective:
        epsilon, high = setting("epsilon"), setting("epsilon_high")
        return cls.objective_class(forward, loss_type=setting("loss_type"), beta=setting("beta"), epsilon=epsilon,
                                   epsilon_high=epsilon if high is None else high,
                                   max_completion_length=setting("max_completion_length"),
                                   temperature=setting("temperature"), rollout=rollout)  # fmt: skip

    def loaders(self) -> tuple[Any, None]:
        s, setting = self.setup, self.setup.objective.setting
        loader = prompt_loader(s.data, s.tokenizer, s.env, seed=s.batching.seed, accumulation=s.batching.accumulation,
                               num_generations=setting("num_generations"),
                               max_completion_length=setting("max_completion_length"),
                               num_iterations=setting("num_iterations"))  # fmt: skip
        return loader, None

    def objective(self, trainee: Trainee, *, training: bool) -> Objective:
        rollout = self._rollout(trainee) if training else None
        return self.build(self.setup.objective.setting, trainee.forward, rollout=rollout)

    def _rollout(self, trainee: Trainee) -> Rollout:
        """The sampling settings; a completion ends at the tokenizer's eos or any the model's generation config
        names (a chat model's end of turn)."""
        from transformers import GenerationConfig

        s, setting = self.setup, self.setup.objective.setting
        ends = {s.tokenizer.eos_token_id}
        try:
            configured = GenerationConfig.from_pretrained(s.model_path).eos_token_id
        except OSError:  # no generation_config.json
            configured = None
        ends |= set(configured if isinstance(configured, list) else [] if configured is None else [configured])
        log = CompletionLog(s.output_dir, resume_step=trainee.resume_step) if s.env.is_main else None
        gathered = trainee.model.gathered if setting("generation_mode") == "gathered" else None
        sampling = SamplingParams(max_new_tokens=setting("max_completion_length"), end_ids=frozenset(ends - {None}),
                                  pad_id=pad_token_id(s.tokenizer), temperature=setting("temperature"),
                                  top_p=setting("top_p"))  # fmt: skip
        settings = RolloutSettings(sampling, num_generations=setting("num_generations"), seed=s.batching.seed,
                                   context_length=s.data.context_length, scale_rewards=setting("scale_rewards"),
                                   num_iterations=setting("num_iterations"))  # fmt: skip
        return Rollout(settings, prompts=trainee.loader.dataset.prompts, rewards=self.rewards, tokenizer=s.tokenizer,
                       env=s.env, on_samples=log, gathered=gathered)  # fmt: skip


class CompletionLog:
    """OUTPUT_DIR/completions.jsonl: a group of completions sampled in each micro-batch, with its prompt and
    rewards, a line each; as with metrics.jsonl, a resumed run keeps the lines up to its checkpoint's step."""

    def __init__(self, output_dir: Path, *, resume_step: int | None) -> None:
        self.path = output_dir / COMPLETIONS_FILE
        kept = []
        if resume_step is not None and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resume_step]  # fmt: skip
        output_dir.mkdir(parents=True, exist_ok=True)
        self.path.write_text("".join(line + "\n" for line in kept))

    def __call__(self, step: int, records: list[dict[str, Any]]) -> None:
        with open(self.path, "a") as fh:
            fh.writelines(json.dumps({"step": step, **record}) + "\n" for record in records)
