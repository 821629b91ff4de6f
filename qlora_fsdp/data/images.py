"""The image stage: rows with images (TRL's format), made into tokens at tokenization and into pixels per batch.

A row's `messages` hold `{"type": "image"}` parts where its `images` go, in order. The model's processor
(transformers' `AutoProcessor`) decides both halves:
- at tokenization, the chat template writes a placeholder for each image (`<image>`, or Qwen2-VL's
  `<|vision_start|><|image_pad|><|vision_end|>`), which is replaced in the text by what the processor expands it to
  for that image (its number of tokens depends on the image's size for Qwen2-VL), then tokenized with the rest;
  never learned. The cache stores these ids and the images' paths, not pixels;
- per batch, when the DataLoader collates it (in the training process: the loaders start no worker processes), the
  processor turns the images into the model's image inputs (`pixel_values`, and `image_grid_thw` for Qwen2-VL).
Both calls go through the processor itself, so whatever it does to the text for an image is what training sees.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from qlora_fsdp.errors import UserError

TEXT_INPUTS = ("input_ids", "attention_mask")
"""What the processor returns for the text: the batch has its own; everything else it returns is the images'."""
REFUSED = {"mllama": "its cross-attention layers take a per-token image mask (cross_attention_mask) not built yet"}
"""Model types whose rows with images cannot train yet, and why (their text rows can)."""
TOKEN_TYPES = ("mm_token_type_ids", "token_type_ids")
"""Per-token marks of which tokens are an image's (Qwen2-VL's M-RoPE, Gemma 3's bidirectional image attention):
the processor's own marks for each image's tokens, placed where those tokens are in the batch's rows."""


