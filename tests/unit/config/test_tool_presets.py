"""The presets of another tool's defaults (configs/*-defaults.yaml, docs/coming-from.md): each sets only what differs
from ours, and TRL's is checked against the installed transformers, TRL and PEFT themselves."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from qlora_fsdp.config.options import FLAGS, PER_OBJECTIVE, build_config
from qlora_fsdp.objectives.specs import OBJECTIVES

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
TOOLS = ("trl", "axolotl", "fsdp_qlora")


def _defaults(cls: type) -> dict[str, object]:
    return {f.name: f.default for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("tool", TOOLS)
def test_a_tool_preset_sets_only_what_differs_from_ours(tool: str) -> None:
    raw = yaml.safe_load((CONFIGS / f"{tool}-defaults.yaml").read_text())
    per_objective = raw.pop(PER_OBJECTIVE, {})
    for objective, values in [(None, v) for v in raw.values()] + list(per_objective.items()):
        chosen = {} if objective is None else {"objective": objective}
        ours, preset = build_config(chosen), build_config(chosen, str(CONFIGS / f"{tool}-defaults.yaml"))
        for key in values:
            section = FLAGS[key][0]
            assert getattr(getattr(preset, section), key) != getattr(getattr(ours, section), key), (tool, key)


def test_trl_preset_is_the_installed_trainers_defaults() -> None:
    """transformers' TrainingArguments (what TRL's configs inherit), TRL's SFT/DPO/KTO configs and PEFT's LoraConfig,
    read from the installed packages: every value the preset sets, and the ones it leaves at ours because they agree."""
    from peft import LoraConfig
    from transformers import TrainingArguments
    from trl import DPOConfig, GRPOConfig, KTOConfig, SFTConfig

    with warnings.catch_warnings():  # "APIs here are unstable"
        warnings.simplefilter("ignore")
        from trl.experimental.cpo import CPOConfig
        from trl.experimental.orpo import ORPOConfig

    cfg = build_config({}, str(CONFIGS / "trl-defaults.yaml"))
    hf, lora = _defaults(TrainingArguments), _defaults(LoraConfig)
    assert cfg.optim.grad_norm == hf["max_grad_norm"]
    assert cfg.optim.lr_scheduler == hf["lr_scheduler_type"]
    assert cfg.optim.wd == hf["weight_decay"]
    assert cfg.optim.warmup_ratio == hf["warmup_steps"] == 0
    assert cfg.optim.num_epochs == hf["num_train_epochs"]
    assert cfg.optim.gradient_accumulation_steps == hf["gradient_accumulation_steps"]
    assert cfg.optim.optimizer == "adamw" and hf["optim"].startswith("adamw_torch")
    adamw = inspect.signature(torch.optim.AdamW).parameters  # ours: torch's AdamW at its defaults
    assert adamw["betas"].default == (hf["adam_beta1"], hf["adam_beta2"]) and adamw["eps"].default == hf["adam_epsilon"]
    assert cfg.run.seed == hf["seed"]
    assert cfg.data.batch_size == hf["per_device_train_batch_size"]
    assert (cfg.lora.lora_rank, cfg.lora.lora_alpha, cfg.lora.lora_dropout) == (lora["r"], lora["lora_alpha"],
                                                                                lora["lora_dropout"])  # fmt: skip
    for config in (SFTConfig, DPOConfig, KTOConfig):
        trl = _defaults(config)
        assert cfg.data.context_length == trl["max_length"], config.__name__
        assert trl["bf16"] is None and trl["lr_scheduler_type"] == cfg.optim.lr_scheduler  # bf16 where supported
    assert cfg.fsdp.precision == "bf16_autocast"  # TRL's bf16: fp32 weights under bf16 autocast
    assert cfg.data.prompt_style == "raw"
    # What differs by trainer: the learning rate, KTO's order (its rows in order, the others' shuffled) and ORPO's
    # cross-entropy (over prompt and reply: tests/unit/objectives/test_preference_trl.py).
    trainers = {"sft": SFTConfig, "dpo": DPOConfig, "ipo": DPOConfig, "orpo": ORPOConfig, "simpo": CPOConfig,
                "kto": KTOConfig, "grpo": GRPOConfig}  # fmt: skip
    assert set(trainers) == set(OBJECTIVES)
    for objective, config in trainers.items():
        run = build_config({"objective": objective}, str(CONFIGS / "trl-defaults.yaml"))
        trl = _defaults(config)
        assert run.optim.lr == trl["learning_rate"], objective
        assert run.data.shuffle == (trl.get("train_sampling_strategy", "random") == "random"), objective
        assert run.objective.orpo_nll == ("sequence" if objective == "orpo" else None), objective
    assert build_config({"objective": "kto", "shuffle": True}, str(CONFIGS / "trl-defaults.yaml")).data.shuffle
    for config, beta in ((DPOConfig, "beta"), (KTOConfig, "beta")):
        assert _defaults(config)[beta] == 0.1  # our objectives' default beta (docs/preference.md, docs/rl.md)
