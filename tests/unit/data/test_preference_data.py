"""Preference pairs through the data path: the row formats, truncation that keeps the replies, dropped pairs, the
cache's pair rows and their batches (chosen sides first)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from qlora_fsdp.data.cache import PREFERENCE, CacheSpec, open_cache
from qlora_fsdp.data.chat import Conversation
from qlora_fsdp.data.formats import IGNORE_INDEX, Example, format_prompt, pair_example, row_example
from qlora_fsdp.data.rows import build_rows, collate, fit_pair
from qlora_fsdp.errors import UserError

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = TEMPLATE
    return tok


def _file(tmp_path: Path, rows: list) -> str:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _spec(dataset: str, **flags: object) -> CacheSpec:
    values = dict(dataset=dataset, dataset_samples=0, prompt_style="alpaca", context_length=64, packing_split=False,
                  train_on_inputs=False, objective=PREFERENCE)  # fmt: skip
    return CacheSpec(**{**values, **flags})  # type: ignore[arg-type]


def test_string_pair_frames_the_prompt_by_the_prompt_style() -> None:
    row = {"prompt": "Name a color.", "chosen": "Blue.", "rejected": "Loud."}
    pair = pair_example(row, "f row 1", prompt_style="qna")
    framed = format_prompt("Name a color.", prompt_style="qna")
    assert pair.chosen == Example(framed, "Blue.") and pair.rejected == Example(framed, "Loud.")
    raw = pair_example(row, "f row 1", prompt_style="raw")  # TRL's: the text as it is
    assert raw.chosen == Example("Name a color.", "Blue.") and raw.rejected == Example("Name a color.", "Loud.")
    chat = pair_example(row, "f row 1", prompt_style="chat")
    assert chat.chosen.messages == (("user", "Name a color."), ("assistant", "Blue."))
    assert chat.rejected.learn_from == 0 and chat.rejected.messages[-1] == ("assistant", "Loud.")


def test_conversational_pairs_share_their_prompt_turns() -> None:
    """TRL's two conversational forms give the same pair: the prompt is the turns both sides share, or `prompt`."""
    user = {"role": "user", "content": "Name a color."}
    implicit = {"chosen": [user, {"role": "assistant", "content": "Blue."}],
                "rejected": [user, {"role": "assistant", "content": "Loud."}]}  # fmt: skip
    explicit = {"prompt": [user], "chosen": [{"role": "assistant", "content": "Blue."}],
                "rejected": [{"role": "assistant", "content": "Loud."}]}  # fmt: skip
    a = pair_example(implicit, "f row 1", prompt_style="alpaca")
    b = pair_example(explicit, "f row 2", prompt_style="alpaca")
    assert a == b
    assert a.chosen == Conversation((("user", "Name a color."), ("assistant", "Blue.")), learn_from=1)


@pytest.mark.parametrize(
    ("row", "needle"),
    [
        ({"prompt": "p", "chosen": "a"}, "missing field 'rejected'"),
        ({"prompt": "p", "chosen": "a", "rejected": 3}, "field 'rejected' must be a string"),
        ({"chosen": "a", "rejected": "b"}, "missing field 'prompt'"),
        ({"prompt": "p", "chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"}, "all strings or all"),
        ({"prompt": [{"role": "user", "content": "p"}], "chosen": "a", "rejected": "b"}, "all strings or all"),
        ({"chosen": [{"role": "assistant", "content": "a"}], "rejected": [{"role": "assistant", "content": "b"}]},
         "share no turn"),
        ({"prompt": [{"role": "user", "content": "p"}], "chosen": [{"role": "user", "content": "a"}],
          "rejected": [{"role": "assistant", "content": "b"}]}, "'chosen' must hold only assistant messages"),
        ({"prompt": [{"role": "user", "content": "p"}], "chosen": [{"role": "robot", "content": "a"}],
          "rejected": [{"role": "assistant", "content": "b"}]}, "chosen messages[1]: unknown role 'robot'"),
        ({"instruction": "p", "output": "a"}, "expected a preference pair"),
    ],
)  # fmt: skip
def test_malformed_pairs_name_the_row(row: dict, needle: str) -> None:
    with pytest.raises(UserError) as info:
        pair_example(row, "--dataset f.jsonl row 7", prompt_style="alpaca")
    assert str(info.value).startswith("--dataset f.jsonl row 7") and needle in str(info.value), str(info.value)


