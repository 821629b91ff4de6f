"""Image-text models on the meta device: which class builds them, their parts, what --lora_target_modules adapts,
and the one-line refusal of a model that is neither a causal LM nor an image-text model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from qlora_fsdp.config.options import LoraConfig, ModelConfig
from qlora_fsdp.errors import UserError
from qlora_fsdp.model.lora import inject_lora
from qlora_fsdp.model.skeleton import build_skeleton, meta_model
from qlora_fsdp.model.vision import VisionParts, split_vision_targets, vision_parts
from tests.parity import make_quant_backend
from tests.vlm_models import build_vlm


@pytest.fixture(scope="module")
def vlms(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlm-unit")
    return {f: build_vlm(f, root / f, tokenizer_from=tiny_model) for f in ("qwen2_vl", "llava", "gemma3", "idefics3")}


def test_parts_of_each_family(vlms: dict[str, Path]) -> None:
    qwen = meta_model(vlms["qwen2_vl"], dtype=torch.float32, trust_remote_code=False)
    llava = meta_model(vlms["llava"], dtype=torch.float32, trust_remote_code=False)
    assert type(qwen).__name__ == "Qwen2VLForConditionalGeneration"
    assert vision_parts(qwen) == VisionParts("model.language_model", ("model.visual",), ())
    parts = vision_parts(llava)
    assert (parts.language, parts.tower, parts.projector) == (
        "model.language_model",
        ("model.vision_tower",),
        ("model.multi_modal_projector",),
    )
    assert parts.unquantized(quantize_vision=True) == ("model.multi_modal_projector.",)
    idefics = meta_model(vlms["idefics3"], dtype=torch.float32, trust_remote_code=False)
    assert vision_parts(idefics) == VisionParts("model.text_model", ("model.vision_model",), ("model.connector",))
    gemma = meta_model(vlms["gemma3"], dtype=torch.float32, trust_remote_code=False)
    assert vision_parts(gemma) == VisionParts("model.language_model", ("model.vision_tower",),
                                              ("model.multi_modal_projector",))  # fmt: skip


def test_quantize_vision_quantizes_the_tower_but_not_the_projector(vlms: dict[str, Path]) -> None:
    def quantized(flag: bool) -> list[str]:
        cfg = ModelConfig(model=str(vlms["llava"]), quantize_vision=flag)
        return build_skeleton(cfg, backend=make_quant_backend("bnb"), param_dtype=torch.float32).quantized

    off, on = quantized(False), quantized(True)
    assert off and all(n.startswith("model.language_model.") for n in off)
    tower = [n for n in on if n.startswith("model.vision_tower.")]
    assert tower and set(on) == set(off) | set(tower)
    assert not any(n.startswith("model.multi_modal_projector.") for n in on)


@pytest.mark.parametrize(
    ("spec", "adapted_vision", "excluded"),
    [
        ("all", (), ("model.vision_tower", "model.multi_modal_projector")),
        ("q_proj,v_proj", (), ("model.vision_tower", "model.multi_modal_projector")),
        ("all,multi_modal_projector", ("model.multi_modal_projector",), ("model.vision_tower",)),
        ("q_proj,vision_tower,model.multi_modal_projector", ("model.vision_tower", "model.multi_modal_projector"), ()),
    ],
)
def test_lora_targets_name_the_language_model_unless_a_vision_part_is_named(
    vlms: dict[str, Path], spec: str, adapted_vision: tuple[str, ...], excluded: tuple[str, ...]
) -> None:
    """A name the language model shares with the vision tower (q_proj) adapts the language model only; naming a
    part (by attribute or qualified name) adapts every linear in it, as PEFT itself builds it from the config."""
    skeleton = build_skeleton(ModelConfig(model=str(vlms["llava"])), backend=None, param_dtype=torch.float32)
    model = skeleton.model
    _, _, exclude = split_vision_targets(spec, vision_parts(model), model)
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    peft_model = inject_lora(model, LoraConfig(lora_target_modules=spec, lora_rank=4), dtype=torch.float32)
    adapted = {n.removeprefix("base_model.model.").removesuffix(".lora_A") for n, _ in peft_model.named_modules()
               if n.endswith(".lora_A")}  # fmt: skip
    vision = {n for n in adapted if not n.startswith("model.language_model.")}
    assert vision == {n for n in linears if adapted_vision and n.startswith(adapted_vision)}
    assert any(n.startswith("model.language_model.") and n.endswith("q_proj") for n in adapted)
    for part in excluded:  # what PEFT is told to leave out, so that PEFT onto transformers' model builds the same
        assert exclude and all(re.fullmatch(exclude, n) for n in linears if n.startswith(f"{part}."))
    assert (exclude is None) == (not excluded)


def test_a_model_that_is_neither_causal_nor_image_text_is_refused_in_one_line(tmp_path: Path) -> None:
    from transformers import ViTConfig

    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(
        tmp_path
    )
    with pytest.raises(UserError, match=r"ViTConfig is neither a causal language model nor an image-text model") as exc:
        meta_model(tmp_path, dtype=torch.float32, trust_remote_code=False)
    assert "\n" not in str(exc.value)


def test_the_cache_keeps_image_ids_and_paths_and_is_rebuilt_when_an_image_changes(
    vlms: dict[str, Path], tmp_path: Path
) -> None:
    """An image row's cached ids hold the processor's image tokens in place of the placeholder (never labels) and
    its image's path; a changed image file makes the next run build the cache again, as a changed row would."""
    import json

    from PIL import Image

    from qlora_fsdp.data.cache import CacheSpec, open_cache
    from qlora_fsdp.data.formats import IGNORE_INDEX
    from qlora_fsdp.data.images import load_image_inputs
    from qlora_fsdp.model.hub import load_tokenizer

    model = vlms["llava"]
    images, tokenizer = load_image_inputs(model), load_tokenizer(model)
    assert images is not None and images.placeholder == "<image>"
    Image.new("RGB", (28, 28), (255, 0, 0)).save(tmp_path / "red.png")
    row = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Color?"}]},
                        {"role": "assistant", "content": "It is red."}], "images": ["red.png"]}  # fmt: skip
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    spec = CacheSpec(dataset=str(tmp_path / "rows.jsonl"), dataset_samples=0, prompt_style="alpaca",
                     context_length=64, packing_split=False, train_on_inputs=False)  # fmt: skip

    def opened() -> tuple[object, bool]:
        return open_cache(spec, tokenizer, images, cache_dir=tmp_path / "cache")

    cache, built = opened()
    ids, labels = cache.samples[0]
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    at = [i for i, t in enumerate(ids) if t == image_token]
    assert built and len(at) == 4 and at == list(range(at[0], at[0] + 4))  # 2 x 2 patches, in one run
    assert all(labels[i] == IGNORE_INDEX for i in at)
    assert cache.samples.images(0) == [str((tmp_path / "red.png").resolve())]
    assert opened()[1] is False
    Image.new("RGB", (28, 28), (0, 0, 255)).save(tmp_path / "red.png")
    assert opened()[1] is True


