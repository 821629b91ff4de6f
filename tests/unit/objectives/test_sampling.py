"""qlora_fsdp.objectives.sampling on the tiny Llama with a non-zero LoRA adapter, in one process: decoding through the
root with a KV cache from left-padded prompts gives each drawn token the log-probability that transformers' own forward
over the whole sequence (right-padded) gives it, and the entropy of its distribution; top_p keeps only the most likely
token when it is tiny; a completion stops at its end token; the same generator state draws the same completions. Checked
by hand: new tokens that attend to the prompts' left padding fail the first test (6 of 7 log-probs of a row differ);
rotary positions make the prompts' position offsets invisible to it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from qlora_fsdp.objectives.loss import CausalLMLoss
from qlora_fsdp.objectives.sampling import SamplingParams, sample
from tests.trl_parity import PAD, perturb

PROMPTS = [[5, 9, 33, 71, 2048 % 500], [17], [400, 401, 402, 403, 404, 405, 406, 407], [88, 89, 90]]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def root(tiny_model: Path) -> CausalLMLoss:
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
    lm = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), lora)
    perturb(lm)
    return CausalLMLoss(lm, chunk_tokens=5).train()


PARAMS = SamplingParams(max_new_tokens=7, end_ids=frozenset({2}), pad_id=PAD)


def _draw(root: CausalLMLoss, seed: int, **settings: float) -> object:
    return sample(root, PROMPTS, params=replace(PARAMS, **settings), device=CPU,
                  seeds=[seed * 10 + i for i in range(len(PROMPTS))])  # fmt: skip


def _full_logps(root: CausalLMLoss, temperature: float,
                completions: list[list[int]]) -> tuple[list[list[float]], list[list[float]]]:  # fmt: skip
    """Each completion token's log-probability, and the entropy of its distribution, from one forward over prompt +
    completion, right-padded."""
    rows = [p + c for p, c in zip(PROMPTS, completions, strict=True)]
    width = max(map(len, rows))
    ids = torch.tensor([r + [PAD] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    with torch.no_grad():
        logits = root.eval().lm(input_ids=ids, attention_mask=mask).logits.float()
    root.train()
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    entropies = -(log_probs.exp() * log_probs).sum(-1)
    rows = list(enumerate(zip(PROMPTS, completions, strict=True)))
    return ([[log_probs[i, len(p) - 1 + j, token].item() for j, token in enumerate(c)] for i, (p, c) in rows],
            [[entropies[i, len(p) - 1 + j].item() for j in range(len(c))] for i, (p, c) in rows])  # fmt: skip


def test_cached_decoding_gives_the_whole_sequences_log_probs(root: CausalLMLoss) -> None:
    drawn = _draw(root, 0, temperature=0.7)
    assert root.training  # left as it was
    assert any(len(c) > 1 for c in drawn.completions)
    full, entropies = _full_logps(root, 0.7, drawn.completions)
    for ours, theirs in zip(drawn.logps, full, strict=True):
        assert ours == pytest.approx(theirs, abs=1e-5)
    for ours, theirs in zip(drawn.entropies, entropies, strict=True):  # GRPO's `entropy` metric
        assert ours == pytest.approx(theirs, abs=1e-5)


def test_a_tiny_top_p_is_greedy_and_completions_stop_at_the_end_token(root: CausalLMLoss) -> None:
    drawn = _draw(root, 1, top_p=1e-6)
    for p, c in zip(PROMPTS, drawn.completions, strict=True):
        ids = torch.tensor([p + c])
        with torch.no_grad():
            logits = root.eval().lm(input_ids=ids).logits[0, len(p) - 1 :]
        assert c == logits.argmax(-1)[: len(c)].tolist()
    root.train()
    for c, cut in zip(drawn.completions, drawn.truncated, strict=True):
        assert (2 not in c) == cut and (cut or c[-1] == 2) and c.count(2) <= 1


def test_each_rows_seed_decides_its_completion_whatever_its_batch(root: CausalLMLoss) -> None:
    """The same seeds draw the same completions; other seeds others; and a row sampled alone, with its seed, draws
    what it drew in the batch (so ranks and batch sizes do not change what is sampled)."""
    drawn = _draw(root, 3)
    assert drawn.completions == _draw(root, 3).completions != _draw(root, 4).completions
    for i, prompt in enumerate(PROMPTS):
        alone = sample(root, [prompt], params=PARAMS, device=CPU, seeds=[30 + i])
        assert alone.completions[0] == drawn.completions[i]