def resolve_image(entry: Any, *, root: Path | None, where: str) -> str:
    """An `images` entry as an absolute path of a readable image: relative paths are relative to the dataset file.
    A missing file or one that is not an image is the row's one-line error."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(entry, str) or not entry:
        raise UserError(f"{where}: each 'images' entry must be a file path, got {type(entry).__name__}")
    path = Path(os.path.expanduser(entry))
    if not path.is_absolute() and root is not None:
        path = root / path
    if not path.is_file():
        raise UserError(f"{where}: image {entry!r} not found (looked for {path})")
    try:
        with Image.open(path) as image:
            image.load()  # decoded whole: a truncated file fails here, on its row, not later in a batch
    except (UnidentifiedImageError, OSError, SyntaxError) as exc:
        raise UserError(f"{where}: image {entry!r} is not an image PIL can read ({exc.__class__.__name__})") from None
    return str(path.resolve())


class ImageInputs:
    """The model's processor, as the data pipeline uses it; picklable (it travels to the tokenizing processes). The
    placeholder is worked out when a row first has an image, so a VLM whose processor has no chat template still
    trains text rows."""

    def __init__(self, processor: Any, *, model_type: str = "") -> None:
        self.processor = processor
        self.model_type = model_type
        names = getattr(processor, "model_input_names", ())
        self.token_types = next((name for name in TOKEN_TYPES if name in names), None)

    @functools.cached_property
    def placeholder(self) -> str:
        return _placeholder(self.processor)

    def identity(self) -> str:
        """A digest of what decides an image's tokens: the processor's class and all its settings (the image
        processor's, and the processor's own such as Gemma 3's image_seq_length)."""
        settings = json.dumps(json.loads(self.processor.to_json_string()), sort_keys=True)
        return hashlib.sha256(f"{type(self.processor).__name__}\n{settings}".encode()).hexdigest()

    def expand_text(
        self, text: str, spans: list[tuple[int, int]], paths: list[str], where: str
    ) -> tuple[str, list[tuple[int, int]], list[tuple[int, int]], list[list[int]]]:
        """The rendered conversation with each image's placeholder replaced by the text the processor expands it to
        for that image (Gemma 3's newlines around the image included, so they tokenize with their neighbours as the
        processor's would): (text, each image's character region in it, `spans` moved to match, each image's ids
        as the processor expands its placeholder alone)."""
        if self.model_type in REFUSED:
            raise UserError(
                f"{where}: images on {self.model_type} are not supported yet: {REFUSED[self.model_type]}; "
                "use Qwen2-VL, LLaVA, Gemma 3 or Idefics3, or no images"
            )
        starts, at = [], text.find(self.placeholder)
        while at >= 0:
            starts.append(at)
            at = text.find(self.placeholder, at + len(self.placeholder))
        if len(starts) != len(paths):
            raise UserError(
                f"{where}: {len(starts)} image placeholder(s) in the rendered conversation but {len(paths)} image(s) "
                'in \'images\'; give one {"type": "image"} part per image'
            )
        pieces, regions, moves, expansions, last = [], [], [], [], 0
        for start, path in zip(starts, paths, strict=True):
            expansions.append(self._processed([path])["input_ids"][0].tolist())
            expanded = self.processor.tokenizer.decode(expansions[-1], skip_special_tokens=False,
                                                       clean_up_tokenization_spaces=False)  # fmt: skip
            pieces.append(text[last:start])
            begin = sum(map(len, pieces))
            regions.append((begin, begin + len(expanded)))
            pieces.append(expanded)
            last = start + len(self.placeholder)
            moves.append((last, len(expanded) - len(self.placeholder)))
        pieces.append(text[last:])

        def moved(x: int) -> int:
            return x + sum(shift for end, shift in moves if end <= x)

        return "".join(pieces), regions, [(moved(a), moved(b)) for a, b in spans], expansions

    def check_regions(
        self, ids: list[int], offsets: list[tuple[int, int]], regions: list[tuple[int, int]],
        expansions: list[list[int]], where: str,
    ) -> list[bool]:  # fmt: skip
        """Which tokens are an image's (never learned). Each image's special tokens must be the processor's own, in
        order (their number is what the image's features fill); an image token written in the text is refused."""
        special = set(self.processor.tokenizer.all_special_ids)
        image_ids = {t for expansion in expansions for t in expansion if t in special} | self._image_ids
        inside = [any(b < end and max(e, b + 1) > start for start, end in regions) for b, e in offsets]
        for token, image in zip(ids, inside, strict=True):
            if token in image_ids and not image:
                name = self.processor.tokenizer.convert_ids_to_tokens(token)
                raise UserError(f"{where}: the text holds the image token {name!r} outside an image part; remove it")
        for (start, end), expansion in zip(regions, expansions, strict=True):
            got = [t for t, (b, _) in zip(ids, offsets, strict=True) if start <= b < end and t in special]
            if got != [t for t in expansion if t in special]:
                raise UserError(f"{where}: an image's tokens come out otherwise in the row than the processor's")
        return inside

    @functools.cached_property
    def _image_ids(self) -> set[int]:
        """The special tokens an image becomes (a row must not hold them outside an image part, a text-only row
        neither): those of the processor's expansion of a blank image."""
        from PIL import Image

        blank = Image.new("RGB", (64, 64), (128, 128, 128))
        ids = self.processor(text=[self.placeholder], images=[[blank]], add_special_tokens=False)["input_ids"][0]
        return set(ids) & set(self.processor.tokenizer.all_special_ids)

    def batch_inputs(self, input_ids: torch.Tensor, images: list[list[str]]) -> dict[str, torch.Tensor]:
        """The model's image inputs for a batch whose row i holds the images at `images[i]`, in order. A per-token
        mark of the processor's (token_type_ids, mm_token_type_ids) goes to every token of the batch with an id the
        processor marked: image tokens, which occur nowhere else (check_regions)."""
        paths = [path for row in images for path in row]
        processed = self._processed(paths)
        out = {k: v for k, v in processed.items() if k not in (*TEXT_INPUTS, *TOKEN_TYPES)}
        if self.token_types is None:
            return out
        marked = processed[self.token_types] != 0
        marks = dict(zip(processed["input_ids"][marked].tolist(), processed[self.token_types][marked].tolist(),
                         strict=True))  # fmt: skip
        types = torch.zeros_like(input_ids)
        for token, mark in marks.items():
            types[input_ids == token] = mark
        out[self.token_types] = types
        return out

    def _processed(self, paths: list[str]) -> dict[str, torch.Tensor]:
        from PIL import Image

        images = []
        for path in paths:
            try:
                with Image.open(path) as image:
                    images.append([image.convert("RGB")])  # one text per image, and its image (Gemma 3 needs that)
            except OSError as exc:
                raise UserError(f"image {path}: PIL cannot read it ({exc})") from None
        text = [self.placeholder] * len(paths)
        # Padded: images of other sizes take other numbers of tokens (Qwen2-VL); attention_mask says which are real.
        return dict(
            self.processor(text=text, images=images, add_special_tokens=False, padding=True, return_tensors="pt")
        )


def _placeholder(processor: Any) -> str:
    """The text the chat template writes for one image: a user turn with an image, less the same turn without."""
    import jinja2

    def render(content: list[dict[str, str]]) -> str:
        return processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False)

    try:
        with_image, without = (
            render([{"type": "image"}, {"type": "text", "text": "x"}]),
            render([{"type": "text", "text": "x"}]),
        )
    except (jinja2.TemplateError, ValueError) as exc:
        raise UserError(f"the model's processor cannot render an image turn with its chat template ({exc})") from None
    start = next((i for i, (a, b) in enumerate(zip(with_image, without, strict=False)) if a != b), len(without))
    end = len(with_image) - len(without) + start
    placeholder = with_image[start:end].strip()  # whitespace around it may merge with the text beside it
    if with_image[:start] + with_image[end:] != without or not placeholder:
        raise UserError("the model's chat template writes an image turn as more than one inserted placeholder")
    return placeholder


def load_image_inputs(model_path: Path, *, trust_remote_code: bool = False) -> ImageInputs | None:
    """The model's processor, if it has one that takes images (a VLM's directory holds its processor config)."""
    if not any((model_path / name).is_file() for name in ("processor_config.json", "preprocessor_config.json")):
        return None
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError) as exc:
        raise UserError(f"--model {model_path}: its processor does not load ({str(exc).splitlines()[0]})") from None
    if getattr(processor, "image_processor", None) is None or getattr(processor, "tokenizer", None) is None:
        return None
    model_type = json.loads((model_path / "config.json").read_text()).get("model_type", "")
    return ImageInputs(processor, model_type=model_type)
