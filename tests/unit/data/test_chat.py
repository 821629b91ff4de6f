"""Chat data (qlora_fsdp.data.chat through qlora_fsdp.data): formats, detection, the assistant-only label mask on
three chat templates, row errors, and dataset mixtures.

The mask is checked against the tokenizer, not against the code's own rendering: the labelled tokens of each reply
must decode to the reply as the template writes it plus its end-of-turn token, and must be the tokens the tokenizer
gives for that text.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from qlora_fsdp.config.options import DataConfig, EvalConfig
from qlora_fsdp.data import IGNORE_INDEX
from qlora_fsdp.data.chat import Conversation
from qlora_fsdp.data.formats import Example, load_examples, pad_token_id, special_prefix
from qlora_fsdp.data.loader import Batching, build_loaders
from qlora_fsdp.data.rows import PAD_MULTIPLE, collate, fit_examples
from qlora_fsdp.data.sources import read_rows, source_names
from qlora_fsdp.errors import UserError
from qlora_fsdp.parallel.distributed import DistEnv

TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "chat_templates"
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

SYSTEM_AND_TWO_TURNS = {
    "messages": [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": " Paris. "},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome."},
    ]
}
REASONING_NO_SYSTEM = {
    "messages": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\nFour."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome."},
    ]
}

# template -> (end-of-turn token, the replies of the two rows above as that template writes them)
EXPECTED_REPLIES = {
    # SmolLM2's ChatML writes replies as given.
    "smollm2": ("<|im_end|>", [" Paris. ", "Rome."], ["<think>\nTwo and two.\n</think>\n\nFour.", "You're welcome."]),
    # Trims every reply.
    "llama3_style": (
        "<|eot_id|>",
        ["Paris.", "Rome."],
        ["<think>\nTwo and two.\n</think>\n\nFour.", "You're welcome."],
    ),
    # Drops reasoning; the replies after the last user turn follow an empty think block that is not theirs.
    "qwen_style": ("<|im_end|>", [" Paris. ", "Rome."], ["Four.", "You're welcome."]),
}


def _cpu_env(rank: int = 0, world_size: int = 1) -> DistEnv:
    return DistEnv(rank, rank, world_size, world_size, torch.device("cpu"), "gloo")


@pytest.fixture(scope="module")
def chatml(smollm2: Path):
    """SmolLM2's tokenizer with its own ChatML template."""
    return AutoTokenizer.from_pretrained(smollm2)


def _train_loader(cfg: DataConfig, tokenizer):
    """The training loader of one CPU rank, without evaluation."""
    loader, _ = build_loaders(cfg, EvalConfig(), tokenizer, _cpu_env(), Batching(seed=0))
    return loader


def _tokenizer(smollm2: Path, template: str):
    tok = AutoTokenizer.from_pretrained(smollm2)
    if template == "llama3_style":
        tok.add_special_tokens({"bos_token": "<|begin_of_text|>", "additional_special_tokens": LLAMA3_SPECIALS[1:]})
    if template != "smollm2":
        tok.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    return tok


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _labelled_runs(sample: tuple[list[int], list[int]]) -> list[list[int]]:
    """The token ids of each maximal run of labelled positions of an (input_ids, labels) sample."""
    runs: list[list[int]] = []
    previous = False
    for token, label in zip(*sample, strict=True):
        labelled = label != IGNORE_INDEX
        if labelled:
            assert label == token  # a label is the token at its position; the loss shifts it
            if not previous:
                runs.append([])
            runs[-1].append(token)
        previous = labelled
    return runs


# --- the label mask ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("template", list(EXPECTED_REPLIES))
def test_labels_are_exactly_the_assistant_replies_and_end_of_turn(smollm2: Path, tmp_path: Path, template: str) -> None:
    tok = _tokenizer(smollm2, template)
    eot, *replies = EXPECTED_REPLIES[template]
    path = _write_jsonl(tmp_path / "chat.jsonl", [SYSTEM_AND_TWO_TURNS, REASONING_NO_SYSTEM])
    examples = load_examples(str(path))
    items, stats = fit_examples(examples, tok, context_length=160, train_on_inputs=False)
    assert len(items) == 2 and stats.truncated == 0 and stats.dropped == 0
    assert special_prefix(tok) == []  # SmolLM2's tokenizer adds no BOS: the rendering is the whole sequence

    expected_label_tokens = 0
    for item, row, row_replies in zip(items, [SYSTEM_AND_TWO_TURNS, REASONING_NO_SYSTEM], replies, strict=True):
        # The row is the template's rendering, tokenized whole (system prompt and all) ...
        rendered = tok.apply_chat_template(row["messages"], tokenize=False)
        assert tok.decode(item[0]) == rendered
        runs = _labelled_runs(item)
        # ... and its labels are each reply as written in that rendering, with the end-of-turn token.
        assert [tok.decode(run) for run in runs] == [reply + eot for reply in row_replies]
        for run, reply in zip(runs, row_replies, strict=True):
            assert run == tok(reply + eot, add_special_tokens=False)["input_ids"]
        expected_label_tokens += sum(len(run) for run in runs)
        if template == "qwen_style":  # an inserted block the mask must leave out
            assert f"<think>\n\n</think>\n\n{row_replies[-1]}<|im_end|>" in rendered
    assert stats.label_tokens == expected_label_tokens  # no reply starts a sample: every labelled token counts


