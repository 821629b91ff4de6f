"""Tiny random image-text models in the layouts transformers saves them in, with the tiny Llama's tokenizer plus the
family's image tokens: Qwen2-VL (its own vision transformer, M-RoPE), LLaVA (CLIP + Llama, saved under the
names from before transformers 5, which loading converts), Gemma 3 (SigLIP, pooled image tokens that attend to
each other both ways) and Idefics3 (SmolVLM's architecture: pixel shuffle into a Llama)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

FAMILIES = ("qwen2_vl", "llava", "gemma3", "idefics3")
IMAGE_TOKENS = {
    "qwen2_vl": ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"],
    "llava": ["<image>"],
    "gemma3": ["<start_of_image>", "<image_soft_token>", "<end_of_image>"],
    "idefics3": ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"],
    "mllama": ["<|image|>", "<|python_tag|>"],
}
GEMMA3_TOKENS = dict(zip(("boi_token", "image_token", "eoi_token"), IMAGE_TOKENS["gemma3"], strict=True))
"""Gemma 3's processor reads these tokenizer attributes (named extra special tokens in tokenizer_config.json)."""
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'image' %}IMAGE{% else %}{{ p.text }}{% endif %}{% endfor %}"
    "{% endif %}<|endoftext|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""A chat template writing each image part as the family's placeholder (IMAGE is replaced)."""
PLACEHOLDERS = {
    "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "llava": "<image>",
    "gemma3": "<start_of_image>",
    "idefics3": "<image>",
    "mllama": "<|image|>",
}
VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14
)
"""A 28 x 28 image is 2 x 2 patches of 14 (CLIP, SigLIP, Idefics3's encoder)."""
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def vlm_config(family: str, *, vocab_size: int, ids: dict[str, int], tokens: dict[str, int]):  # -> PretrainedConfig
    from transformers import (
        CLIPVisionConfig,
        Gemma3Config,
        Idefics3Config,
        LlamaConfig,
        LlavaConfig,
        MllamaConfig,
        Qwen2VLConfig,
    )

    if family == "qwen2_vl":
        pad, start, end, video = (tokens[t] for t in IMAGE_TOKENS[family])
        text = dict(
            TEXT,
            vocab_size=vocab_size,
            max_position_embeddings=512,
            **ids,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
        )
        vision = dict(
            depth=2,
            embed_dim=32,
            hidden_size=64,
            num_heads=2,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_chans=3,
        )
        return Qwen2VLConfig(
            text_config=text,
            vision_config=vision,
            image_token_id=pad,
            video_token_id=video,
            vision_start_token_id=start,
            vision_end_token_id=end,
            tie_word_embeddings=False,
        )
    if family == "llava":
        return LlavaConfig(
            text_config=LlamaConfig(vocab_size=vocab_size, **TEXT, **ids),
            vision_config=CLIPVisionConfig(**VISION),
            image_token_index=tokens["<image>"],
            tie_word_embeddings=False,
        )
    if family == "idefics3":  # SmolVLM's architecture: a SigLIP-like encoder, pixel shuffle, Llama
        return Idefics3Config(
            text_config=LlamaConfig(vocab_size=vocab_size, **TEXT, **ids),
            vision_config=dict(VISION),
            scale_factor=2,
            image_token_id=tokens["<image>"],
            tie_word_embeddings=False,
        )
    if family == "gemma3":
        boi, image, eoi = (tokens[t] for t in IMAGE_TOKENS[family])
        text = dict(TEXT, vocab_size=vocab_size, head_dim=16, max_position_embeddings=512, **ids)
        return Gemma3Config(
            text_config=text,
            vision_config=dict(VISION),
            mm_tokens_per_image=4,
            boi_token_index=boi,
            image_token_index=image,
            eoi_token_index=eoi,
            tie_word_embeddings=False,
        )
    if family == "mllama":  # Llama-3.2-Vision: cross-attention layers read the image (not in FAMILIES: refused)
        text = dict(TEXT, vocab_size=vocab_size, cross_attention_layers=[1], **ids)
        vision = dict(
            VISION, num_global_layers=1, max_num_tiles=4, vision_output_dim=64, intermediate_layers_indices=[0]
        )
        vision["attention_heads"] = vision.pop("num_attention_heads")
        return MllamaConfig(text_config=text, vision_config=vision, image_token_index=tokens["<|image|>"])
    raise ValueError(f"unknown family {family}")


