"""Command line: `--config FILE.yaml`, then flag overrides, one validated TrainConfig, then training."""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import traceback
from collections.abc import Callable
from typing import Any

from qlora_fsdp.compat import quiet_peft_checkpointing_warning
from qlora_fsdp.config.help import option_docs
from qlora_fsdp.config.options import build_config
from qlora_fsdp.errors import BUG_REPORT, InternalError, TrainingStopped, UserError
from qlora_fsdp.tools.config import build_tool_config, tool_flags


def main(config: str | None = None, **flags: Any) -> None:
    """Fine-tune a causal LM with quantized LoRA across processes (torchrun) using FSDP."""
    if flags.keys() & {"help", "h"}:
        # fire hands --help to a **flags function as an ordinary flag.
        print(main.__doc__)
        return
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    _quiet_known_noise()
    try:
        cfg = build_config({k.replace("-", "_"): v for k, v in flags.items()}, config).validate()
        from qlora_fsdp.train.trainer import run

        # The imported stack (about 250,000 objects) lives as long as the process: frozen, Python's full
        # collections skip it (each walked it, about 0.2 s) and a forked worker copies fewer of its pages.
        gc.freeze()
        run(cfg)
    except (UserError, TrainingStopped, InternalError) as exc:
        sys.exit(report_failure(exc))


def preprocess(config: str | None = None, **flags: Any) -> None:
    """Tokenize --dataset (and --eval_dataset) into the cache a training run with the same flags and --config
    reads, ahead of the job: prints each cache's path, examples, samples and tokens."""
    if flags.keys() & {"help", "h"}:
        print(preprocess.__doc__)
        return
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = build_config({k.replace("-", "_"): v for k, v in flags.items()}, config).validate()
        if cfg.data.dataset_streaming:
            raise UserError("--dataset_streaming true tokenizes --dataset as training reads it: there is no cache to "
                            "build (drop the flag to build one)")  # fmt: skip
        if cfg.objective.rows == "prompts":
            raise UserError(f"--objective {cfg.objective.objective} reads its prompts whole when training starts: "
                            "there is no cache to build")
        if cfg.data.dataset_in_memory:
            raise UserError("--dataset_in_memory true tokenizes --dataset on every rank when training starts: there "
                            "is no cache to build (drop the flag to build one)")  # fmt: skip
        import torch

        from qlora_fsdp.data.images import load_image_inputs
        from qlora_fsdp.data.loader import prepare_caches
        from qlora_fsdp.model.hub import load_tokenizer, resolve_model_path
        from qlora_fsdp.parallel.distributed import DistEnv

        path = resolve_model_path(cfg.model.model)
        tokenizer = load_tokenizer(path)
        images = load_image_inputs(path, trust_remote_code=cfg.model.trust_remote_code)
        alone = DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo")
        caches = prepare_caches(cfg.data, cfg.eval, tokenizer, alone, kind=cfg.objective.rows, images=images)
        for cache, built in caches:
            print(cache.describe(built), flush=True)
    except (UserError, InternalError) as exc:
        sys.exit(report_failure(exc))


def report_failure(exc: UserError | TrainingStopped | InternalError) -> int:
    """Print a failure the way its kind calls for; returns the exit status: 2 for a user's mistake (one line), 3 for
    training that could not go on (one line naming the step), 1 for a bug (its traceback and a request to report)."""
    if isinstance(exc, InternalError):
        _say("".join(traceback.format_exception(exc)) + f"error: {exc}\nerror: {BUG_REPORT}")
        return 1
    _say(f"error: {exc}")
    return 3 if isinstance(exc, TrainingStopped) else 2


def _say(text: str) -> None:
    """Write text and its newline to stderr in one call: every rank shares that pipe, and under PYTHONUNBUFFERED
    print's two writes (text, then newline) let two ranks' lines run into one."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _quiet_known_noise() -> None:
    """Silence third-party messages that say nothing actionable to a user of this tool."""
    # bitsandbytes' optional CPU kernels package; the built-in CPU path is used instead.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    quiet_peft_checkpointing_warning()  # transformers renaming an attribute that PEFT reads


def _help_text() -> str:
    lines = [
        "Fine-tune a causal LM with quantized LoRA across processes (torchrun) using FSDP.",
        "",
        "Usage: torchrun --nproc_per_node=N train.py --model PATH_OR_HUB_ID --quant bnb|hqq|none [--flag value ...]",
        "       python train.py ... runs one process; --config FILE.yaml supplies values that flags override.",
        "",
        "Options:",
        "  --config FILE  YAML file of option: value (flat, or grouped by section)",
    ]
    section = None
    for sec, flag, default, doc in option_docs():
        if sec != section:
            lines += ["", f"  [{sec}]"]
            section = sec
        lines.append(f"  --{flag} (default: {default!r})  {doc}")
    return "\n".join(lines)


main.__doc__ = _help_text()


def run_cli() -> None:
    """Console-script entry point (`qlora-fsdp ...`), the same as `python train.py ...`."""
    import fire

    fire.Fire(main)


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        """One line and status 2, like every other error of this tool (argparse would print the usage too)."""
        raise UserError(f"{message} (--help lists the options)")


def run_tool(tool: type, run: Callable[[Any, Any], None], argv: list[str] | None = None) -> int:
    """Command line of an after-training script: its flags (see config.tool_flags), validated, then `run(cfg,
    options)`; a UserError becomes one `error:` line and status 2."""
    parser = _OneLineParser(description=tool.__doc__, allow_abbrev=False)
    for flag, (typ, default, doc) in tool_flags(tool).items():
        # Booleans take an optional value: `--chat` and `--overwrite true` both work, as with train.py.
        extra: dict[str, Any] = {"nargs": "?", "const": "true"} if typ is bool else {}
        parser.add_argument(f"--{flag}", default=None, help=f"{doc} (default: {default!r})", **extra)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    _quiet_known_noise()
    try:
        args = parser.parse_args(argv)
        cfg, options = build_tool_config(tool, {k: v for k, v in vars(args).items() if v is not None})
        run(cfg, options)
    except (UserError, InternalError) as exc:
        return report_failure(exc)
    return 0
