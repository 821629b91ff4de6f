"""Chat data: OpenAI `messages` and ShareGPT `conversations` rows, rendered with the tokenizer's chat template.

The loss mask is found on the text the model trains on, not by tokenizing pieces: the whole conversation is
rendered once and tokenized once (pieces tokenized alone merge differently at their edges), and the characters of
each assistant reply, as the template placed them, are mapped to tokens through the tokenizer's offsets. A reply is
located by rendering the conversation again with a placeholder in its place (see _reply_spans); the end-of-turn
token is the special token right after it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qlora_fsdp.data.images import ImageInputs, resolve_image
from qlora_fsdp.errors import UserError

# Each format's list field and the keys of one message in it.
CHAT_FORMATS = {"messages": ("role", "content"), "conversations": ("from", "value")}
_ROLES = {"system": "system", "user": "user", "assistant": "assistant", "human": "user", "gpt": "assistant"}
_ROLE_HELP = {
    "messages": "role must be system, user or assistant",
    "conversations": "from must be system, human or gpt (or system, user, assistant)",
}


@dataclass(frozen=True)
class Conversation:
    """One chat row, roles normalised to system/user/assistant; only assistant turns are learned by default."""

    messages: tuple[tuple[str, Content], ...]
    """(role, content) pairs in order; a content is text, or a tuple of parts (TRL's image rows)."""
    where: str = field(default="", compare=False)
    """The row's location (file and row), for errors raised when it is rendered."""
    learn_from: int = 0
    """Assistant turns before this message are context (a prompt/completion row learns its completion only)."""
    images: tuple[str, ...] = ()
    """Absolute paths of the row's images, in the order of its image parts."""

    @property
    def has_reply(self) -> bool:
        return any(role == "assistant" for role, _ in self.messages[self.learn_from :])

    def as_dicts(self, *, parts: bool = True) -> list[dict[str, Any]]:
        """The messages as chat templates take them; without `parts` (a text-only model's template) a content of
        text parts is their joined text."""
        return [{"role": role, "content": _content(content) if parts else text_of(content)}
                for role, content in self.messages]  # fmt: skip


Content = str | tuple[tuple[str, str], ...]
"""A message's text, or its parts as (type, text) pairs: ("image", "") or ("text", TEXT)."""


def _content(content: Content) -> str | list[dict[str, str]]:
    """A message's content as chat templates take it."""
    if isinstance(content, str):
        return content
    return [{"type": kind} if kind == "image" else {"type": kind, "text": text} for kind, text in content]


def text_of(content: Content) -> str:
    """A message's text, without its images."""
    return content if isinstance(content, str) else "".join(text for _, text in content)


def _parts(content: list[Any], at: str, key: str) -> tuple[tuple[str, str], ...]:
    """TRL's content parts: {"type": "image"} and {"type": "text", "text": ...}."""
    parts = []
    for j, part in enumerate(content, start=1):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image":
            parts.append(("image", ""))
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.append(("text", part["text"]))
        else:
            raise UserError(f'{at}: {key!r} part {j} must be {{"type": "image"}} or {{"type": "text", "text": ...}}')
    return tuple(parts)


def is_chat_row(row: Any) -> bool:
    """A row with a `messages` or `conversations` field (null counts as absent: parquet fills missing columns)."""
    return isinstance(row, dict) and any(row.get(key) is not None for key in CHAT_FORMATS)


def parse_messages(turns: Any, where: str, key: str = "messages") -> list[tuple[str, Content]]:
    """A list of messages in `key`'s format as (role, content) pairs, or a UserError naming the row and turn."""
    role_key, content_key = CHAT_FORMATS[key]
    if not isinstance(turns, list) or not turns:
        what = "is empty" if isinstance(turns, list) else f"must be a list, got {type(turns).__name__}"
        raise UserError(f"{where}: field {key!r} {what} (a list of {{{role_key!r}, {content_key!r}}} objects)")
    messages = []
    for i, turn in enumerate(turns, start=1):
        at = f"{where} {key}[{i}]"
        if not isinstance(turn, dict):
            raise UserError(
                f"{at}: expected an object with {role_key!r} and {content_key!r}, got {type(turn).__name__}"
            )
        role, content = turn.get(role_key), turn.get(content_key)
        if not isinstance(role, str):
            raise UserError(f"{at}: {role_key!r} must be a string, got {type(role).__name__} ({_ROLE_HELP[key]})")
        if role not in _ROLES:
            raise UserError(f"{at}: unknown role {role!r}; {_ROLE_HELP[key]}")
        if isinstance(content, list):  # TRL's vision rows: a list of {"type": "image"} and {"type": "text"} parts
            messages.append((_ROLES[role], _parts(content, at, content_key)))
            continue
        if not isinstance(content, str):
            raise UserError(f"{at}: {content_key!r} must be a string or a list of parts, got {type(content).__name__}")
        messages.append((_ROLES[role], content))
    return messages


def conversation_from_row(row: dict[str, Any], where: str, *, root: Path | None = None) -> Conversation:
    """The row's `messages` or `conversations` list as a Conversation, with its `images` (paths relative to `root`,
    the dataset file's directory), or a UserError naming the row and the field."""
    key = next(k for k in CHAT_FORMATS if row.get(k) is not None)
    messages = tuple(parse_messages(row[key], where, key))
    return Conversation(messages, where, images=row_images(row, messages, where, key, root=root))


def row_images(
    row: dict[str, Any], messages: tuple[tuple[str, Content], ...], where: str, key: str, *, root: Path | None
) -> tuple[str, ...]:
    """The row's `images`, resolved (see resolve_image), one per image part of `messages` (from the row's `key`)."""
    entries = row.get("images") or []
    if not isinstance(entries, list):
        raise UserError(f"{where}: field 'images' must be a list of image paths, got {type(entries).__name__}")
    placeholders = sum(kind == "image" for _, c in messages if not isinstance(c, str) for kind, _ in c)
    if placeholders != len(entries):
        raise UserError(
            f"{where}: {placeholders} image part(s) in {key!r} but {len(entries)} image(s) in 'images'; give one "
            '{"type": "image"} part per image, in order'
        )
    return tuple(resolve_image(entry, root=root, where=where) for entry in entries)


def conversation_from_pair(prompt: str, response: str, where: str) -> Conversation:
    """An instruction row under --prompt_style chat: one user turn, one assistant turn."""
    return Conversation((("user", prompt), ("assistant", response)), where)


def load_chat_template(tokenizer: Any, path: str) -> None:
    """Replace the tokenizer's chat template with the Jinja file at `path` (--chat_template)."""
    import jinja2

    try:
        with open(os.path.expanduser(path), encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--chat_template {path}: cannot read the file ({exc.__class__.__name__}: {exc})") from None
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise UserError(
            f"--chat_template {path} line {exc.lineno}: not a valid Jinja template ({exc.message})"
        ) from None
    tokenizer.chat_template = text


def encode_conversation(
    conv: Conversation, tokenizer: Any, images: ImageInputs | None = None
) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and, per token, whether it belongs to an assistant reply.

    A reply's tokens are those overlapping its characters (a token merged across the reply's first character is
    the model's to predict), plus the template's end-of-turn token when a special token follows the reply. Each
    image's placeholder becomes the tokens the model's processor (`images`) expands it to, never learned.
    """
    if conv.images and images is None:
        raise UserError(
            f"{conv.where}: a row with images, but the model has no image processor (a text-only model); train "
            "image rows on a vision-language model (docs/vision.md)"
        )
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"{conv.where}: a chat row, but the model's tokenizer has no chat template; pass one with "
            "--chat_template FILE.jinja, or add chat_template.jinja to the model directory"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(
            f"{conv.where}: chat rows need a fast tokenizer (its character offsets place the loss mask); "
            "add the model's tokenizer.json to its directory"
        )
    text = _render(tokenizer, conv.as_dicts(parts=images is not None), conv.where)
    spans = _reply_spans(conv, text, tokenizer, parts=images is not None)
    regions: list[tuple[int, int]] = []
    expansions: list[list[int]] = []
    if conv.images:
        text, regions, spans, expansions = images.expand_text(text, spans, list(conv.images), conv.where)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), encoded["offset_mapping"]
    # Token [begin, stop) overlaps span [start, end); a zero-width token counts as one character.
    mask = [any(begin < end and max(stop, begin + 1) > start for start, end in spans) for begin, stop in offsets]
    if images is not None:
        image = images.check_regions(ids, offsets, regions, expansions, conv.where)
        mask = [m and not i for m, i in zip(mask, image, strict=True)]
    return ids, mask


def _render(tokenizer: Any, messages: list[dict[str, Any]], where: str) -> str:
    """The messages as the template writes them; a template that refuses them is the row's error."""
    import jinja2

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False)
    except jinja2.TemplateError as exc:
        raise UserError(f"{where}: the chat template refused this conversation ({exc})") from None


def _special_tokens(tokenizer: Any) -> list[str]:
    """Special added tokens, longest first (so a token is not taken for a shorter one it starts with)."""
    found = {tok.content for tok in tokenizer.added_tokens_decoder.values() if tok.special and tok.content}
    return sorted(found, key=len, reverse=True)


_PLACEHOLDER = "QloraFsdpReplyPlaceholder"
"""Stands in for one reply: templates that trim a reply or cut reasoning out of it leave this word as it is."""


def _reply_spans(conv: Conversation, text: str, tokenizer: Any, *, parts: bool = True) -> list[tuple[int, int]]:
    """Character spans [start, end) of each assistant reply in `text`, end-of-turn token included.

    The conversation is rendered again with the reply replaced by a placeholder. Where the two renderings differ
    is the reply as the template wrote it (trimmed, after an inserted block, reasoning removed), together with any
    template text that depends on the reply (a reasoning block rebuilt from it).
    """
    specials = _special_tokens(tokenizer)
    spans = []
    for i, (role, _) in enumerate(conv.messages):
        if role != "assistant" or i < conv.learn_from:
            continue
        messages = conv.as_dicts(parts=parts)
        messages[i] = {"role": role, "content": _PLACEHOLDER}
        probe = _render(tokenizer, messages, conv.where)
        if probe.count(_PLACEHOLDER) != 1:
            raise UserError(
                f"{conv.where}: the chat template does not write assistant message {i + 1} exactly once, so the "
                "loss mask cannot be placed; pass a template that does with --chat_template FILE.jinja"
            )
        before, _, after = probe.partition(_PLACEHOLDER)
        # Compared with the template's text around the placeholder only, so a reply that starts or ends like the
        # placeholder keeps those characters.
        begin = _shared_prefix(text, before)
        end = max(len(text) - _shared_prefix(text[::-1], after[::-1]), begin)
        # The end-of-turn token, if the template writes one after the reply (whitespace between is learned too).
        after_space = len(text) - len(text[end:].lstrip())
        eot = next((tok for tok in specials if text.startswith(tok, after_space)), None)
        spans.append((begin, after_space + len(eot) if eot else end))
    return spans


def _shared_prefix(text: str, start: str) -> int:
    """How many leading characters `text` shares with `start` (all of them, in the usual case, checked first)."""
    if text.startswith(start):
        return len(start)
    return next((i for i, (x, y) in enumerate(zip(text, start, strict=False)) if x != y), len(text))
