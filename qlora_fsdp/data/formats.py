"""Rows -> examples -> token ids and labels: the formats, the prompt templates and the loss mask.

The encode stage. It reads the rows qlora_fsdp/data/sources.py yields, validates each one (a bad row names its
file and row), and turns an example into the (ids, labels) of one sequence at its full length. Fitting sequences
into rows (truncating, splitting, packing, padding) is qlora_fsdp/data/rows.py.

Formats, recognised per row by their fields:
- chat: `messages` (OpenAI) or `conversations` (ShareGPT); assistant turns are learned;
- prompt/completion: `prompt` + `completion` strings (used verbatim) or message lists; the completion is learned;
- alpaca: `instruction` + `output` (+ `input`), framed by --prompt_style; the output is learned;
- text: `text`; every token is learned (continued pretraining);
- preference pairs (--objective dpo, ipo, orpo, simpo): `prompt` + `chosen` + `rejected` strings, the prompt framed
  by --prompt_style; or TRL's conversational form, `chosen`/`rejected` message lists sharing their prompt turns, or
  `prompt` messages + `chosen`/`rejected` assistant messages. Each side is an example of its own (the prompt, its
  reply); only the replies are labelled;
- unpaired completions (--objective kto): `prompt` + `completion` + a boolean `label` (true: desirable), TRL's
  unpaired preference form; strings are framed as a pair's, message lists by the chat template.
--train_on_inputs learns the prompt too. Every sequence begins as the tokenizer begins one (its BOS, where it adds
one) exactly once, and every non-chat sequence ends with EOS.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qlora_fsdp.config.options import check_registry
from qlora_fsdp.data.chat import (
    Content,
    Conversation,
    conversation_from_pair,
    conversation_from_row,
    encode_conversation,
    is_chat_row,
    parse_messages,
    row_images,
    text_of,
)
from qlora_fsdp.data.images import ImageInputs
from qlora_fsdp.data.sources import Located, read_rows, source_names, source_root
from qlora_fsdp.errors import UserError

if TYPE_CHECKING:
    import torch

IGNORE_INDEX = -100
"""Label value the cross-entropy loss skips (prompt and padding positions)."""


def target_mask(labels: torch.Tensor) -> torch.Tensor:
    """Which positions have a next token to predict: labels[:, 1:] that are not IGNORE_INDEX (every loss and token
    count shifts labels by one against the positions that predict them)."""
    return labels[:, 1:] != IGNORE_INDEX

_ROW_HELP = (
    "each row needs 'instruction' and 'output' (alpaca), 'prompt' and 'completion', 'text', or a chat list "
    "'messages' or 'conversations'"
)


@dataclass(frozen=True)
class Example:
    """One row as a prompt and a response; only `response` is learned unless train_on_inputs (text rows have an
    empty prompt)."""

    prompt: str
    response: str


AnyExample = Example | Conversation
"""An example (prompt, response) or a chat conversation."""


@dataclass(frozen=True)
class Pair:
    """A preference pair: the same prompt with the reply to prefer (`chosen`) and the one not to (`rejected`)."""

    chosen: AnyExample
    rejected: AnyExample

    def defect(self) -> str | None:
        """ "identical" when both replies are the same, "empty" when a side has no reply text: such a pair teaches
        nothing and is dropped (and counted)."""
        replies = [_reply(side) for side in (self.chosen, self.rejected)]
        if replies[0] == replies[1]:
            return "identical"
        if any(not "".join(text_of(content) for _, content in reply).strip() for reply in replies):
            return "empty"
        return None


@dataclass(frozen=True)
class Labelled:
    """An unpaired completion (--objective kto): a prompt and one reply, labelled desirable or not."""

    example: AnyExample
    desirable: bool


def _reply(example: AnyExample) -> tuple[tuple[str, Content], ...]:
    if isinstance(example, Example):
        return (("assistant", example.response),)
    return example.messages[example.learn_from :]


Sample = tuple[list[int], list[int]]
"""(input_ids, labels) of one example at its full length, labels -100 where nothing is learned."""


# ---------------------------------------------------------------------------------------------------------------
# Prompt templates
# ---------------------------------------------------------------------------------------------------------------


def _alpaca_prompt(instruction: str, inp: str) -> str:
    if inp:
        return (
            "Below is an instruction that describes a task, paired with an input that provides further context. "
            "Write a response that appropriately completes the request.\n\n"
            f"### Instruction:\n{instruction}\n\n### Input:\n{inp}\n\n### Response:\n"
        )
    return (
        "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
        f"### Instruction:\n{instruction}\n\n### Response:\n"
    )


def _guanaco_prompt(instruction: str, inp: str) -> str:
    body = f"{instruction}\n{inp}" if inp else instruction
    return f"### Human: {body} ### Assistant: "


def _qna_prompt(instruction: str, inp: str) -> str:
    body = f"{instruction}\n{inp}" if inp else instruction
    return f"Question: {body}\nAnswer: "


def _raw_prompt(instruction: str, inp: str) -> str:
    """The text as it is, as TRL reads a string prompt: the completion follows it with no separator."""
    return f"{instruction}\n{inp}" if inp else instruction


_PROMPT_FORMATTERS: dict[str, Callable[[str, str], str]] = {
    "alpaca": _alpaca_prompt,
    "guanaco": _guanaco_prompt,
    "qna": _qna_prompt,
    "raw": _raw_prompt,
}
CHAT_STYLE = "chat"
"""Instruction rows become a user and an assistant turn, rendered with the tokenizer's chat template."""
PROMPT_STYLES = (*_PROMPT_FORMATTERS, CHAT_STYLE)
check_registry(PROMPT_STYLES, "prompt_style")