@pytest.fixture(scope="module")
def gemma3_smollm2_tokenizer(tmp_path_factory: pytest.TempPathFactory, smollm2: Path) -> Path:
    """Gemma 3 with SmolLM2's byte-level tokenizer, which has tokens for runs of newlines (as Gemma's own has): the
    newlines its processor puts around an image merge with the text beside them."""
    return build_vlm("gemma3", tmp_path_factory.mktemp("gemma3-smollm2") / "gemma3", tokenizer_from=smollm2)


@pytest.mark.parametrize("family", ["llava", "gemma3", "gemma3-smollm2-tokenizer", "idefics3", "qwen2_vl"])
def test_a_collated_image_row_is_what_the_processor_makes_of_it(
    vlms: dict[str, Path], request: pytest.FixtureRequest, tmp_path: Path, family: str
) -> None:
    """A cached image row, collated: its ids, pixels and per-token image marks (Gemma 3's token_type_ids, Qwen2-VL's
    mm_token_type_ids) equal what the family's own processor returns for the rendered row with its image, and its
    labels are the reply's tokens and end-of-turn token alone. With a tokenizer that merges newlines, Gemma 3's
    image text is tokenized with its neighbours, as the processor does (tokenizing it alone split them otherwise)."""
    import json
    import random

    from PIL import Image
    from transformers import AutoProcessor

    from qlora_fsdp.data.cache import CacheSpec, tokenize_in_memory
    from qlora_fsdp.data.formats import IGNORE_INDEX
    from qlora_fsdp.data.images import load_image_inputs
    from qlora_fsdp.data.rows import IMAGE_PREFIX, collate
    from qlora_fsdp.model.hub import load_tokenizer

    model = request.getfixturevalue("gemma3_smollm2_tokenizer") if family.endswith("tokenizer") else vlms[family]
    if not (model / "processor_config.json").is_file():
        pytest.skip("Qwen2-VL's processor needs torchvision (the torch 2.11 set has it)")
    rng = random.Random(0)
    Image.frombytes("RGB", (28, 28), bytes(rng.randrange(256) for _ in range(28 * 28 * 3))).save(tmp_path / "x.png")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Color?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "It is red."}]}]  # fmt: skip
    (tmp_path / "rows.jsonl").write_text(json.dumps({"messages": messages, "images": ["x.png"]}) + "\n")
    spec = CacheSpec(dataset=str(tmp_path / "rows.jsonl"), dataset_samples=0, prompt_style="alpaca",
                     context_length=128, packing_split=False, train_on_inputs=False)  # fmt: skip
    images, tokenizer = load_image_inputs(model), load_tokenizer(model)
    cache = tokenize_in_memory(spec, tokenizer, images)
    (ids, labels), paths = cache.samples[0], cache.samples.images(0)
    batch = collate([{"input_ids": ids, "labels": labels, "images": paths}], pad_id=0, context_length=128,
                    pad_to_context=False, images=images)  # fmt: skip

    processor = AutoProcessor.from_pretrained(model)
    text = processor.apply_chat_template(messages, tokenize=False)
    expected = processor(text=[text], images=[Image.open(tmp_path / "x.png").convert("RGB")], add_special_tokens=False,
                         return_tensors="pt")  # fmt: skip
    n = expected["input_ids"].shape[1]
    assert batch["input_ids"][0, :n].tolist() == expected["input_ids"][0].tolist() and len(ids) == n
    for key, value in expected.items():
        if key not in ("input_ids", "attention_mask"):
            got = batch[f"{IMAGE_PREFIX}{key}"]
            assert torch.equal(got[..., :n] if got.dim() == 2 and key.endswith("type_ids") else got, value), key
    marks = [k for k in expected if k.endswith("token_type_ids")]
    assert bool(marks) == (family.startswith("gemma3") or family == "qwen2_vl") and all(
        expected[k].sum() > 0 for k in marks
    )
    reply = tokenizer("It is red.", add_special_tokens=False)["input_ids"]
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>" if "<|endoftext|>" in tokenizer.get_vocab() else "<|im_end|>")
    assert [t for t in labels if t != IGNORE_INDEX] == [*reply, eot]