@pytest.mark.parametrize("template", list(EXPECTED_REPLIES))
def test_train_on_inputs_labels_every_real_token(smollm2: Path, template: str) -> None:
    tok = _tokenizer(smollm2, template)
    conv = Conversation(tuple((m["role"], m["content"]) for m in REASONING_NO_SYSTEM["messages"]))
    ((ids, labels),), stats = fit_examples([conv], tok, context_length=160, train_on_inputs=True)
    n_real = len(ids)
    assert n_real < 160 and stats.truncated == 0
    assert labels == ids
    assert stats.label_tokens == n_real - 1  # nothing predicts position 0
    # A batch pads the row to a multiple of 8 tokens, and the padding is neither learned nor attended to.
    pad = pad_token_id(tok)
    batch = collate([{"input_ids": ids, "labels": labels}], pad_id=pad, context_length=160, pad_to_context=False)
    assert batch["input_ids"].shape == (1, -(-n_real // PAD_MULTIPLE) * PAD_MULTIPLE)
    assert (batch["input_ids"][0, n_real:] == pad).all()
    assert batch["labels"][0, :n_real].tolist() == ids and (batch["labels"][0, n_real:] == IGNORE_INDEX).all()
    assert batch["attention_mask"][0].tolist() == [1] * n_real + [0] * (batch["input_ids"].shape[1] - n_real)


def test_template_text_built_from_the_reply_is_learned_with_it(smollm2: Path) -> None:
    """A template that moves the reply's reasoning into its own block (as Qwen3's does for the last turn): the block's
    fixed opening is the template's, the reasoning and the answer are the reply's."""
    tok = AutoTokenizer.from_pretrained(smollm2)
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{% if m['role'] == 'assistant' %}{% set parts = m['content'].split('</think>') %}"
        "{% set thought = parts[0].split('<think>')[-1].strip() if parts | length > 1 else '' %}"
        "{{ '<think>\\n' + thought + '\\n</think>\\n\\n' + parts[-1].strip() }}"
        "{% else %}{{ m['content'] }}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    )
    conv = Conversation((("user", "What is 2+2?"), ("assistant", "<think>Two and two.</think>Four.")))
    (item,), _ = fit_examples([conv], tok, context_length=96, train_on_inputs=False)
    assert "<|im_start|>assistant\n<think>\nTwo and two.\n</think>\n\nFour.<|im_end|>" in tok.decode(item[0])
    assert [tok.decode(run) for run in _labelled_runs(item)] == ["Two and two.\n</think>\n\nFour.<|im_end|>"]


def test_truncated_reply_keeps_the_labels_that_fit(chatml) -> None:
    conv = Conversation((("user", "Count."), ("assistant", "one two three four five six seven eight nine ten")))
    ((full_ids, full_labels),), _ = fit_examples([conv], chatml, context_length=128, train_on_inputs=False)
    n_real = len(full_ids)
    ((ids, labels),), stats = fit_examples([conv], chatml, context_length=n_real - 4, train_on_inputs=False)
    assert stats.truncated == 1
    assert ids == full_ids[: n_real - 4]
    assert labels == full_labels[: n_real - 4]


# --- formats and detection ---------------------------------------------------------------------------------------


def _sharegpt(row: dict) -> dict:
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in row["messages"]]}


def _write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json_list", "parquet"])
def test_openai_and_sharegpt_rows_load_the_same_conversations(tmp_path: Path, fmt: str) -> None:
    rows = [SYSTEM_AND_TWO_TURNS, REASONING_NO_SYSTEM]
    loaded = []
    for name, data in (("openai", rows), ("sharegpt", [_sharegpt(r) for r in rows])):
        if fmt == "jsonl":
            path = _write_jsonl(tmp_path / f"{name}.jsonl", data)
        elif fmt == "json_list":
            path = tmp_path / f"{name}.json"
            path.write_text(json.dumps(data))
        else:
            path = _write_parquet(tmp_path / f"{name}.parquet", data)
        loaded.append(load_examples(str(path)))
    openai, sharegpt = loaded
    assert openai == sharegpt
    assert openai[0] == Conversation(tuple((m["role"], m["content"]) for m in SYSTEM_AND_TWO_TURNS["messages"]))