def _check_prompt_style(prompt_style: str) -> None:
    if prompt_style not in PROMPT_STYLES:
        raise UserError(f"unknown prompt style {prompt_style!r}; valid styles: {', '.join(PROMPT_STYLES)}")


def format_prompt(instruction: str, inp: str = "", *, prompt_style: str = "alpaca") -> str:
    """The prompt text for an alpaca-format row in the given style (the response follows it verbatim)."""
    _check_prompt_style(prompt_style)
    if prompt_style == CHAT_STYLE:
        raise UserError("--prompt_style chat has no prompt text of its own: the tokenizer's chat template writes it")
    return _PROMPT_FORMATTERS[prompt_style](instruction, inp)


# ---------------------------------------------------------------------------------------------------------------
# Rows -> examples (every bad row is reported the same way, whatever its source)
# ---------------------------------------------------------------------------------------------------------------


def _field(row: dict[str, Any], name: str, where: str, *, optional: bool = False, formats: str = _ROW_HELP) -> str:
    """row[name] as a string, or a one-line UserError saying where the row is and what is wrong (and `formats`,
    what a row may hold)."""
    value = row.get(name)
    if value is None:
        if optional:
            return ""
        what = "missing field" if name not in row else "null field"
        raise UserError(f"{where}: {what} {name!r} ({formats})")
    if not isinstance(value, str):
        raise UserError(f"{where}: field {name!r} must be a string, got {type(value).__name__} ({formats})")
    return value


def _alpaca_example(row: dict[str, Any], where: str, prompt_style: str) -> AnyExample:
    instruction = _field(row, "instruction", where)
    output = _field(row, "output", where)
    inp = _field(row, "input", where, optional=True)
    if prompt_style == CHAT_STYLE:
        return conversation_from_pair(f"{instruction}\n\n{inp}" if inp else instruction, output, where)
    return Example(format_prompt(instruction, inp, prompt_style=prompt_style), output)