def build_vlm(family: str, out: Path, *, tokenizer_from: Path, seed: int = 0, init_std: float | None = None) -> Path:
    """Save a random `family` model (transformers' own initialisation, with weights of `init_std` where given) to
    `out` with `tokenizer_from`'s tokenizer and the family's image tokens added to it."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS[family]})
    vocab_size = max(json.loads((tokenizer_from / "config.json").read_text())["vocab_size"], len(tokenizer))
    ids = {f"{t}_token_id": getattr(tokenizer, f"{t}_token_id") for t in ("bos", "eos", "pad")}
    tokens = {t: tokenizer.convert_tokens_to_ids(t) for t in IMAGE_TOKENS[family]}
    config = vlm_config(family, vocab_size=vocab_size, ids=ids, tokens=tokens)
    for part in (config, config.text_config) if init_std is not None else ():
        part.initializer_range = init_std
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    model.save_pretrained(out)
    tokenizer.chat_template = CHAT_TEMPLATE.replace("IMAGE", PLACEHOLDERS[family])
    tokenizer.save_pretrained(out)
    if family == "gemma3":  # named special tokens, as Gemma 3's own tokenizer_config.json declares them
        config_file = out / "tokenizer_config.json"
        saved = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({**saved, "extra_special_tokens": GEMMA3_TOKENS}, indent=1))
        tokenizer = AutoTokenizer.from_pretrained(out)
    processor = make_processor(family, tokenizer)
    if processor is not None:
        processor.save_pretrained(out)
    return out


def make_processor(family: str, tokenizer):  # -> ProcessorMixin | None
    """The family's processor for 28 x 28 images (LLaVA: 4 patches of 14; Qwen2-VL: 4 patches merged into one
    token), or None where it needs torchvision and that is not installed (Qwen2-VL's video processor)."""
    import importlib.util

    from transformers import (
        CLIPImageProcessor,
        Gemma3ImageProcessor,
        Gemma3Processor,
        Idefics3ImageProcessor,
        Idefics3Processor,
        LlavaProcessor,
        MllamaImageProcessor,
        MllamaProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
    )

    if family == "llava":
        images = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
        return LlavaProcessor(
            image_processor=images,
            tokenizer=tokenizer,
            patch_size=14,
            num_additional_image_tokens=1,
            vision_feature_select_strategy="default",
            chat_template=tokenizer.chat_template,
        )
    if family == "gemma3":
        images = Gemma3ImageProcessor(size={"height": 28, "width": 28})
        return Gemma3Processor(
            image_processor=images, tokenizer=tokenizer, image_seq_length=4, chat_template=tokenizer.chat_template
        )
    if family == "idefics3":  # one 28 x 28 tile: 2 x 2 patches shuffled into 1 token
        images = Idefics3ImageProcessor(
            do_image_splitting=False, size={"longest_edge": 28}, max_image_size={"longest_edge": 28}
        )
        return Idefics3Processor(
            image_processor=images, tokenizer=tokenizer, image_seq_len=1, chat_template=tokenizer.chat_template
        )
    if family == "mllama":
        images = MllamaImageProcessor(size={"height": 28, "width": 28}, max_image_tiles=4)
        return MllamaProcessor(image_processor=images, tokenizer=tokenizer, chat_template=tokenizer.chat_template)
    if importlib.util.find_spec("torchvision") is None:
        return None
    from transformers import Qwen2VLVideoProcessor

    images = Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=28 * 28 * 4, patch_size=14, merge_size=2)
    return Qwen2VLProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=tokenizer.chat_template,
    )
