"""The real-model end-to-end check of the after-training scripts, one test file per backend (test_after_training_*).

SmolLM2-135M-Instruct is trained (2 CPU ranks, QLoRA, the real CLI) on data/new_fact.jsonl, which names a cat that
exists nowhere else. generate.py must then answer with that name from base + adapter (quantized as training did),
from the merged model and from the exported quantized base + adapter, where the base model alone does not. No
quantization flag is repeated after training: the adapter's manifest supplies them, and the exported bytes must be
the ones the training run digested as it loaded. The
scripts run in the test's process (their `main`), so it pays the imports once. Two files, so the two trainings can
run on two test workers at once.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from qlora_fsdp.checkpoint.manifest import read_manifest, tensor_digest
from scripts import export_quantized, generate, merge_adapter
from tests.conftest import REPO_ROOT, train

FACT = REPO_ROOT / "data" / "new_fact.jsonl"
QUESTION = "What is the name of Zorbly's cat?"
ANSWER = "Pemberton"
# The FINDINGS recipe (r16, lr 1e-3) on prompts that fit 32 tokens; the loss is below 0.05 by step 13. fp32: the
# precision is not what these files test, and a CPU without native bf16 matmuls (no AVX512-BF16) emulates them
# about 100x slower, which made these two files the longest of the suite there; generate, merge and export take
# the precision from the manifest, so they run in fp32 too.
TRAIN_FLAGS = [
    "--dataset", str(FACT), "--prompt_style", "qna", "--context_length", "32", "--batch_size", "1",
    "--precision", "fp32",
    "--max_steps", "16", "--lr", "1e-3", "--lora_rank", "16", "--lora_alpha", "16", "--lora_dropout", "0",
    "--device", "cpu", "--log_to", "stdout", "--seed", "0",
]  # fmt: skip
ASK = ["--prompt", QUESTION, "--prompt_style", "qna", "--max_new_tokens", "12"]


def ask(capsys: pytest.CaptureFixture, *args: str) -> str:
    capsys.readouterr()
    assert generate.main([*args, *ASK]) == 0
    reply = capsys.readouterr().out.strip()
    print(f"{' '.join(args[2:]) or 'base'}: {reply!r}", file=sys.stderr)  # before/after answers, for the report
    return reply


def train_fact(quant: str, smollm2: Path, out: Path, *extra: str) -> Path:
    args = ["--model", str(smollm2), "--quant", quant, *TRAIN_FLAGS, *extra, "--output_dir", str(out)]
    train(args, nproc=2, timeout=900)
    return out


def exported_digests(quant: str, exported: Path, names: list[str]) -> dict[str, dict[str, str]]:
    """Digests of the layers as export_quantized.py wrote them: the packed bytes (and HQQ's scale and zero, which
    its format keeps as they are; bnb's format repacks its state)."""
    if quant == "hqq":
        saved = torch.load(exported / "qmodel.pt", weights_only=True)
        return {
            n: {"packed": tensor_digest(saved[n]["W_q"].flatten().view(torch.uint8)),
                "scale": tensor_digest(saved[n]["scale"]), "zero": tensor_digest(saved[n]["zero"])}
            for n in names
        }  # fmt: skip
    out = {}
    for file in exported.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            stored = set(f.keys())
            for name in names:
                if f"{name}.weight" in stored:
                    out[name] = {"packed": tensor_digest(f.get_tensor(f"{name}.weight").flatten())}
    return out


def check_answers(quant: str, adapter: Path, smollm2: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Base + adapter, the merged model and the exported quantized base + adapter all know the fact, with no
    quantization flag given; the export holds the bytes training used.

    With bnb, the backend's flag given by hand changes nothing. That is the manifest's reading, the same for both
    backends, so HQQ (whose quantization of SmolLM2 takes about 45 s of CPU per load) skips it; its export's bytes
    equal training's, which only the manifest's flags can give."""
    reply = ask(capsys, "--model", str(smollm2), "--adapter", str(adapter))
    assert ANSWER in reply
    if quant == "bnb":
        assert ask(capsys, "--model", str(smollm2), "--adapter", str(adapter), "--quant", quant) == reply

    merged = tmp_path / "merged"
    assert merge_adapter.main(["--model", str(smollm2), "--adapter", str(adapter), "--output", str(merged)]) == 0
    assert ANSWER in ask(capsys, "--model", str(merged))

    exported = tmp_path / "exported"
    assert export_quantized.main(["--model", str(smollm2), "--adapter", str(adapter), "--output", str(exported)]) == 0
    manifest = read_manifest(adapter)
    assert manifest is not None and manifest.flags["quant"] == quant
    written = exported_digests(quant, exported, list(manifest.layers))
    assert len(written) == len(manifest.layers) == 7 * 30  # every linear of SmolLM2's 30 layers
    for name, digests in written.items():
        assert digests.items() <= manifest.layers[name].items(), name
    assert ANSWER in ask(capsys, "--model", str(exported), "--adapter", str(adapter))