def test_a_pair_under_sft_names_the_objective_flag() -> None:
    with pytest.raises(UserError, match="--objective dpo"):
        row_example({"prompt": "p", "chosen": "a", "rejected": "b"}, "f row 1", prompt_style="alpaca")
    # A supervised row that happens to carry a `chosen` field is still the supervised row.
    row = {"instruction": "p", "output": "a", "chosen": "x"}
    assert row_example(row, "f row 1", prompt_style="qna") == Example(format_prompt("p", prompt_style="qna"), "a")


def test_identical_conversations_are_identical_not_empty() -> None:
    turns = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."}]
    assert pair_example({"chosen": turns, "rejected": turns}, "f row 1", prompt_style="alpaca").defect() == "identical"
    explicit = {"prompt": [turns[0]], "chosen": [turns[1]], "rejected": [{"role": "assistant", "content": " "}]}
    assert pair_example(explicit, "f row 2", prompt_style="alpaca").defect() == "empty"


def _side(prompt: int, reply: int, start: int = 0) -> tuple[list[int], list[int]]:
    ids = list(range(start, start + prompt + reply))
    return ids, [IGNORE_INDEX] * prompt + ids[prompt:]


def test_truncation_keeps_the_replies_and_cuts_the_prompt_from_the_left() -> None:
    chosen, rejected = _side(10, 4), _side(10, 6, start=100)
    c, r, how = fit_pair(chosen, rejected, 12, keep_head=1)
    assert how == "truncated"
    # The longer reply (6) leaves 6 prompt tokens: the first (BOS) and the last 5, on both sides.
    assert c[0] == [0, 5, 6, 7, 8, 9, 10, 11, 12, 13] and r[0] == [100, *range(105, 116)]
    assert c[1][6:] == chosen[1][10:] and r[1][6:] == rejected[1][10:]
    c, _, _ = fit_pair(chosen, rejected, 64, max_prompt_length=3)
    assert c[0] == [7, 8, 9, 10, 11, 12, 13]
    whole = fit_pair(chosen, rejected, 64)
    assert whole == (chosen, rejected, "whole")


def test_a_reply_longer_than_the_context_keeps_its_beginning() -> None:
    c, r, how = fit_pair(_side(5, 20), _side(5, 2, start=100), 10)
    assert how == "truncated" and c[0] == [4, *range(5, 14)] and len(c[0]) == 10
    assert r[0] == [104, 105, 106]


def test_identical_and_empty_pairs_are_dropped_and_counted(tmp_path: Path, tokenizer) -> None:
    rows = [
        {"prompt": "Name a color.", "chosen": "Blue.", "rejected": "Loud."},
        {"prompt": "Name a fruit.", "chosen": "Apple.", "rejected": "Apple."},
        {"prompt": "Name a tree.", "chosen": "Oak.", "rejected": "  "},
        {"prompt": "Name a sea.", "chosen": "Red.", "rejected": "Dead."},
    ]
    cache, built = open_cache(_spec(_file(tmp_path, rows)), tokenizer, cache_dir=tmp_path / "cache")
    stats = cache.stats()
    assert built and (stats.identical, stats.empty, stats.samples) == (1, 1, 2)
    assert "1 identical and 1 empty pairs dropped" in stats.describe(64)
    assert cache.lengths[1] == cache.lengths[2] == 0