def test_chat_rows_are_detected_beside_alpaca_rows_and_style_chat_renders_alpaca_rows(tmp_path: Path, chatml) -> None:
    alpaca = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}
    path = str(_write_jsonl(tmp_path / "mixed.jsonl", [alpaca, SYSTEM_AND_TWO_TURNS]))
    text_prompt, chat = load_examples(path)
    assert isinstance(text_prompt, Example) and text_prompt.prompt.startswith("Below is an instruction")
    assert isinstance(chat, Conversation)

    forced, _ = load_examples(path, prompt_style="chat")
    assert forced == Conversation((("user", "Add the numbers.\n\n2 and 3"), ("assistant", "5")))
    (item,), _ = fit_examples([forced], chatml, context_length=96, train_on_inputs=False)
    assert [chatml.decode(run) for run in _labelled_runs(item)] == ["5<|im_end|>"]
    assert "<|im_start|>user\nAdd the numbers.\n\n2 and 3<|im_end|>" in chatml.decode(item[0])


def test_chat_template_flag_replaces_the_tokenizers_template(tmp_path: Path, smollm2: Path) -> None:
    tok = AutoTokenizer.from_pretrained(smollm2)
    path = str(_write_jsonl(tmp_path / "chat.jsonl", [SYSTEM_AND_TWO_TURNS] * 2))
    cfg = DataConfig(dataset=path, context_length=128, chat_template=str(TEMPLATES / "qwen_style.jinja"))
    batch = next(iter(_train_loader(cfg, tok)))
    assert "<think>\n\n</think>\n\nRome." in tok.decode(batch["input_ids"][0])


# --- bad input ---------------------------------------------------------------------------------------------------


def _one_line_error(path: Path, tokenizer=None, **kwargs) -> str:
    """The UserError that loading the file raises (given a tokenizer: that building a training loader from it raises,
    through the tokenized cache), checked to be one line."""
    with pytest.raises(UserError) as info:
        if tokenizer is None:
            load_examples(str(path), **kwargs)
        else:
            _train_loader(DataConfig(dataset=str(path), context_length=128, **kwargs), tokenizer)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "{}"}]},
            r"row 2 messages\[2\]: unknown role 'tool'; role must be system, user or assistant",
        ),
        (
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "yo"}]},
            r"row 2 conversations\[2\]: unknown role 'bot'; from must be system, human or gpt",
        ),
        ({"messages": []}, r"row 2: field 'messages' is empty"),
        ({"messages": "hi"}, r"row 2: field 'messages' must be a list, got str"),
        ({"messages": [{"role": "user", "content": None}]}, r"row 2 messages\[1\]: 'content' must be a string"),
        ({"conversations": [{"value": "hi"}]}, r"row 2 conversations\[1\]: 'from' must be a string, got NoneType"),
        ({"messages": ["hi"]}, r"row 2 messages\[1\]: expected an object with 'role' and 'content', got str"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "?"}, {"type": "video"}]}]},
            r"row 2 messages\[1\]: 'content' part 2 must be \{\"type\": \"image\"\} or \{\"type\": \"text\"",
        ),
    ],
)
def test_bad_chat_rows_name_file_and_row(tmp_path: Path, row: dict, expected: str) -> None:
    path = _write_jsonl(tmp_path / "chat.jsonl", [SYSTEM_AND_TWO_TURNS, row])
    message = _one_line_error(path)
    assert str(path) in message
    assert re.search(expected, message), message


def test_invalid_json_line_in_chat_file_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(SYSTEM_AND_TWO_TURNS) + "\n\n" + '{"messages": [{"role": "user", "content": "hi"}\n')
    message = _one_line_error(path)
    assert f"--dataset {path} line 3: not valid JSON" in message


def test_tokenizer_without_chat_template_names_the_flag(tmp_path: Path, smollm2: Path) -> None:
    tok = AutoTokenizer.from_pretrained(smollm2)
    tok.chat_template = None
    path = _write_jsonl(tmp_path / "chat.jsonl", [SYSTEM_AND_TWO_TURNS])
    message = _one_line_error(path, tok)
    assert f"--dataset {path} row 1" in message
    assert "no chat template" in message and "--chat_template FILE.jinja" in message
    assert "chat_template.jinja" in message