def _prompt_completion_example(row: dict[str, Any], where: str, root: Path | None) -> AnyExample:
    """TRL's prompt/completion form: two strings, used verbatim, or two message lists (chat template), the
    prompt's image parts with the row's `images`."""
    prompt, completion = row.get("prompt"), row.get("completion")
    if isinstance(prompt, list) or isinstance(completion, list):
        if not (isinstance(prompt, list) and isinstance(completion, list)):
            raise UserError(f"{where}: 'prompt' and 'completion' must both be strings or both message lists")
        turns = parse_messages(prompt, f"{where} prompt")
        replies = parse_messages(completion, f"{where} completion")
        images = row_images(row, (*turns, *replies), where, "prompt", root=root)
        return Conversation((*turns, *replies), where, learn_from=len(turns), images=images)
    return Example(_field(row, "prompt", where), _field(row, "completion", where))


_PAIR_HELP = (
    "each row needs 'prompt', 'chosen' and 'rejected' strings, or 'chosen' and 'rejected' message lists (with "
    "or without 'prompt' messages)"
)


_SFT_FIELDS = ("messages", "conversations", "completion", "instruction", "output", "text")
"""Fields of the supervised formats: a row with one is not taken for a pair for carrying `chosen` too."""


def _is_pair_row(row: dict[str, Any]) -> bool:
    return row.get("chosen") is not None or row.get("rejected") is not None


def pair_example(row: Any, where: str, *, prompt_style: str, root: Path | None = None) -> Pair:
    """The preference pair a row holds (see the module docstring), or a UserError naming the row; TRL's vision pairs
    hold their images in the prompt's turns (`images`, relative to `root`)."""
    if not isinstance(row, dict) or not _is_pair_row(row):
        got = "an object without them" if isinstance(row, dict) else type(row).__name__
        raise UserError(f"{where}: expected a preference pair, got {got} ({_PAIR_HELP})")
    prompt, chosen, rejected = row.get("prompt"), row.get("chosen"), row.get("rejected")
    if any(isinstance(value, list) for value in (prompt, chosen, rejected)):
        if not (isinstance(chosen, list) and isinstance(rejected, list)) or isinstance(prompt, str):
            raise UserError(f"{where}: 'prompt', 'chosen' and 'rejected' must be all strings or all message lists")
        if prompt is None:  # the prompt is the turns both sides share
            sides = parse_messages(chosen, f"{where} chosen"), parse_messages(rejected, f"{where} rejected")
            shared = next((i for i, (a, b) in enumerate(zip(*sides, strict=False)) if a != b), min(map(len, sides)))
            turns, replies = sides[0][:shared], (sides[0][shared:], sides[1][shared:])
        else:
            turns = parse_messages(prompt, f"{where} prompt")
            replies = (parse_messages(chosen, f"{where} chosen"), parse_messages(rejected, f"{where} rejected"))
        for name, reply in zip(("chosen", "rejected"), replies, strict=True):
            if any(role != "assistant" for role, _ in reply):
                raise UserError(f"{where}: {name!r} must hold only assistant messages after the prompt's turns")
        if not turns:
            raise UserError(f"{where}: no prompt: 'chosen' and 'rejected' share no turn and there is no 'prompt'")
        images = row_images(row, tuple(turns), where, "prompt" if prompt is not None else "chosen", root=root)
        chosen_side, rejected_side = (
            Conversation((*turns, *reply), where, learn_from=len(turns), images=images) for reply in replies
        )
        return Pair(chosen_side, rejected_side)
    text = _field(row, "prompt", where, formats=_PAIR_HELP)
    replies = (_field(row, "chosen", where, formats=_PAIR_HELP), _field(row, "rejected", where, formats=_PAIR_HELP))
    if prompt_style == CHAT_STYLE:
        return Pair(*(conversation_from_pair(text, reply, where) for reply in replies))
    framed = format_prompt(text, prompt_style=prompt_style)
    return Pair(*(Example(framed, reply) for reply in replies))


_UNPAIRED_HELP = "each row needs 'prompt' and 'completion' (strings or message lists) and a boolean 'label'"


