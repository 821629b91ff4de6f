"""The image stage: rows with images (TRL's format), made into tokens at tokenization and into pixels per batch.

A row's `messages` hold `{"type": "image"}` parts where its `images` go, in order. The model's processor
(transformers' `AutoProcessor`) decides both halves:
- at tokenization, the chat template writes a placeholder for each image (`<image>`, or Qwen2-VL's
  `<|vision_start|><|image_pad|><|vision_end|>`), which is replaced by the tokens the processor expands it to for
  that image (their number depends on the image's size for Qwen2-VL), never learned. The cache stores these ids and
  the images' paths, not pixels;
- per batch, in the DataLoader's workers, the processor turns the images into the model's image inputs
  (`pixel_values`, and `image_grid_thw` for Qwen2-VL).
Both calls go through the processor itself, so whatever it does to the text for an image is what training sees.
"""

from __future__ import annotations

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
            image.verify()
    except (UnidentifiedImageError, OSError, SyntaxError) as exc:
        raise UserError(f"{where}: image {entry!r} is not an image PIL can read ({exc.__class__.__name__})") from None
    return str(path.resolve())


class ImageInputs:
    """The model's processor, as the data pipeline uses it; picklable (it travels to tokenizing processes and
    DataLoader workers)."""

    def __init__(self, processor: Any, *, model_type: str = "") -> None:
        self.processor = processor
        self.model_type = model_type
        tokenizer = processor.tokenizer
        self.placeholder = _placeholder(processor)
        self.placeholder_ids: list[int] = tokenizer(self.placeholder, add_special_tokens=False)["input_ids"]
        names = getattr(processor, "model_input_names", ())
        self.token_types = next((name for name in TOKEN_TYPES if name in names), None)

    def identity(self) -> str:
        """A digest of what decides an image's tokens: the processor's class and settings."""
        settings = json.dumps(json.loads(self.processor.image_processor.to_json_string()), sort_keys=True)
        return hashlib.sha256(f"{type(self.processor).__name__}\n{self.placeholder}\n{settings}".encode()).hexdigest()

    def expand(self, ids: list[int], learned: list[bool], paths: list[str], where: str) -> tuple[list[int], list[bool]]:
        """The conversation's ids with each image placeholder replaced by that image's tokens (never learned)."""
        if self.model_type in REFUSED:
            raise UserError(
                f"{where}: rows with images do not train on {self.model_type} yet: {REFUSED[self.model_type]}; "
                "use Qwen2-VL, LLaVA, Gemma 3 or Idefics3, or text rows"
            )
        n = len(self.placeholder_ids)
        at = [i for i in range(len(ids) - n + 1) if ids[i : i + n] == self.placeholder_ids]
        if len(at) != len(paths):
            raise UserError(
                f"{where}: {len(at)} image placeholder(s) in the rendered conversation but {len(paths)} image(s) in "
                '\'images\'; give one {"type": "image"} part per image'
            )
        out_ids, out_learned, last = [], [], 0
        for start, path in zip(at, paths, strict=True):
            tokens = self._processed([path])["input_ids"][0].tolist()
            out_ids += [*ids[last:start], *tokens]
            out_learned += [*learned[last:start], *[False] * len(tokens)]
            last = start + n
        return out_ids + ids[last:], out_learned + learned[last:]

    def batch_inputs(self, input_ids: torch.Tensor, images: list[list[str]]) -> dict[str, torch.Tensor]:
        """The model's image inputs for a batch whose row i holds the images at `images[i]`, in order."""
        paths = [path for row in images for path in row]
        processed = self._processed(paths)
        out = {k: v for k, v in processed.items() if k not in (*TEXT_INPUTS, *TOKEN_TYPES)}
        if self.token_types is None:
            return out
        types = torch.zeros_like(input_ids)
        expanded = iter(
            zip(processed["input_ids"], processed["attention_mask"], processed[self.token_types], strict=True)
        )
        for row, row_images in enumerate(images):
            ids, start = input_ids[row].tolist(), 0
            for _ in row_images:
                tokens, real, marks = next(expanded)
                tokens, marks = tokens[real.bool()].tolist(), marks[real.bool()]
                start = next(i for i in range(start, len(ids)) if ids[i : i + len(tokens)] == tokens)
                types[row, start : start + len(tokens)] = marks
                start += len(tokens)
        out[self.token_types] = types
        return out

    def _processed(self, paths: list[str]) -> dict[str, torch.Tensor]:
        from PIL import Image

        images = []
        for path in paths:
            with Image.open(path) as image:
                images.append([image.convert("RGB")])  # one text per image, and its image (Gemma 3 takes no less)
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


def load_image_inputs(model_path: Path) -> ImageInputs | None:
    """The model's processor, if it has one that takes images (a VLM's directory holds its processor config)."""
    if not any((model_path / name).is_file() for name in ("processor_config.json", "preprocessor_config.json")):
        return None
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_path)
    if getattr(processor, "image_processor", None) is None or getattr(processor, "tokenizer", None) is None:
        return None
    model_type = json.loads((model_path / "config.json").read_text()).get("model_type", "")
    return ImageInputs(processor, model_type=model_type)
