"""The presets of another tool's defaults (configs/*-defaults.yaml, docs/coming-from.md): each sets only what differs
from ours, and TRL's is checked against the installed transformers, TRL and PEFT themselves."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import torch
import yaml

from qlora_fsdp.config.options import FLAGS, build_config

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
TOOLS = ("trl", "axolotl", "fsdp_qlora")


def _defaults(cls: type) -> dict[str, object]:
    return {f.name: f.default for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("tool", TOOLS)
def test_a_tool_preset_sets_only_what_differs_from_ours(tool: str) -> None:
    raw = yaml.safe_load((CONFIGS / f"{tool}-defaults.yaml").read_text())
    ours, preset = build_config({}), build_config({}, str(CONFIGS / f"{tool}-defaults.yaml"))
    for values in raw.values():
        for key in values:
            section = FLAGS[key][0]
            assert getattr(getattr(preset, section), key) != getattr(getattr(ours, section), key), (tool, key)


def test_trl_preset_is_the_installed_trainers_defaults() -> None:
    """transformers' TrainingArguments (what TRL's configs inherit), TRL's SFT/DPO/KTO configs and PEFT's LoraConfig,
    read from the installed packages: every value the preset sets, and the ones it leaves at ours because they agree."""
    from peft import LoraConfig
    from transformers import TrainingArguments
    from trl import DPOConfig, KTOConfig, SFTConfig

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
    # The order: KTO reads its rows in order, the others shuffle; the preset keeps the shuffle (--shuffle false
    # for KTO, as it says).
    assert _defaults(KTOConfig)["train_sampling_strategy"] == "sequential"
    assert _defaults(DPOConfig)["train_sampling_strategy"] == hf["train_sampling_strategy"] == "random"
    assert cfg.data.shuffle
    for config, beta in ((DPOConfig, "beta"), (KTOConfig, "beta")):
        assert _defaults(config)[beta] == 0.1  # our objectives' default beta (docs/preference.md, docs/rl.md)