def unpaired_example(row: Any, where: str, *, prompt_style: str, root: Path | None = None) -> Labelled:
    """The labelled completion a row holds, or a UserError naming the row. String prompts are framed as a
    preference pair's are (--prompt_style), so KTO and DPO read the same prompts the same way."""
    if not isinstance(row, dict) or row.get("prompt") is None or row.get("completion") is None:
        got = "a preference pair" if isinstance(row, dict) and _is_pair_row(row) else "a row without them"
        raise UserError(f"{where}: --objective kto reads unpaired completions, got {got} ({_UNPAIRED_HELP})")
    label = row.get("label")
    if not isinstance(label, bool):
        raise UserError(f"{where}: 'label' must be true (desirable) or false (undesirable), got {label!r}")
    if row.get("images"):
        raise UserError(f"{where}: rows with images are not supported by --objective kto yet; drop 'images'")
    example = _prompt_completion_example(row, where, root)
    if isinstance(example, Conversation):
        return Labelled(example, label)
    if prompt_style == CHAT_STYLE:
        return Labelled(conversation_from_pair(example.prompt, example.response, where), label)
    return Labelled(Example(format_prompt(example.prompt, prompt_style=prompt_style), example.response), label)


def row_example(row: Any, where: str, *, prompt_style: str, root: Path | None = None) -> AnyExample:
    """The example a row holds, by its fields (see the module docstring); a null field counts as absent."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected an object, got {type(row).__name__} ({_ROW_HELP})")
    if _is_pair_row(row) and not any(row.get(key) is not None for key in _SFT_FIELDS):
        raise UserError(
            f"{where}: a preference pair ('chosen'/'rejected'), which --objective sft cannot learn from; pass "
            "--objective dpo, ipo, orpo or simpo, or give supervised rows"
        )
    if is_chat_row(row):
        return conversation_from_row(row, where, root=root)
    if row.get("completion") is not None or row.get("prompt") is not None:
        return _prompt_completion_example(row, where, root)
    if row.get("instruction") is None and row.get("output") is None and row.get("text") is not None:
        return Example("", _field(row, "text", where))
    return _alpaca_example(row, where, prompt_style)


def load_examples(dataset: str, *, samples: int = 0, prompt_style: str = "alpaca") -> list[AnyExample]:
    """Every example of --dataset in memory, for tools and tests; training reads them through the cache
    (qlora_fsdp/data/cache.py), which never holds them all."""
    _check_prompt_style(prompt_style)
    return [
        row_example(row, where, prompt_style=prompt_style, root=source_root(name))
        for name in source_names(dataset)
        for where, row in read_rows(name, samples=samples)
    ]


# ---------------------------------------------------------------------------------------------------------------
# Examples as Arrow records (the cache stores them between reading and tokenizing)
# ---------------------------------------------------------------------------------------------------------------

RECORD_COLUMNS = ("example", "rejected", "where", "label")


def _encode_example(example: AnyExample) -> str:
    if isinstance(example, Example):
        return json.dumps({"prompt": example.prompt, "response": example.response})
    return json.dumps({"messages": example.messages, "learn_from": example.learn_from, "images": example.images})


def _decode_example(text: str, where: str) -> AnyExample:
    fields = json.loads(text)
    if "messages" in fields:
        messages = tuple(
            (role, content if isinstance(content, str) else tuple(tuple(part) for part in content))
            for role, content in fields["messages"]
        )
        images = tuple(fields.get("images", ()))
        return Conversation(messages, where, learn_from=fields["learn_from"], images=images)
    return Example(fields["prompt"], fields["response"])


def to_record(example: AnyExample | Pair | Labelled, where: str) -> dict[str, Any]:
    """One example (or pair: its chosen side and its rejected side; or labelled completion) as JSON columns, so
    every row has one schema."""
    if isinstance(example, Pair):
        return {"example": _encode_example(example.chosen), "rejected": _encode_example(example.rejected),
                "where": where, "label": ""}  # fmt: skip
    if isinstance(example, Labelled):
        label = "desirable" if example.desirable else "undesirable"
        return {"example": _encode_example(example.example), "rejected": "", "where": where, "label": label}
    return {"example": _encode_example(example), "rejected": "", "where": where, "label": ""}


def from_record(record: dict[str, Any]) -> AnyExample | Pair | Labelled:
    example = _decode_example(record["example"], record["where"])
    if record["rejected"]:
        return Pair(example, _decode_example(record["rejected"], record["where"]))
    if record["label"]:
        return Labelled(example, record["label"] == "desirable")
    return example


def examples_of(
    rows: Iterable[Located], *, prompt_style: str, kind: str = "sft", root: Path | None = None
) -> Iterable[dict[str, Any]]:
    """Records of the rows (of the `kind` an objective reads: "sft", "preference" pairs or "unpaired" labelled
    completions), each validated as it is read; `root` is where the rows' relative image paths start."""
    _check_prompt_style(prompt_style)
    read = {"sft": row_example, "preference": pair_example, "unpaired": unpaired_example}[kind]
    for where, row in rows:
        example = read(row, where, prompt_style=prompt_style, root=root)
        yield to_record(example, where)