def test_the_cache_key_follows_the_processor_settings_and_prompt_completion_rows_carry_images(
    vlms: dict[str, Path], tmp_path: Path
) -> None:
    """Gemma 3's image_seq_length (a processor setting, not the image processor's) decides how many tokens an image
    takes, so it is in the cache key; TRL's conversational prompt/completion rows take images too."""
    import json
    import shutil

    from PIL import Image

    from qlora_fsdp.data.cache import CacheSpec, cache_key, tokenize_in_memory
    from qlora_fsdp.data.images import load_image_inputs
    from qlora_fsdp.model.hub import load_tokenizer

    model = tmp_path / "gemma3"
    shutil.copytree(vlms["gemma3"], model)
    Image.new("RGB", (28, 28), (255, 0, 0)).save(tmp_path / "red.png")
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Color?"}]}]
    completion = [{"role": "assistant", "content": [{"type": "text", "text": "It is red."}]}]
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": prompt, "completion": completion,
                                                     "images": ["red.png"]}) + "\n")  # fmt: skip
    spec = CacheSpec(dataset=str(tmp_path / "rows.jsonl"), dataset_samples=0, prompt_style="alpaca",
                     context_length=64, packing_split=False, train_on_inputs=False)  # fmt: skip
    tokenizer = load_tokenizer(model)
    before = load_image_inputs(model)
    cache = tokenize_in_memory(spec, tokenizer, before)
    image_token = tokenizer.convert_tokens_to_ids("<image_soft_token>")
    assert cache.samples.images(0) and cache.samples[0][0].count(image_token) == 4
    config = json.loads((model / "processor_config.json").read_text())
    (model / "processor_config.json").write_text(json.dumps({**config, "image_seq_length": 9}))
    assert cache_key(spec, tokenizer, load_image_inputs(model))[0] != cache_key(spec, tokenizer, before)[0]


def test_an_image_token_written_in_the_text_is_refused(vlms: dict[str, Path], tmp_path: Path) -> None:
    """Gemma 3's image token typed into a row's text would give the image more tokens than it has features: the row
    is refused in one line, as is a text-only row holding it."""
    import json

    from PIL import Image

    from qlora_fsdp.data.cache import CacheSpec, tokenize_in_memory
    from qlora_fsdp.data.images import load_image_inputs
    from qlora_fsdp.model.hub import load_tokenizer

    model = vlms["gemma3"]
    Image.new("RGB", (28, 28), (255, 0, 0)).save(tmp_path / "red.png")
    for name, images in (("image", ["red.png"]), ("text", [])):
        content = [{"type": "image"}] * len(images) + [{"type": "text", "text": "Is <image_soft_token> red?"}]
        row = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "Yes."}],
               "images": images}  # fmt: skip
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
        spec = CacheSpec(dataset=str(tmp_path / f"{name}.jsonl"), dataset_samples=0, prompt_style="alpaca",
                         context_length=64, packing_split=False, train_on_inputs=False)  # fmt: skip
        with pytest.raises(UserError, match=r"row 1: the text holds the image token '<image_soft_token>' outside"):
            tokenize_in_memory(spec, load_tokenizer(model), load_image_inputs(model))
