"""Options of the scripts beside train.py (merge_adapter.py, export_quantized.py, generate.py, plan.py) and how
they are built.

Above `config.py`: the scripts take train.py's build flags with the same names, defaults and checks, and fill the
ones not given from the adapter's manifest, so given the training run's values they rebuild what it trained.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, get_type_hints

from qlora_fsdp.config.help import field_docs, option_docs
from qlora_fsdp.config.options import (
    FLAGS,
    ConfigError,
    TrainConfig,
    build_config,
    check_choices,
    check_ranges,
    choice,
    choices,
    coerce,
)

BUILD_FLAGS = (
    "model", "trust_remote_code", "quant", "bnb_quant_type", "bnb_double_quant", "hqq_bits", "hqq_group_size",
    "compute_dtype", "precision",
)  # fmt: skip
"""train.py flags that decide how the base model is built (quantization, dtypes). The after-training scripts take
them with the same names, defaults and checks, so given the training run's values they rebuild what it trained."""
OUTPUT_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
BASE_WEIGHTS = ("original", "dequantized")
GENERATE_PROMPT_STYLES = (*choices("prompt_style"), "chat_template")


@dataclass
class MergeConfig:
    """scripts/merge_adapter.py: fold a trained adapter into its base model."""

    adapter: str = ""
    """Adapter directory train.py wrote (adapter_model.safetensors + adapter_config.json); its qlora_manifest.json
    supplies the quantization flags and, with --base_weights dequantized, the digests the base is checked against."""
    output: str = ""
    """Directory for the merged Hugging Face model (config, sharded safetensors + index, tokenizer)."""
    dtype: str = "bf16"
    """Dtype of the merged weights: bf16, fp16 or fp32."""
    base_weights: str = "original"
    """original: merge into the full-precision checkpoint; dequantized: into the base quantized and dequantized as
    training did (--quant and its flags), the function the adapter was trained against."""
    overwrite: bool = False
    """Replace a model already in --output."""

    def problems(self) -> list[str]:
        return [
            *choice("dtype", self.dtype, tuple(OUTPUT_DTYPES)),
            *choice("base_weights", self.base_weights, BASE_WEIGHTS),
            *(["--adapter is required (the directory train.py saved the adapter to)"] if not self.adapter else []),
            *(["--output is required (a new directory for the merged model)"] if not self.output else []),
        ]


@dataclass
class ExportConfig:
    """scripts/export_quantized.py: write the base model quantized exactly as training quantized it."""

    adapter: str = ""
    """Adapter (or checkpoint) directory of the training run: its qlora_manifest.json supplies the quantization flags
    and the digests every layer is checked against before anything is written (empty: the flags as given)."""
    output: str = ""
    """Directory for the quantized model (bnb: safetensors that from_pretrained loads in 4 bits; hqq: HQQ's
    qmodel.pt that AutoHQQHFModel.from_quantized loads)."""
    overwrite: bool = False
    """Replace a model already in --output."""

    def problems(self) -> list[str]:
        return ["--output is required (a new directory for the quantized model)"] if not self.output else []


@dataclass
class GenerateConfig:
    """scripts/generate.py: answer prompts with a merged model, an exported base + adapter, or base + adapter."""

    adapter: str = ""
    """Adapter directory to apply on top of --model (empty: none); its qlora_manifest.json supplies the quantization
    flags, and the base quantized from --model is checked against its digests."""
    prompt: str = ""
    """The instruction to answer (or pass --chat)."""
    chat: bool = False
    """Read one instruction per line from standard input until end of input or 'exit'."""
    max_new_tokens: int = 128
    """Most tokens to generate per answer."""
    prompt_style: str = "alpaca"
    """How the prompt is framed: alpaca, guanaco, qna or raw (the text as is), as train.py's --prompt_style; or
    chat_template (the tokenizer's; --chat keeps the conversation)."""
    do_sample: bool = False
    """Sample instead of greedy decoding."""
    temperature: float = 1.0
    """With --do_sample: softmax temperature."""
    top_p: float = 1.0
    """With --do_sample: nucleus sampling probability mass."""
    top_k: int = 50
    """With --do_sample: sample among the k most likely tokens (0: all)."""
    seed: int = 0
    """Seed for sampling."""
    image: str = ""
    """Vision-language models: an image file the (first) question is about; the prompt is then framed by the chat
    template, with the image before the text, as TRL's image rows put it."""

    def problems(self) -> list[str]:
        checks = [
            (bool(self.prompt) == self.chat, "pass exactly one of --prompt TEXT or --chat"),
            (self.max_new_tokens < 1, "--max_new_tokens must be >= 1"),
            (self.temperature <= 0, "--temperature must be > 0"),
            (not 0 < self.top_p <= 1, "--top_p must be in (0, 1]"),
            (self.top_k < 0, "--top_k must be >= 0"),
        ]
        return [*choice("prompt_style", self.prompt_style, GENERATE_PROMPT_STYLES), *(m for bad, m in checks if bad)]