# ---------------------------------------------------------------------------------------------------------------
# Tokenization
# ---------------------------------------------------------------------------------------------------------------


def pad_token_id(tokenizer: Any) -> int:
    """The id that fills rows past their tokens (never learned, never attended to): pad, else eos."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def special_prefix(tokenizer: Any) -> list[int]:
    """The ids the tokenizer puts before a text of its own accord (Llama's BOS; nothing for many others)."""
    probe = "Hello world"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe, add_special_tokens=True)["input_ids"]
    at = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), 0)
    return list(full[:at])


def missing_prefix(ids: list[int], prefix: list[int]) -> list[int]:
    """What a sequence lacks of the tokenizer's prefix: all of it, or nothing where the sequence already begins with
    it (a chat template or a pre-rendered prompt that wrote the BOS itself)."""
    return [] if ids[: len(prefix)] == prefix else prefix


def learned_tokens(labels: list[int]) -> int:
    """Label tokens the loss learns from a sample: labels[1:] (nothing predicts a sample's first token)."""
    return sum(label != IGNORE_INDEX for label in labels[1:])


def encode_examples(
    examples: list[AnyExample], tokenizer: Any, *, train_on_inputs: bool, images: ImageInputs | None = None
) -> list[Sample]:
    """Each example's (ids, labels), untruncated.

    Example: [prefix] + prompt + response + eos, the prompt unlabelled unless train_on_inputs. Conversation: the
    chat template's rendering (the prefix put first only when the template did not write it), only the learned
    assistant replies (and their end-of-turn token) labelled unless train_on_inputs; one without a reply to learn
    is empty, so it is dropped like a row with nothing to learn.
    """
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise UserError("the tokenizer has no eos token; the model cannot learn where a response ends")
    prefix = special_prefix(tokenizer)
    plain = [e for e in examples if isinstance(e, Example)]
    prompts = tokenizer([e.prompt for e in plain], add_special_tokens=False)["input_ids"] if plain else []
    responses = tokenizer([e.response for e in plain], add_special_tokens=False)["input_ids"] if plain else []
    pairs = zip(prompts, responses, strict=True)
    samples: list[Sample] = []
    for example in examples:
        if isinstance(example, Example):
            prompt_ids, response_ids = next(pairs)
            prompt_labels = list(prompt_ids) if train_on_inputs else [IGNORE_INDEX] * len(prompt_ids)
            ids, labels = [*prompt_ids, *response_ids, eos_id], [*prompt_labels, *response_ids, eos_id]
            lead = missing_prefix(ids, prefix)
            samples.append(([*lead, *ids], [IGNORE_INDEX] * len(lead) + labels))
        elif not example.has_reply:
            samples.append(([], []))
        else:
            ids, learned = encode_conversation(example, tokenizer, images)
            lead = missing_prefix(ids, prefix)
            ids, learned = [*lead, *ids], [False] * len(lead) + learned
            samples.append(
                (ids, [i if train_on_inputs or m else IGNORE_INDEX for i, m in zip(ids, learned, strict=True)])
            )
    return samples
