"""Chat data through the real CLI on SmolLM2 (a random model's frozen head cannot reach a low loss).

Every assistant reply is the same sentence and every user turn is random words: trained on the replies alone the
loss must fall near zero, while trained on every token it stays high, because random words cannot be learned.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.conftest import train

pytestmark = pytest.mark.distributed  # every test here runs the CLI or a script in a process

REPLY = "The answer is always forty-two."
WORDS = (
    "apple river stone cloud green seven window garden music paper silver orange winter candle forest bridge yellow "
    "market letter mountain ocean pencil summer thunder velvet basket castle dragon engine feather"
)
BATCH = 2
STEPS = 8


def _write_dataset(path: Path) -> Path:
    rng = random.Random(0)
    rows = [
        {
            "messages": [
                {"role": "system", "content": "Reply briefly."},
                {"role": "user", "content": " ".join(rng.choices(WORDS.split(), k=12))},
                {"role": "assistant", "content": REPLY},
            ]
        }
        for _ in range(64)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def runs(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[bool, list[dict]]:
    """metrics.jsonl rows of one run per --train_on_inputs setting, same data, seed and settings otherwise."""
    root = tmp_path_factory.mktemp("chat-runs")
    data = _write_dataset(root / "chat.jsonl")
    out = {}
    for train_on_inputs in (False, True):
        output_dir = root / f"inputs-{train_on_inputs}"
        args = [
            "--model", str(smollm2), "--dataset", str(data), "--output_dir", str(output_dir),
            "--train_on_inputs", str(train_on_inputs).lower(), "--quant", "bnb", "--precision", "fp32",
            "--context_length", "48", "--batch_size", str(BATCH), "--max_steps", str(STEPS),
            "--lora_rank", "8", "--lora_alpha", "16", "--lora_dropout", "0", "--lr", "2e-3",
            "--gradient_checkpointing", "false", "--device", "cpu", "--log_to", "stdout", "--save_model", "false",
        ]  # fmt: skip
        train(args, nproc=0)
        lines = (output_dir / "metrics.jsonl").read_text().splitlines()
        out[train_on_inputs] = [row for row in map(json.loads, lines) if "loss" in row]
    return out


def test_assistant_only_loss_falls_near_zero_while_all_token_loss_stays_high(runs: dict[bool, list[dict]]) -> None:
    replies, everything = ([row["loss"] for row in runs[flag]] for flag in (False, True))
    assert len(replies) == len(everything) == STEPS
    assert replies[0] > 1.0, "the model already knew the reply: the run shows nothing"
    assert max(replies[-3:]) < 0.1, replies
    assert min(everything[-3:]) >= 5 * max(replies[-3:]), (everything, replies)


def test_label_tokens_are_the_assistant_tokens(runs: dict[bool, list[dict]], smollm2: Path) -> None:
    """Every row's only assistant turn is REPLY, so each step learns BATCH x (REPLY's tokens + <|im_end|>)."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    per_row = len(tokenizer(REPLY + "<|im_end|>", add_special_tokens=False)["input_ids"])
    assert [row["label_tokens"] for row in runs[False]] == [BATCH * per_row] * STEPS


def test_train_on_inputs_labels_every_real_token(runs: dict[bool, list[dict]]) -> None:
    """Every non-padding token but each row's first (nothing predicts it) is learned."""
    assert all(row["label_tokens"] == row["tokens"] - BATCH for row in runs[True])