@dataclass
class PlanConfig:
    """scripts/plan.py: will a run fit? Each rank's memory, planned from config.json without the weights."""

    config: str = ""
    """A YAML file of train.py options, read as train.py --config reads it (flags given here override it)."""
    nproc_per_node: int = 1
    """Processes (GPUs) per node, as torchrun's --nproc_per_node."""
    nnodes: int = 1
    """Nodes, as torchrun's --nnodes."""
    gpu_memory_gib: float = 0.0
    """Memory of each GPU in GiB, to say whether the run fits and by how much (0: print the figures only)."""

    def problems(self) -> list[str]:
        checks = [
            (self.nproc_per_node < 1, "--nproc_per_node must be >= 1"),
            (self.nnodes < 1, "--nnodes must be >= 1"),
            (self.gpu_memory_gib < 0, "--gpu_memory_gib must be >= 0 (0: no verdict)"),
        ]
        return [message for bad, message in checks if bad]


TOOL_DEFAULTS: dict[type, dict[str, Any]] = {GenerateConfig: {"quant": "none"}}
"""Build flags whose default differs for a script: generate.py loads the model as stored unless told to quantize."""


TOOL_TRAIN_FLAGS: dict[type, tuple[str, ...]] = {PlanConfig: tuple(FLAGS)}
"""The train.py flags a script takes where not just the BUILD_FLAGS: plan.py plans a run, so it takes them all,
checked as train.py checks them."""


def train_flags(tool: type) -> tuple[str, ...]:
    return TOOL_TRAIN_FLAGS.get(tool, BUILD_FLAGS)


def tool_flags(tool: type) -> dict[str, tuple[type, Any, str]]:
    """{flag: (type, default, help)} of a script: its train.py flags (train_flags), then its own options."""
    out: dict[str, tuple[type, Any, str]] = {}
    train_defaults = {flag: default for _, flag, default, _ in option_docs()}
    train_docs = {flag: doc for _, flag, _, doc in option_docs()}
    for flag in train_flags(tool):
        default = TOOL_DEFAULTS.get(tool, {}).get(flag, train_defaults[flag])
        out[flag] = (FLAGS[flag][1], default, train_docs[flag])
    hints, docs, defaults = get_type_hints(tool), field_docs(tool), tool()
    for f in fields(tool):
        out[f.name] = (hints[f.name], getattr(defaults, f.name), docs.get(f.name, ""))
    return out


def recorded_flags(directory: str) -> dict[str, Any]:
    """The flags the manifest in an adapter directory records; empty where there is none (older adapters)."""
    if not directory:
        return {}
    from qlora_fsdp.checkpoint.manifest import read_manifest  # torch and the backends: only where an adapter is given

    manifest = read_manifest(directory)
    return {} if manifest is None else {k: v for k, v in manifest.flags.items() if k in BUILD_FLAGS}


def _contradictions(given: dict[str, Any], recorded: dict[str, Any]) -> list[str]:
    """A flag given on the command line that differs from the one training recorded, with both values."""
    problems = []
    for flag, value in given.items():
        if flag in recorded and coerce(flag, value, FLAGS[flag][1]) != recorded[flag]:
            problems.append(
                f"--{flag} {value} contradicts the adapter's manifest ({recorded[flag]}): the base must be quantized "
                f"as training quantized it; drop --{flag}"
            )
    return problems


def build_tool_config(tool: type, values: dict[str, Any]) -> tuple[TrainConfig, Any]:
    """The build flags as a TrainConfig and the script's own options, every problem reported at once.

    Build flags not given come from the --adapter's manifest where it has one (then the script's defaults); one
    that contradicts the manifest is a problem.
    """
    own, taken = {f.name for f in fields(tool)}, train_flags(tool)
    unknown = sorted(k for k in values if k not in own and k not in taken)
    if unknown:
        raise ConfigError("unknown option(s): " + ", ".join(f"--{k}" for k in unknown) + " (--help lists them)")
    options = tool()
    hints = get_type_hints(tool)
    for name, value in values.items():
        if name in own:
            setattr(options, name, coerce(name, value, hints[name]))
    given = {k: v for k, v in values.items() if k in taken}
    recorded = recorded_flags(getattr(options, "adapter", ""))
    cfg = build_config({**TOOL_DEFAULTS.get(tool, {}), **recorded, **given}, getattr(options, "config", "") or None)
    # A script taking every train.py flag is checked as train.py is; the others' flags only need to build a model.
    checks = cfg.problems() if taken is not BUILD_FLAGS else [*check_choices(cfg), *check_ranges(cfg)]
    problems = [*_contradictions(given, recorded), *checks, *options.problems()]
    if problems:
        raise ConfigError("; ".join(problems))
    return cfg, options