def test_bad_chat_template_file_names_file_and_line(tmp_path: Path, chatml) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    path = _write_jsonl(tmp_path / "chat.jsonl", [SYSTEM_AND_TWO_TURNS])
    with pytest.raises(UserError, match=rf"--chat_template {bad} line 2: not a valid Jinja template"):
        _train_loader(DataConfig(dataset=str(path), chat_template=str(bad)), chatml)
    missing = DataConfig(dataset=str(path), chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(UserError, match=r"--chat_template .*missing\.jinja: cannot read the file"):
        _train_loader(missing, chatml)


def test_template_that_refuses_a_conversation_names_the_row(tmp_path: Path, smollm2: Path) -> None:
    tok = AutoTokenizer.from_pretrained(smollm2)
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "{{ m['content'] + eos_token }}{% endfor %}"
    )
    path = _write_jsonl(tmp_path / "chat.jsonl", [REASONING_NO_SYSTEM, SYSTEM_AND_TWO_TURNS])
    message = _one_line_error(path, tok)
    assert f"--dataset {path} row 2: the chat template refused this conversation (no system role)" in message


def test_conversations_without_assistant_turn_are_dropped_and_counted(tmp_path: Path, chatml) -> None:
    unanswered = {"messages": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hello?"}]}
    path = _write_jsonl(tmp_path / "chat.jsonl", [SYSTEM_AND_TWO_TURNS, unanswered, REASONING_NO_SYSTEM])
    for train_on_inputs in (False, True):
        items, stats = fit_examples(
            load_examples(str(path)), chatml, context_length=160, train_on_inputs=train_on_inputs
        )
        assert (stats.rows, stats.dropped, stats.samples, len(items)) == (3, 1, 2, 2)
    only_unanswered = _write_jsonl(tmp_path / "none.jsonl", [unanswered, unanswered])
    message = _one_line_error(only_unanswered, chatml)
    assert "all 2 rows were dropped: no conversation has an assistant turn" in message


# --- mixtures ----------------------------------------------------------------------------------------------------


def test_mixture_concatenates_sources_and_logs_per_source_counts(
    tmp_path: Path, chatml, caplog: pytest.LogCaptureFixture
) -> None:
    alpaca = [{"instruction": f"Question {i}", "output": f"Answer {i}"} for i in range(5)]
    first = _write_jsonl(tmp_path / "a.jsonl", alpaca)
    second = _write_jsonl(tmp_path / "b.jsonl", [SYSTEM_AND_TWO_TURNS, REASONING_NO_SYSTEM, SYSTEM_AND_TWO_TURNS])
    dataset = f"{first},{second}"
    assert source_names(dataset) == [str(first), str(second)]
    assert [len(list(read_rows(name))) for name in source_names(dataset)] == [5, 3]
    assert load_examples(dataset) == load_examples(str(first)) + load_examples(str(second))
    # --dataset_samples applies to each source; a named dataset mixes with files.
    mixed = f"dummy, {second}"
    assert source_names(mixed) == ["dummy", str(second)]
    assert [len(list(read_rows(name, samples=2))) for name in source_names(mixed)] == [2, 2]
    assert load_examples(mixed, samples=2) == load_examples("dummy", samples=2) + load_examples(str(second))[:2]

    cfg = DataConfig(dataset=dataset, context_length=160, batch_size=2)
    with caplog.at_level(logging.INFO, logger="qlora_fsdp.data.loader"):
        loader = _train_loader(cfg, chatml)
    assert len(loader) == 4  # 8 rows, batch 2
    assert re.search(
        rf"dataset {re.escape(dataset)}: tokenized cache (built|reused) .*: 8 examples "
        rf"\({re.escape(str(first))}: 5, {re.escape(str(second))}: 3\),",
        caplog.text,
    ), caplog.text
    assert "training rows: 8 rows, 0 truncated at 160 tokens, 0 dropped" in caplog.text


def test_mixture_with_an_empty_name_is_an_error(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "a.jsonl", [SYSTEM_AND_TWO_TURNS])
    with pytest.raises(UserError, match="empty name in the comma-separated list"):
        source_names(f"{path},")
    with pytest.raises(UserError, match=r"--dataset .*nope\.jsonl: no such file"):
        load_examples(f"{path},{tmp_path / 'nope.jsonl'}")


def test_text_parts_on_a_text_only_model_train_as_their_text(chatml, tmp_path: Path) -> None:
    """OpenAI-style content lists of text parts, on a model without an image processor: the template gets their
    joined text, so the tokens and labels equal those of the same row with string contents (a template that printed
    the list would train on its repr)."""
    from qlora_fsdp.data.formats import encode_examples

    as_parts = [{"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "color."}]},
                {"role": "assistant", "content": [{"type": "text", "text": "Blue."}]}]  # fmt: skip
    as_text = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."}]
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (as_parts, as_text)))
    parts, text = encode_examples(load_examples(str(rows)), chatml, train_on_inputs=False)
    assert parts == text and "type" not in chatml.decode(parts[0])