def test_pair_rows_hold_both_sides_with_only_the_replies_labelled(tmp_path: Path, tokenizer) -> None:
    rows = [{"prompt": "Name a color.", "chosen": "Blue.", "rejected": "Loud and long."}]
    cache, _ = open_cache(_spec(_file(tmp_path, rows)), tokenizer, cache_dir=tmp_path / "cache")
    (chosen_ids, chosen_labels), (rejected_ids, rejected_labels) = cache.samples[0]
    prompt = tokenizer(format_prompt("Name a color."), add_special_tokens=False)["input_ids"]
    for ids, labels, reply in ((chosen_ids, chosen_labels, "Blue."), (rejected_ids, rejected_labels,
                                                                      "Loud and long.")):  # fmt: skip
        reply_ids = [*tokenizer(reply, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
        assert ids == [*prompt, *reply_ids]
        assert labels == [IGNORE_INDEX] * len(prompt) + reply_ids
    assert cache.lengths[0] == len(chosen_ids) + len(rejected_ids)


def test_sft_and_preference_caches_of_one_file_do_not_collide(tmp_path: Path, tokenizer) -> None:
    rows = [{"prompt": "Name a color.", "chosen": "Blue.", "rejected": "Loud."}]
    dataset = _file(tmp_path, rows)
    pairs, _ = open_cache(_spec(dataset), tokenizer, cache_dir=tmp_path / "cache")
    cut, _ = open_cache(_spec(dataset, max_prompt_length=2), tokenizer, cache_dir=tmp_path / "cache")
    assert pairs.path != cut.path
    with pytest.raises(UserError, match="--objective dpo"):
        open_cache(_spec(dataset, objective="sft"), tokenizer, cache_dir=tmp_path / "cache")


def test_a_batch_of_pairs_is_the_chosen_sides_then_the_rejected(tmp_path: Path, tokenizer) -> None:
    rows = [{"prompt": f"Count to {i}.", "chosen": " ".join(map(str, range(i))), "rejected": "No."}
            for i in range(2, 5)]  # fmt: skip
    cache, _ = open_cache(_spec(_file(tmp_path, rows)), tokenizer, cache_dir=tmp_path / "cache")
    rows_, _ = build_rows(cache.samples, np.arange(3), cache.lengths, context_length=64, packing=False, kind=PREFERENCE)
    batch = collate([rows_[i] for i in range(3)], pad_id=0, context_length=64, pad_to_context=False)
    assert batch["input_ids"].shape[0] == 6 and batch["pair_index"].tolist() == [0, 1, 2]
    for i in range(3):
        (chosen, _), (rejected, _) = cache.samples[i]
        assert batch["input_ids"][i, : len(chosen)].tolist() == chosen
        assert batch["input_ids"][3 + i, : len(rejected)].tolist() == rejected
        assert batch["attention_mask"][3 + i].sum() == len(rejected)


def test_conversational_pairs_encode_with_the_chat_template(tmp_path: Path, tokenizer) -> None:
    """Both TRL conversational forms render with the template: each side is the shared turns then its reply, only
    the reply (and its eos) labelled, and the two forms give the same rows."""
    user = {"role": "user", "content": "Name a color."}
    implicit = {"chosen": [user, {"role": "assistant", "content": "Blue."}],
                "rejected": [user, {"role": "assistant", "content": "Loud and long."}]}  # fmt: skip
    explicit = {"prompt": [user], "chosen": [{"role": "assistant", "content": "Blue."}],
                "rejected": [{"role": "assistant", "content": "Loud and long."}]}  # fmt: skip
    cache, _ = open_cache(_spec(_file(tmp_path, [implicit, explicit])), tokenizer, cache_dir=tmp_path / "cache")
    assert cache.samples[0] == cache.samples[1]
    prompt = tokenizer("<|user|>Name a color.", add_special_tokens=False)["input_ids"]
    for (ids, labels), reply in zip(cache.samples[0], ("Blue.", "Loud and long."), strict=True):
        rendered = tokenizer(f"<|user|>Name a color.<|assistant|>{reply}{tokenizer.eos_token}",
                             add_special_tokens=False)["input_ids"]  # fmt: skip
        assert ids == rendered and ids[: len(prompt)] == prompt
        learned = [i for i, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX]
        assert tokenizer.decode(learned) == tokenizer.decode(tokenizer(f"{reply}{tokenizer.eos_token}",
                                                                        add_special_tokens=False)["input_ids"])
        assert all(label == IGNORE_INDEX for label in labels[: len(prompt)])
